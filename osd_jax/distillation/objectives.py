"""What each kind of draft minimises on the buffer, and several optimizer steps of it.

A model draft is scored teacher-forced on the stored sequences; a feature
draft (models/eagle.py) also rolls out on its own predicted features. Both
return sums (loss, weight), so devices holding different amounts of weight
combine exactly: psum both, then divide.
"""

import functools

import jax
import jax.numpy as jnp
import optax

from osd_jax.decoding.drafts import FeatureDraft, HybridDraft, ModelDraft
from osd_jax.distillation import losses, replay, teacher, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.models import eagle
from osd_jax.models.config import LlamaConfig
from osd_jax.when import when

_OBJECTIVES = {}


def register(drafter_type):
  """Decorator: `fn(drafter, params, target_params, buffer, p, cfg)` learns that kind."""
  def wrap(fn):
    _OBJECTIVES[drafter_type] = fn
    return fn
  return wrap


def learnable(drafter):
  """The drafter whose parameters learn (a hybrid learns through its base), or None."""
  if isinstance(drafter, HybridDraft):
    drafter = drafter.base
  return drafter if type(drafter) in _OBJECTIVES else None


@register(ModelDraft)
def _model_draft(drafter: ModelDraft, params, target_params, buffer, p, cfg):
  return update.weighted_loss_sum(params, drafter.config, buffer, p, cfg)


@register(FeatureDraft)
def _feature_draft(drafter: FeatureDraft, params, target_params, buffer, p, cfg):
  """Every rollout level's divergence at the generated tokens, plus smooth-L1
  between its predicted features and the target's (EAGLE's regression).

  Level s at position j predicts c_{j+2} as the s-th token of a proposal
  made after committing j - s + 2 tokens, so it counts only for generated
  tokens g >= s - 1: a real proposal never starts inside the prompt. It
  weighs `level_decay ** (s - 1)`.
  """
  bound = eagle.bind(params, target_params, drafter.config)
  outputs = eagle.rollout(bound, drafter.config, buffer.tokens, buffer.hidden,
                          drafter.rollout)
  n, gen_len = buffer.loss_weight.shape
  g = jnp.arange(gen_len)
  at = buffer.gen_start[:, None] + g - 1  # the position whose output predicts g
  weight = buffer.loss_weight * buffer.is_valid[:, None] * (at >= 0)
  # Unweighted rows get a harmless uniform teacher (see update.weighted_loss_sum).
  p = jnp.where((weight > 0)[..., None], jax.lax.stop_gradient(p), 1.0 / p.shape[-1])
  p = teacher.on_support(p, drafter.config.head_token_ids)  # unless it already is
  take = lambda x, positions: jnp.take_along_axis(
      x, jnp.clip(positions, 0, x.shape[1] - 1)[..., None], axis=1)
  wanted = take(buffer.hidden, at + 1).astype(jnp.float32)
  divergence = losses.divergence(cfg.loss, cfg.beta)
  total = count = 0.0
  for level, out in enumerate(outputs, start=1):
    feature = take(out, at)
    p_t, log_q = losses.tempered(p, eagle.head_logits(bound, feature),
                                 cfg.temperature)
    regression = optax.huber_loss(feature, wanted).mean(-1)
    w = weight * (g >= level - 1) * drafter.level_decay ** (level - 1)
    total += (w * (divergence(p_t, log_q) + drafter.feature_weight * regression)).sum()
    count += w.sum()
  return total, count


def served_cache(drafter, state):
  """The learning model draft's KV cache inside a drafter's serving state (a
  hybrid's: its base's), or None for other kinds. Its prompt positions are
  what the update's pass over each prompt would compute (`Buffer.prompt_k`)."""
  if isinstance(drafter, HybridDraft):
    drafter, state = drafter.base, drafter.base_state(state)
  return state if isinstance(drafter, ModelDraft) else None


def support(drafter) -> tuple[int, ...] | None:
  """The tokens the draft's head scores (None: all)."""
  learner = learnable(drafter)
  config = learner.config
  return config.head_token_ids


