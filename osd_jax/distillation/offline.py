"""The static baseline: distil a draft on a data set before serving, then measure it.

Collection generates a continuation of every training prompt with
`samples.student_generate`, which records the target's top-k at each
generated position; the sample sources mean what they mean online:
- served: the target writes every token (what serving emits: exact target
  samples), so the draft learns on teacher-generated text;
- draft: the draft writes every token (on-policy, DistillSpec);
- mixed_token / mixed_request: per token / per request, the target with
  probability `source_mix`, else the draft.
Offline there is no verification, so every generated position carries a loss.
Training runs epochs of shuffled minibatches shaped like the online `Buffer`,
through the same `update.loss_fn` and `update.apply_update`.
"""

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.decoding.batching import pad_prompts
from osd_jax.decoding.drafts import Draft, ModelDraft
from osd_jax.decoding.engine import Engine
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import samples, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.models.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class OfflineConfig:
  """How the static draft's data is made and how long it trains (hashable)."""

  sample_source: str = "served"
  source_mix: float = 0.5  # target share for the mixed sources
  sampling: Sampling = Sampling()
  max_new_tokens: int = 48
  prompt_len: int = 160  # prompts are padded to this; longer ones are dropped
  teacher_k: int = 32  # 0: recompute the teacher with a target forward per step
  epochs: int = 3
  batch_size: int = 8  # training minibatch
  collect_batch_size: int = 8
  distill: update.DistillConfig = update.DistillConfig(learning_rate=1e-3)

  def __post_init__(self):
    if self.sample_source not in samples.SOURCES:
      raise ValueError(f"sample_source must be one of {samples.SOURCES}, got"
                       f" {self.sample_source!r}.")
    if not 0.0 <= self.source_mix <= 1.0:
      raise ValueError(f"source_mix must be in [0, 1], got {self.source_mix}.")
    if self.epochs < 1 or self.batch_size < 1 or self.collect_batch_size < 1:
      raise ValueError("epochs, batch_size and collect_batch_size must be >= 1.")

  @property
  def max_len(self) -> int:
    return self.prompt_len + self.max_new_tokens


@dataclasses.dataclass
class Result:
  """The distilled draft's parameters, its training data and per-epoch losses."""

  params: dict
  data: Buffer
  loss_before: float
  epoch_losses: list[float]
  seconds: dict[str, float]


def fitting(prompt_ids: Sequence[Sequence[int]], prompt_len: int) -> list[int]:
  """Indices of the prompts that fit the padded width (and have >= 2 tokens)."""
  return [i for i, ids in enumerate(prompt_ids) if 2 <= len(ids) <= prompt_len]


def padded_batches(prompt_ids, batch_size: int, width: int, pad_id: int):
  """Yields (prompts [B, width], lengths [B], is_real [B]); the last is padded."""
  for start in range(0, len(prompt_ids), batch_size):
    yield pad_prompts(list(prompt_ids[start:start + batch_size]), batch_size,
                      width, pad_id)


def _teacher_mix(cfg: OfflineConfig, batch_size: int, rng: np.random.Generator):
  """Per-row probability that a token comes from the target."""
  if cfg.sample_source == "served":
    return np.ones(batch_size, np.float32)
  if cfg.sample_source == "draft":
    return np.zeros(batch_size, np.float32)
  if cfg.sample_source == "mixed_token":
    return np.full(batch_size, cfg.source_mix, np.float32)
  return (rng.random(batch_size) < cfg.source_mix).astype(np.float32)


@functools.partial(jax.jit, static_argnames=(
    "target_config", "draft_config", "sampling", "max_new_tokens", "teacher_k"))
def _collect_batch(target_params, draft_params, prompts_BxP, lens_B, rng,
                   teacher_mix_B, *, target_config, draft_config, sampling,
                   max_new_tokens, teacher_k):
  """Buffer rows of one batch: (tokens [B, P+G], loss weight [B, G], ids, probs)."""
  # teacher_mix is compared with one uniform draw per row, so a [B] array
  # works as well as a scalar: mixed_request gives each row 0 or 1.
  tokens, lengths, ids, probs = samples.student_generate(
      target_params, draft_params, prompts_BxP, lens_B, rng,
      target_config=target_config, draft_config=draft_config, sampling=sampling,
      max_new_tokens=max_new_tokens, teacher_mix=teacher_mix_B,
      teacher_k=teacher_k)
  weight = (jnp.arange(max_new_tokens) < lengths[:, None]).astype(jnp.float32)
  full = jnp.pad(prompts_BxP, ((0, 0), (0, max_new_tokens)))
  full = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(
      row, new, (start,)))(full, tokens, lens_B)
  return full, weight, ids, probs


