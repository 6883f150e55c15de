"""One distillation step on the buffer: only the draft is differentiated."""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from osd_jax import hardware
from osd_jax.distillation import losses, teacher
from osd_jax.distillation.buffer import Buffer
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """How the draft learns; defaults are the paper's published setting."""

  loss: str = "fkl"
  beta: float = 0.5  # generalised JSD weight
  temperature: float = 1.0  # of the loss, not of serving
  optimizer: str = "adamw"
  learning_rate: float = 1e-4
  schedule: str = "constant"  # or "cosine", "linear_warmup"
  schedule_steps: int = 1000  # decay / warm-up length in updates
  weight_decay: float = 0.0
  clip_norm: float = 0.0  # 0 = no clipping
  # Backpropagate through the prompt's keys and values too. Off, the prompt
  # is read once without gradient and only generated positions are trained.
  prompt_gradient: bool = False
  # Train the draft's token embedding too. Off (as EAGLE keeps its embedding
  # frozen), it is neither differentiated nor given optimizer state: for a
  # draft cut from SmolLM2 that is 28 M of its 40 M weights, and 226 MB of Adam
  # moments.
  train_embedding: bool = False
  # The dtype the draft's matmuls take their inputs in while it learns;
  # master weights, gradients and optimizer state stay float32. None:
  # bfloat16 where its products are fast (a CPU with AMX, see hardware.py),
  # else the weights' own. On that CPU only the forward products gain: XLA
  # runs the backward ones (a transposed operand) at float32 speed.
  matmul_dtype: str | None = None

  def __post_init__(self):
    losses.divergence(self.loss, self.beta)  # raises on an unknown name
    if self.matmul_dtype not in (None, "float32", "bfloat16"):
      raise ValueError(f"matmul_dtype must be float32 or bfloat16, got {self.matmul_dtype!r}.")
    if self.temperature <= 0:
      raise ValueError(f"Loss temperature must be > 0, got {self.temperature}.")


def make_optimizer(cfg: DistillConfig) -> optax.GradientTransformation:
  """AdamW with a constant rate by default; schedule, clipping, optimizer by name.

  It steps the trained parameters only (`split_trained`): its state is
  `init_opt_state`'s.
  """
  lr = cfg.learning_rate
  schedules = {
      "constant": lambda: lr,
      "cosine": lambda: optax.cosine_decay_schedule(lr, cfg.schedule_steps),
      "linear_warmup": lambda: optax.linear_schedule(0.0, lr, cfg.schedule_steps),
  }
  if cfg.schedule not in schedules:
    raise ValueError(f"Unknown schedule {cfg.schedule!r}: {sorted(schedules)}.")
  rate = schedules[cfg.schedule]()
  optimizers = {
      "adamw": lambda: optax.adamw(rate, weight_decay=cfg.weight_decay),
      "adam": lambda: optax.adam(rate),
      "sgd": lambda: optax.sgd(rate),
  }
  if cfg.optimizer not in optimizers:
    raise ValueError(f"Unknown optimizer {cfg.optimizer!r}: {sorted(optimizers)}.")
  parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm else []
  if cfg.weight_decay and cfg.optimizer == "adam":
    raise ValueError("Weight decay with Adam is AdamW: pass optimizer='adamw'.")
  if cfg.weight_decay and cfg.optimizer == "sgd":
    parts.append(optax.add_decayed_weights(cfg.weight_decay))
  return optax.chain(*parts, optimizers[cfg.optimizer]())


_EMBEDDING = "embed"  # the one parameter kept frozen unless train_embedding


def split_trained(params, cfg: DistillConfig):
  """(trained, frozen): the draft's token embedding apart unless it is trained.

  The frozen part is not differentiated, has no optimizer state and is never
  rewritten: an update touches only what it changes. For a draft cut from
  SmolLM2 the embedding is 28 M of its 40 M weights; carrying it through the
  update as zero gradients and zero steps cost ~60 ms of a ~450 ms update on
  a 2-core CPU. frozen is None when everything is trained.
  """
  if cfg.train_embedding or not isinstance(params, dict) or _EMBEDDING not in params:
    return params, None
  trained = {name: value for name, value in params.items() if name != _EMBEDDING}
  return trained, params[_EMBEDDING]


def joined(trained, frozen):
  """The inverse of split_trained."""
  return trained if frozen is None else dict(trained, **{_EMBEDDING: frozen})