def loss_sum(drafter, params, target_params, buffer: Buffer, p_NxGxV,
             cfg: update.DistillConfig):
  """(weighted divergence sum, total weight) of `drafter` on the buffer."""
  learner = learnable(drafter)
  if learner is None:
    raise ValueError(f"{type(drafter).__name__} has no parameters to learn.")
  return _OBJECTIVES[type(learner)](learner, params, target_params, buffer,
                                    p_NxGxV, cfg)


# Samples are scored only up to the longest one held, rounded up to one of
# these: most of a slot-sized sample is padding. Powers of two only: the
# halfway points (192, 384, ...) cut the main job's code updates by a
# quarter, but their programs' kernels took the 8-slot learning pass past
# Linux's default vm.max_map_count (driver.serve_in_turns).
_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)


def distill(drafter, target_params, target_config: LlamaConfig, params, opt_state,
            buffer: Buffer, cfg: update.DistillConfig, *, steps: int = 1,
            minibatch: int = 0, key: jax.Array | None = None,
            extra_steps: int = 0, extra_above: jax.Array | float = jnp.inf,
            axis_name: str | None = None):
  """`steps` optimizer steps: (params, opt_state, first loss, skipped steps).

  minibatch 0: every step over the whole buffer, its teacher built once.
  Otherwise each step over `minibatch` samples drawn from it with `key`
  (replay.py). `extra_steps` more follow where the first step's loss (the
  loss before the update) exceeds `extra_above`. Each step skips itself
  (params and optimizer state untouched) if anything is non-finite.
  """
  if minibatch and key is None:
    raise ValueError("Minibatch replay draws with a key: pass one.")
  run = lambda cut: functools.partial(
      _distill, drafter, target_params, target_config, buffer=cut,
      cfg=cfg, steps=steps, minibatch=minibatch, key=key, extra_steps=extra_steps,
      extra_above=extra_above, axis_name=axis_name)
  return _at_needed_length(buffer, axis_name, run, params, opt_state)


def distill_part(drafter, target_params, target_config: LlamaConfig, params,
                 opt_state, buffer: Buffer, cfg: update.DistillConfig, *,
                 done: jax.Array, first_loss: jax.Array, max_steps: int,
                 steps: int, minibatch: int, key: jax.Array,
                 extra_steps: int = 0, extra_above: jax.Array | float = jnp.inf,
                 axis_name: str | None = None):
  """Up to `max_steps` more steps of the minibatch update `distill` would take
  (same steps, same draws), of which `done` are taken and whose first loss
  is `first_loss` (anything before its first step): (params, opt_state, first
  loss, skipped steps, steps done). An update split so over several calls
  ends where `distill` ends, if the ring did not change in between.
  """
  run = lambda cut: lambda p, o: _steps(
      _one_step(drafter, target_params, target_config, cut, cfg, minibatch, key,
                axis_name), p, o, done=done, first_loss=first_loss,
      max_steps=max_steps, steps=steps, extra_steps=extra_steps,
      extra_above=extra_above)
  return _at_needed_length(buffer, axis_name, run, params, opt_state)


def _at_needed_length(buffer: Buffer, axis_name, run, *operands):
  """run(buffer cut to the shortest of _LENGTHS holding every sample)(*operands)."""
  size = buffer.tokens.shape[1]
  lengths = [n for n in _LENGTHS if n < size] + [size]
  need = buffer.needed_length()
  if axis_name is not None:  # every device must take the same branch
    need = jax.lax.pmax(need, axis_name)
  branch = jnp.searchsorted(jnp.asarray(lengths), need)
  return jax.lax.switch(branch, [run(buffer.truncated(n)) for n in lengths],
                        *operands)