def collect(target_params, target_config: LlamaConfig, draft_params,
            draft_config: LlamaConfig, prompt_ids: Sequence[Sequence[int]],
            cfg: OfflineConfig, *, seed: int = 0,
            log: Callable[[str], None] = print) -> Buffer:
  """A Buffer with one row per prompt that fits: the continuation and its teacher."""
  keep = fitting(prompt_ids, cfg.prompt_len)
  if not keep:
    raise ValueError(f"No prompt of 2..{cfg.prompt_len} tokens to distil on.")
  if len(keep) < len(prompt_ids):
    log(f"collect: {len(prompt_ids) - len(keep)} prompts longer than"
        f" {cfg.prompt_len} tokens dropped")
  prompt_ids = [prompt_ids[i] for i in keep]
  np_rng = np.random.default_rng(seed)
  rng = jax.random.key(seed)
  parts = []
  start = time.perf_counter()
  for prompts, lens, is_real in padded_batches(
      prompt_ids, cfg.collect_batch_size, cfg.prompt_len, target_config.pad_id):
    rng, batch_rng = jax.random.split(rng)
    rows = _collect_batch(
        target_params, draft_params, jnp.asarray(prompts), jnp.asarray(lens),
        batch_rng, jnp.asarray(_teacher_mix(cfg, len(lens), np_rng)),
        target_config=target_config, draft_config=draft_config,
        sampling=cfg.sampling, max_new_tokens=cfg.max_new_tokens,
        teacher_k=cfg.teacher_k)
    rows = jax.device_get(rows)
    parts.append(tuple(x[is_real] for x in rows) + (lens[is_real],))
    done = sum(len(p[0]) for p in parts)
    log(f"collect: {done}/{len(prompt_ids)} prompts,"
        f" {time.perf_counter() - start:.0f} s")
  tokens, weight, ids, probs, lens = (np.concatenate(x) for x in zip(*parts))
  n = len(tokens)
  return Buffer(tokens=jnp.asarray(tokens), gen_start=jnp.asarray(lens - 1),
                loss_weight=jnp.asarray(weight), teacher_ids=jnp.asarray(ids),
                teacher_probs=jnp.asarray(probs),
                hidden=jnp.zeros(tokens.shape + (0,), jnp.bfloat16),
                category=jnp.zeros((n,), jnp.int32),
                uid=jnp.arange(n, dtype=jnp.uint32),
                is_valid=jnp.ones((n,), bool),
                next_slot=jnp.zeros((), jnp.int32),
                num_added=jnp.asarray(n, jnp.int32),
                num_fresh=jnp.zeros((), jnp.int32))


def _minibatch(data: Buffer, rows_B: jax.Array, is_real_B: jax.Array) -> Buffer:
  """The rows of `data` as a Buffer of B samples; rows not real carry no loss."""
  take = lambda x: x[rows_B] if x.ndim else x
  batch = jax.tree.map(take, data)
  return batch.replace(is_valid=batch.is_valid & is_real_B)


def _loss_and_grads(params, target_params, data, rows_B, is_real_B, *,
                    target_config, draft_config, distill):
  batch = _minibatch(data, rows_B, is_real_B)
  p = update.teacher_probs(target_params, target_config, batch)
  return update.value_and_trained_grads(
      lambda params: update.loss_fn(params, draft_config, batch, p, distill), params,
      distill)


_STATIC = ("target_config", "draft_config", "distill")


@functools.partial(jax.jit, static_argnames=_STATIC,
                   donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, target_params, data: Buffer, rows_B,
               is_real_B, *, target_config: LlamaConfig,
               draft_config: LlamaConfig, distill: update.DistillConfig):
  """One optimizer step on rows of `data`: (params, opt_state, loss, weight, applied)."""
  (loss, weight), grads = _loss_and_grads(
      params, target_params, data, rows_B, is_real_B,
      target_config=target_config, draft_config=draft_config, distill=distill)
  params, opt_state, applied = update.apply_update(params, opt_state, grads, loss,
                                                   distill)
  return params, opt_state, loss, weight, applied


@functools.partial(jax.jit, static_argnames=_STATIC)
def _eval_step(params, target_params, data: Buffer, rows_B, is_real_B, *,
               target_config, draft_config, distill):
  batch = _minibatch(data, rows_B, is_real_B)
  p = update.teacher_probs(target_params, target_config, batch)
  return update.loss_fn(params, draft_config, batch, p, distill)


def _batches(order: np.ndarray, batch_size: int):
  """(rows, is_real) minibatches of a fixed size; the last is padded with row 0."""
  for start in range(0, len(order), batch_size):
    chunk = order[start:start + batch_size]
    rows = np.zeros(batch_size, np.int32)
    rows[:len(chunk)] = chunk
    yield jnp.asarray(rows), jnp.asarray(np.arange(batch_size) < len(chunk))