def init_opt_state(params, cfg: DistillConfig):
  """The optimizer's state for the trained part of `params`."""
  return make_optimizer(cfg).init(split_trained(params, cfg)[0])


def learning_matmul_dtype(cfg: DistillConfig) -> str | None:
  """cfg.matmul_dtype resolved on this host (None: the weights' own)."""
  if cfg.matmul_dtype is not None:
    return cfg.matmul_dtype
  return "bfloat16" if hardware.bfloat16_matmuls_are_fast() else None


def with_matmul_dtype(params, dtype: str | None):
  """Every kernel (2+ dimensions) in `dtype`, the embedding aside: it is
  gathered, not multiplied. Differentiating through the cast gives float32
  gradients of the float32 weights."""
  if dtype is None:
    return params
  def cast(path, w):
    named = [getattr(key, "key", None) for key in path]
    if _EMBEDDING in named or w.ndim < 2 or w.dtype == jnp.dtype(dtype):
      return w
    return w.astype(dtype)
  return jax.tree_util.tree_map_with_path(cast, params)


def value_and_trained_grads(objective, params, cfg: DistillConfig):
  """jax.value_and_grad(objective, has_aux=True), over the trained part only,
  with the kernels in the learning matmul dtype."""
  trained, frozen = split_trained(params, cfg)
  dtype = learning_matmul_dtype(cfg)
  return jax.value_and_grad(
      lambda t: objective(with_matmul_dtype(joined(t, frozen), dtype)),
      has_aux=True)(trained)


def _generated_hidden(params, config, buffer: Buffer) -> jax.Array:
  """Final hidden states at the positions that predict generated tokens."""
  hidden_NxLxD, _ = llama.forward(params, config, buffer.tokens)
  gen_len = buffer.loss_weight.shape[1]
  positions = buffer.gen_start[:, None] + jnp.arange(gen_len)
  positions = jnp.minimum(positions, buffer.tokens.shape[1] - 1)
  return jnp.take_along_axis(hidden_NxLxD, positions[..., None], axis=1)


def prefilled_cache(params, config: LlamaConfig, tokens_NxL: jax.Array,
                    size: int) -> KVCache:
  """A `size`-position cache holding the keys and values of all of `tokens`."""
  cache = KVCache.empty(num_layers=config.num_layers, batch_size=tokens_NxL.shape[0],
                        cache_size=size, num_kv_heads=config.num_kv_heads,
                        head_dim=config.head_dim, dtype=config.jnp_dtype)
  return llama.forward(params, config, tokens_NxL, cache, cache_is_empty=True)[1]


def _student_hidden(params, config, buffer: Buffer, prompt_gradient: bool) -> jax.Array:
  """The draft's final hidden states at the positions that predict generated tokens.

  Without `prompt_gradient`, a frozen copy of the parameters reads the whole
  sample into a KV cache, and only the generated positions are run again
  with gradient, on that cache, the way serving runs them. The prompt is
  most of a sample, so a step costs about L + 3G token passes instead of 3L;
  what it leaves out is the gradient through the prompt's keys and values.
  A buffer that kept the prompts' keys and values from serving's prefill
  saves the L: they are the draft's as it was when the request came in (at
  most an update or two older, with the default ring).
  """
  if prompt_gradient:
    return _generated_hidden(params, config, buffer)
  length = buffer.tokens.shape[1]
  gen_len = buffer.loss_weight.shape[1]
  # Room for every generated position, even of samples that end early (the
  # positions past a sample's end carry no weight).
  if buffer.keeps_prompt_cache:  # as serving's prefill wrote them
    cache = buffer.prompt_cache(length + gen_len)
  else:
    cache = prefilled_cache(jax.lax.stop_gradient(params), config, buffer.tokens,
                            length + gen_len)
  positions = jnp.minimum(buffer.gen_start[:, None] + jnp.arange(gen_len), length - 1)
  inputs = jnp.take_along_axis(buffer.tokens, positions, axis=1)
  hidden, _ = llama.forward(params, config, inputs,
                            cache.with_lengths(buffer.gen_start))
  return hidden