def _one_step(drafter, target_params, target_config, buffer, cfg, minibatch, key,
              axis_name):
  """one((params, opt_state), step) -> ((params, opt_state), (loss, applied))."""
  full = None
  if not minibatch:
    full = update.teacher_probs(target_params, target_config, buffer, support(drafter))

  def one(carry, step):
    params, opt_state = carry
    if minibatch:
      batch = replay.draw(buffer, replay.step_key(key, step), minibatch, axis_name)
      p = update.teacher_probs(target_params, target_config, batch, support(drafter))
    else:
      batch, p = buffer, full
    objective = functools.partial(loss_sum, drafter, target_params=target_params,
                                  buffer=batch, p_NxGxV=p, cfg=cfg)
    (total_loss, weight), grads = update.value_and_trained_grads(objective, params, cfg)
    if axis_name is not None:
      total_loss, weight, grads = jax.lax.psum((total_loss, weight, grads), axis_name)
    scale = 1.0 / jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g: g * scale, grads)
    loss = total_loss * scale
    params, opt_state, applied = update.apply_update(params, opt_state, grads,
                                                     loss, cfg)
    return (params, opt_state), (loss, applied)

  return one


def _distill(drafter, target_params, target_config, params, opt_state, *, buffer,
             cfg, steps, axis_name, minibatch=0, key=None, extra_steps=0,
             extra_above=jnp.inf):
  one = _one_step(drafter, target_params, target_config, buffer, cfg, minibatch,
                  key, axis_name)
  if not extra_steps:
    (params, opt_state), (losses, applied) = jax.lax.scan(
        one, (params, opt_state), jnp.arange(steps))
    return params, opt_state, losses[0], (~applied).sum().astype(jnp.int32)
  params, opt_state, first, skipped, _ = _steps(
      one, params, opt_state, done=jnp.int32(0), first_loss=jnp.float32(jnp.nan),
      max_steps=steps + extra_steps, steps=steps, extra_steps=extra_steps,
      extra_above=extra_above)
  return params, opt_state, first, skipped


def _steps(one, params, opt_state, *, done, first_loss, max_steps, steps,
           extra_steps, extra_above):
  """Steps `done`, `done` + 1, ... of an update, at most `max_steps` of them,
  while there are some left: `steps`, plus `extra_steps` where its first
  loss is above the bar. One loop whose last trips may do nothing: the step
  is compiled once, not once per count (the update's kernels count against
  vm.max_map_count, driver.py)."""

  def maybe(carry, _):
    params, opt_state, first_loss, done = carry
    extra = first_loss > extra_above  # NaN before the first step: no
    takes = (done < steps) | ((done < steps + extra_steps) & extra)

    def run(operand):
      (p, o), (loss, applied) = one(operand[:2], done)
      return p, o, loss, applied

    params, opt_state, loss, applied = when(
        takes, run, (params, opt_state, jnp.float32(jnp.nan), jnp.bool_(True)))
    first_loss = jnp.where(takes & (done == 0), loss, first_loss)
    return (params, opt_state, first_loss, done + takes), ~applied

  (params, opt_state, first_loss, done), skipped = jax.lax.scan(
      maybe, (params, opt_state, first_loss, done), None, length=max_steps)
  return params, opt_state, first_loss, skipped.sum().astype(jnp.int32), done


def expected_acceptance(drafter, target_params, target_config: LlamaConfig, params,
                        buffer: Buffer, *, greedy: bool,
                        axis_name: str | None = None) -> jax.Array:
  """[] the draft's mean acceptance at the buffer's weighted positions
  (update.acceptance_sum), over all devices; NaN for a draft that is not a
  model draft, or where nothing weighs."""
  learner = learnable(drafter)
  if not isinstance(learner, ModelDraft):
    return jnp.float32(jnp.nan)
  p = update.teacher_probs(target_params, target_config, buffer, support(drafter))
  total, weight = update.acceptance_sum(params, learner.config, buffer, p, greedy)
  if axis_name is not None:
    total, weight = jax.lax.psum((total, weight), axis_name)
  return jnp.where(weight > 0, total / jnp.maximum(weight, 1e-9), jnp.nan)