def mean_loss(params, target_params, target_config: LlamaConfig,
              draft_config: LlamaConfig, data: Buffer,
              cfg: OfflineConfig) -> float:
  """Token-weighted mean divergence of `params` over all of `data`."""
  total = weight = 0.0
  for rows, is_real in _batches(np.arange(data.capacity), cfg.batch_size):
    loss, w = _eval_step(params, target_params, data, rows, is_real,
                         target_config=target_config, draft_config=draft_config,
                         distill=cfg.distill)
    total += float(loss) * float(w)
    weight += float(w)
  return total / max(weight, 1.0)


def train(draft_params, target_params, target_config: LlamaConfig,
          draft_config: LlamaConfig, data: Buffer, cfg: OfflineConfig, *,
          seed: int = 0, log: Callable[[str], None] = print):
  """Epochs of shuffled minibatches; returns (params, mean loss of each epoch)."""
  # A copy: the step donates its parameters, and the caller keeps the draft.
  params = jax.tree.map(jnp.copy, draft_params)
  opt_state = update.init_opt_state(params, cfg.distill)
  np_rng = np.random.default_rng(seed)
  epoch_losses = []
  for epoch in range(cfg.epochs):
    start = time.perf_counter()
    total = weight = 0.0
    skipped = 0
    for rows, is_real in _batches(np_rng.permutation(data.capacity),
                                  cfg.batch_size):
      params, opt_state, loss, w, applied = train_step(
          params, opt_state, target_params, data, rows, is_real,
          target_config=target_config, draft_config=draft_config,
          distill=cfg.distill)
      if bool(applied):
        total += float(loss) * float(w)
        weight += float(w)
      else:
        skipped += 1
    epoch_losses.append(total / max(weight, 1.0))
    note = f", {skipped} non-finite steps skipped" if skipped else ""
    log(f"epoch {epoch + 1}/{cfg.epochs}: loss {epoch_losses[-1]:.4f},"
        f" {time.perf_counter() - start:.1f} s{note}")
  return params, epoch_losses


def distill(target_params, target_config: LlamaConfig, draft_params,
            draft_config: LlamaConfig, prompt_ids: Sequence[Sequence[int]],
            cfg: OfflineConfig, *, seed: int = 0,
            log: Callable[[str], None] = print) -> Result:
  """Collects teacher data on `prompt_ids`, then trains a copy of the draft on it."""
  start = time.perf_counter()
  data = collect(target_params, target_config, draft_params, draft_config,
                 prompt_ids, cfg, seed=seed, log=log)
  collected = time.perf_counter()
  before = mean_loss(draft_params, target_params, target_config, draft_config,
                     data, cfg)
  log(f"{data.capacity} samples, loss before training {before:.4f}")
  params, losses = train(draft_params, target_params, target_config,
                         draft_config, data, cfg, seed=seed, log=log)
  return Result(params, data, before, losses,
                {"collect": collected - start,
                 "train": time.perf_counter() - collected})


def static_alpha(target_params, target_config: LlamaConfig, draft_params,
                 draft_config: LlamaConfig, prompt_ids: Sequence[Sequence[int]],
                 *, k: int, sampling: Sampling, max_new_tokens: int,
                 prompt_len: int, batch_size: int, seed: int = 0) -> dict:
  """Serves `prompt_ids` speculatively with a fixed draft; alpha per request and overall.

  Prompts longer than `prompt_len` are skipped (as in collection), so offline
  and static numbers are measured on the same prompts. Served by the slot
  engine with `batch_size` slots.
  Returns {"alpha": mean over requests, "alpha_per_request", "indices", ...}.
  """
  keep = fitting(prompt_ids, prompt_len)
  target = LoadedModel(target_config, target_params, None, "target")
  draft = Draft(ModelDraft(draft_config), draft_params, "draft")
  engine = Engine(target, draft, k=k, sampling=sampling,
                  max_new_tokens=max_new_tokens, num_slots=batch_size)
  results = engine.generate_ids([list(prompt_ids[i]) for i in keep], seed,
                                 progress_desc="scoring the draft") if keep else []
  sums = {name: sum(r.metrics[name] for r in results)
          for name in ("proposed", "accepted", "target_calls")}
  emitted = sum(len(r.token_ids) for r in results)
  alphas = [r.metrics["alpha"] for r in results]
  ratio = lambda a, b: a / b if b else float("nan")
  return {"alpha_per_request": [float(a) for a in alphas],
          "indices": keep,
          # Mean over requests, as the online driver's rolling alpha is.
          "alpha": float(np.mean(alphas)) if alphas else float("nan"),
          "acceptance_rate": ratio(sums["accepted"], sums["proposed"]),
          "tokens_per_target_call": ratio(emitted, sums["target_calls"]),
          "requests": len(alphas)}