def teacher_probs(target_params, target_config: LlamaConfig, buffer: Buffer,
                  support: tuple[int, ...] | None = None) -> jax.Array:
  """The target's distributions at generated positions [N, G, V].

  From the top-k kept at verification when the buffer has them; otherwise
  recomputed with one target forward (the prototype's way, and dearer).
  Always the plain softmax: the draft's own softmax is what is trained, and
  serving applies the same temperature/top-k/top-p to both afterwards.
  With a `support` (a restricted draft head): on those tokens only,
  renormalised, [N, G, len(support)].
  """
  if buffer.keeps_teacher:
    return teacher.dense(buffer.teacher_ids, buffer.teacher_probs,
                         target_config.vocab_size, support)
  hidden = _generated_hidden(target_params, target_config, buffer)
  p = jax.nn.softmax(llama.logits(target_params, target_config, hidden), axis=-1)
  return teacher.on_support(p, support)


def weighted_loss_sum(draft_params, draft_config: LlamaConfig, buffer: Buffer,
                      p_NxGxV: jax.Array,
                      cfg: DistillConfig) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted divergences over valid samples, total weight).

  Sums, not means, so devices with different amounts of weight combine
  exactly: psum both, then divide.
  """
  hidden = _student_hidden(draft_params, draft_config, buffer, cfg.prompt_gradient)
  weight = buffer.loss_weight * buffer.is_valid[:, None]
  # Unweighted rows get a harmless uniform teacher: a stale NaN there would
  # still poison the gradient through 0 * NaN.
  p = jnp.where((weight > 0)[..., None], jax.lax.stop_gradient(p_NxGxV),
                1.0 / p_NxGxV.shape[-1])
  # Loss over the draft head's own rows: a restricted head cannot put mass
  # elsewhere, so the teacher is renormalised onto those rows.
  student_logits = llama.head_logits(draft_params, draft_config, hidden)
  p = teacher.on_support(p, draft_config.head_token_ids)
  p, log_q = losses.tempered(p, student_logits, cfg.temperature)
  per_position = losses.divergence(cfg.loss, cfg.beta)(p, log_q)
  return (per_position * weight).sum(), weight.sum()


def acceptance_sum(draft_params, draft_config: LlamaConfig, buffer: Buffer,
                   p_NxGxV: jax.Array, greedy: bool) -> tuple[jax.Array, jax.Array]:
  """(sum over weighted positions of the draft's acceptance there, total weight).

  Acceptance at a position is sum_v min(p, q), the chance that a token drawn
  from q survives rejection sampling against p; greedy serving accepts
  exactly where the two argmaxes agree.
  """
  hidden = _student_hidden(draft_params, draft_config, buffer, False)
  weight = buffer.loss_weight * buffer.is_valid[:, None]
  q = jax.nn.softmax(llama.head_logits(draft_params, draft_config, hidden), axis=-1)
  p = teacher.on_support(p_NxGxV, draft_config.head_token_ids)
  if greedy:
    accept = (jnp.argmax(p, -1) == jnp.argmax(q, -1)).astype(jnp.float32)
  else:
    accept = jnp.minimum(p, q).sum(-1)
  accept = jnp.where(weight > 0, accept, 0.0)  # a stale NaN weighs nothing
  return (accept * weight).sum(), weight.sum()


def loss_fn(draft_params, draft_config: LlamaConfig, buffer: Buffer,
            p_NxGxV: jax.Array, cfg: DistillConfig) -> tuple[jax.Array, jax.Array]:
  """(weighted mean divergence over valid samples, total weight)."""
  loss_sum, total = weighted_loss_sum(draft_params, draft_config, buffer,
                                      p_NxGxV, cfg)
  return loss_sum / jnp.maximum(total, 1.0), total


def apply_update(draft_params, opt_state, grads, loss, cfg: DistillConfig,
                 axis_name: str | None = None):
  """Averages grads over devices, then steps unless anything is non-finite.

  `grads` are the trained part's (value_and_trained_grads); the frozen part
  comes back as it went in. Returns (params, opt_state, was_applied). A
  skipped step leaves params and optimizer state exactly as they were, so
  serving never sees a NaN.
  """
  if axis_name is not None:
    grads = jax.lax.pmean(grads, axis_name)
    loss = jax.lax.pmean(loss, axis_name)
  is_finite = jnp.isfinite(loss) & jnp.all(jnp.asarray(
      [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  trained, frozen = split_trained(draft_params, cfg)
  updates, new_opt_state = make_optimizer(cfg).update(grads, opt_state, trained)
  new_trained = optax.apply_updates(trained, updates)
  keep = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(is_finite, n, o), new, old)
  return (joined(keep(new_trained, trained), frozen), keep(new_opt_state, opt_state),
          is_finite)
