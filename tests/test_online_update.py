"""The distillation update: what is differentiated, what is skipped, what is selectable."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from osd_jax.decoding.sampling import GREEDY, Sampling
from osd_jax.distillation import losses, teacher, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.distillation.update import DistillConfig
from osd_jax.models import llama
from osd_jax.serving import online
from osd_jax.serving.serve import serve_batch
from tests.test_online import (VOCAB, host, max_abs_diff, tiny_pair,
                               tree_equal)

N, MAX_LEN, GEN_LEN = 4, 14, 6
CFG = DistillConfig(learning_rate=1e-2)
distill = jax.jit(online._distill,  # pylint: disable=protected-access
                  static_argnums=(4, 5, 6, 7))
loss_fn = jax.jit(update.loss_fn, static_argnums=(1, 4))
apply = jax.jit(llama.apply, static_argnames="config")


def target_probs(tokens, gen_start):
  """Plain target forward: the next-token distribution at each generated position."""
  target, _ = tiny_pair()
  logits, _ = apply(target.params, target.config, jnp.asarray(tokens))
  probs = jax.nn.softmax(logits, axis=-1)
  positions = gen_start[:, None] + np.arange(GEN_LEN)
  return np.asarray(jnp.take_along_axis(probs, positions[..., None], axis=1))


def make_buffer(teacher_k, seed=0):
  """N valid samples with random tokens, some weights zero, teacher from the target."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, VOCAB, (N, MAX_LEN)).astype(np.int32)
  gen_start = np.array([3, 5, 7, 2], np.int32)
  weight = (rng.random((N, GEN_LEN)) < 0.6).astype(np.float32)
  weight[:, 0] = 1.0
  p = target_probs(tokens, gen_start)
  if teacher_k:
    ids, probs = teacher.top_k(jnp.asarray(p), teacher_k)
  else:
    ids = probs = np.zeros((N, GEN_LEN, 0), np.float32)
  buffer = Buffer.empty(N, MAX_LEN, GEN_LEN, teacher_k)
  return buffer.add(tokens, gen_start, weight, ids, probs,
                    np.zeros(N, np.int32), jnp.ones(N, bool)), p


def cfg_for(teacher_k, distill_cfg=CFG):
  return online.OnlineConfig(k=2, max_new_tokens=GEN_LEN, prompt_len=MAX_LEN - GEN_LEN,
                             teacher_k=teacher_k, distill=distill_cfg)


def start(distill_cfg=CFG):
  _, draft = tiny_pair()
  params = jax.tree.map(jnp.array, draft.params)
  return params, update.make_optimizer(distill_cfg).init(params)


def test_kept_teacher_equals_recomputed_teacher():
  """Top-V kept from 'verification' and one target forward give the same teacher."""
  target, _ = tiny_pair()
  kept, p = make_buffer(VOCAB)
  fresh, _ = make_buffer(0)
  from_buffer = update.teacher_probs(target.params, target.config, kept)
  recomputed = update.teacher_probs(target.params, target.config, fresh)
  np.testing.assert_allclose(from_buffer, p, atol=1e-6)
  np.testing.assert_allclose(recomputed, p, atol=2e-5)


def test_loss_is_weighted_mean_at_predicting_positions():
  """loss_fn == sum(w * FKL(p, q at gen_start + g)) / sum(w), valid samples only."""
  _, draft = tiny_pair()
  buffer, p = make_buffer(VOCAB)
  buffer = buffer.replace(is_valid=jnp.asarray([True, True, False, True]))
  loss, total = loss_fn(draft.params, draft.config, buffer, jnp.asarray(p), CFG)
  logits, _ = apply(draft.params, draft.config, buffer.tokens)
  positions = np.asarray(buffer.gen_start)[:, None] + np.arange(GEN_LEN)
  q = np.take_along_axis(np.asarray(jax.nn.softmax(logits, -1)),
                         positions[..., None], axis=1)
  per = np.sum(p * (np.log(p) - np.log(q)), axis=-1)
  w = np.asarray(buffer.loss_weight) * np.asarray(buffer.is_valid)[:, None]
  assert float(total) == w.sum()
  np.testing.assert_allclose(loss, (per * w).sum() / w.sum(), rtol=1e-4)


def identical_draft_loss(sampling):
  """Loss of a draft equal to the target, on what serving with `sampling` kept."""
  target, _ = tiny_pair()
  cfg = dataclasses.replace(cfg_for(VOCAB), sampling=sampling,
                            loss_weighting="all")
  rng = np.random.default_rng(1)
  prompts = jnp.asarray(rng.integers(3, VOCAB, (N, cfg.prompt_len)), jnp.int32)
  lens = jnp.full((N,), cfg.prompt_len - 2, jnp.int32)
  served = jax.jit(serve_batch, static_argnames=(
      "target_config", "draft_config", "k", "sampling", "max_new_tokens",
      "teacher_k"))(target.params, target.params, prompts, lens,
                    jax.random.key(0), target_config=target.config,
                    draft_config=target.config, k=cfg.k, sampling=sampling,
                    max_new_tokens=cfg.max_new_tokens, teacher_k=cfg.teacher_k)
  rows = online._training_rows(  # pylint: disable=protected-access
      target.params, target.params, prompts, lens, served, jax.random.key(1),
      target.config, target.config, cfg)
  buffer = Buffer.empty(N, cfg.max_len, cfg.max_new_tokens, cfg.teacher_k).add(
      rows[0], lens - 1, *rows[1:], jnp.zeros(N, jnp.int32), jnp.ones(N, bool))
  p = update.teacher_probs(target.params, target.config, buffer)
  loss, total = loss_fn(target.params, target.config, buffer, p, CFG)
  assert float(total) > 0
  return float(loss)


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0),
                                      Sampling(temperature=2.0),
                                      Sampling(temperature=0.5),
                                      Sampling(temperature=1.0, top_k=4)])
def test_draft_equal_to_target_has_zero_loss(sampling):
  """The teacher is the plain softmax whatever the serving sampler."""
  assert abs(identical_draft_loss(sampling)) < 1e-5


def test_only_the_draft_is_differentiated():
  target, draft = tiny_pair()
  buffer, p = make_buffer(0)
  grad_p = jax.jit(jax.grad(lambda p: update.loss_fn(
      draft.params, draft.config, buffer, p, CFG)[0]))(jnp.asarray(p))
  np.testing.assert_array_equal(grad_p, 0.0)  # the teacher is a constant
  # The recompute path: several steps, the target stays bitwise the same.
  before = host(target.params)
  params, opt_state = start()
  cfg = cfg_for(0)
  for _ in range(3):
    params, opt_state, loss, applied = distill(
        target.params, params, opt_state, buffer, target.config, draft.config,
        cfg, None)
    assert bool(applied) and np.isfinite(float(loss))
  assert tree_equal(before, host(target.params))
  assert max_abs_diff(params, draft.params) > 1e-3


def test_updates_lower_the_loss():
  target, draft = tiny_pair()
  buffer, p = make_buffer(VOCAB)
  params, opt_state = start()
  first, _ = loss_fn(params, draft.config, buffer, jnp.asarray(p), CFG)
  for _ in range(5):
    params, opt_state, _, _ = distill(target.params, params, opt_state, buffer,
                                      target.config, draft.config,
                                      cfg_for(VOCAB), None)
  last, _ = loss_fn(params, draft.config, buffer, jnp.asarray(p), CFG)
  assert float(last) < 0.8 * float(first)


def test_nan_teacher_skips_the_update():
  target, draft = tiny_pair()
  buffer, _ = make_buffer(VOCAB)
  poisoned = buffer.replace(teacher_probs=buffer.teacher_probs.at[1, 0, 0].set(jnp.nan))
  params, opt_state = start()
  params, opt_state, _, _ = distill(target.params, params, opt_state, buffer,
                                    target.config, draft.config, cfg_for(VOCAB), None)
  before = host((params, opt_state))
  new_params, new_opt, _, applied = distill(
      target.params, params, opt_state, poisoned, target.config, draft.config,
      cfg_for(VOCAB), None)
  assert not bool(applied)
  assert tree_equal(before, host((new_params, new_opt)))


def test_nan_in_an_invalid_slot_does_not_block_updates():
  target, draft = tiny_pair()
  buffer, _ = make_buffer(VOCAB)
  stale = buffer.replace(
      teacher_probs=buffer.teacher_probs.at[1].set(jnp.nan),
      is_valid=buffer.is_valid.at[1].set(False))
  params, opt_state = start()
  _, _, loss, applied = distill(target.params, params, opt_state, stale,
                                target.config, draft.config, cfg_for(VOCAB), None)
  assert np.isfinite(float(loss)) and bool(applied)


def test_non_finite_loss_or_grads_skip_apply_update():
  params = {"w": jnp.arange(6.0).reshape(2, 3)}
  optimizer = update.make_optimizer(DistillConfig(learning_rate=0.1))
  opt_state = optimizer.init(params)
  grads = {"w": jnp.ones((2, 3))}
  step = jax.jit(update.apply_update, static_argnums=(4,))
  for loss, g in [(jnp.nan, grads), (jnp.inf, grads),
                  (1.0, {"w": grads["w"].at[0, 1].set(jnp.nan)})]:
    new_params, new_opt, applied = step(params, opt_state, g, jnp.float32(loss),
                                        optimizer)
    assert not bool(applied)
    assert tree_equal(host((params, opt_state)), host((new_params, new_opt)))
  new_params, _, applied = step(params, opt_state, grads, jnp.float32(1.0), optimizer)
  assert bool(applied) and not tree_equal(host(params), host(new_params))


def test_nan_divergence_skips_the_update(monkeypatch):
  """A divergence that returns NaN (patched in) leaves params and state alone."""
  target, draft = tiny_pair()
  buffer, _ = make_buffer(VOCAB)
  monkeypatch.setattr(losses, "divergence",
                      lambda name, beta=0.5: lambda p, lq: jnp.full(p.shape[:-1], jnp.nan))
  # A config no other test compiles, so the patched divergence is traced.
  cfg = cfg_for(VOCAB, DistillConfig(learning_rate=1e-2, loss="jsd", beta=0.123))
  params, opt_state = start(cfg.distill)
  before = host((params, opt_state))
  new_params, new_opt, loss, applied = distill(
      target.params, params, opt_state, buffer, target.config, draft.config, cfg,
      None)
  assert not bool(applied) and not np.isfinite(float(loss))
  assert tree_equal(before, host((new_params, new_opt)))


# Optimizer, schedule and clipping by name ------------------------------------

PARAMS = {"a": jnp.asarray([1.0, -2.0, 3.0]), "b": jnp.asarray([[0.5, 0.25]])}
GRADS = {"a": jnp.asarray([0.3, -0.1, 0.2]), "b": jnp.asarray([[-0.4, 0.05]])}


def first_updates(cfg, steps=1, grads=GRADS):
  optimizer = update.make_optimizer(cfg)
  state = optimizer.init(PARAMS)
  out = []
  for _ in range(steps):
    updates, state = optimizer.update(grads, state, PARAMS)
    out.append(updates)
  return out


def flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def test_default_is_the_published_adamw():
  cfg = DistillConfig()
  assert (cfg.loss, cfg.optimizer, cfg.learning_rate, cfg.schedule,
          cfg.weight_decay, cfg.clip_norm) == ("fkl", "adamw", 1e-4, "constant", 0.0, 0.0)
  reference = optax.adamw(1e-4, weight_decay=0.0)
  ref_updates, _ = reference.update(GRADS, reference.init(PARAMS), PARAMS)
  np.testing.assert_allclose(flat(first_updates(cfg)[0]), flat(ref_updates), rtol=1e-6)


def test_optimizers_by_name():
  lr = 0.1
  sgd = flat(first_updates(DistillConfig(optimizer="sgd", learning_rate=lr))[0])
  np.testing.assert_allclose(sgd, -lr * flat(GRADS), rtol=1e-6)
  adam = flat(first_updates(DistillConfig(optimizer="adam", learning_rate=lr))[0])
  np.testing.assert_allclose(adam, -lr * np.sign(flat(GRADS)), rtol=1e-5)
  decay = 0.5
  adamw = flat(first_updates(DistillConfig(optimizer="adamw", learning_rate=lr,
                                           weight_decay=decay))[0])
  np.testing.assert_allclose(adamw, adam - lr * decay * flat(PARAMS), rtol=1e-5)


def test_clipping_by_global_norm():
  lr, clip = 0.1, 0.05
  clipped = flat(first_updates(DistillConfig(optimizer="sgd", learning_rate=lr,
                                             clip_norm=clip))[0])
  assert np.linalg.norm(clipped) == pytest.approx(lr * clip, rel=1e-5)
  np.testing.assert_allclose(clipped / np.linalg.norm(clipped),
                             -flat(GRADS) / np.linalg.norm(flat(GRADS)), rtol=1e-5)
  loose = flat(first_updates(DistillConfig(optimizer="sgd", learning_rate=lr,
                                           clip_norm=100.0))[0])
  np.testing.assert_allclose(loose, -lr * flat(GRADS), rtol=1e-6)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear_warmup"])
def test_schedules(schedule):
  lr, steps = 0.1, 4
  cfg = DistillConfig(optimizer="sgd", learning_rate=lr, schedule=schedule,
                      schedule_steps=steps)
  rates = [float(np.linalg.norm(flat(u)) / np.linalg.norm(flat(GRADS)))
           for u in first_updates(cfg, steps + 2)]
  expected = {
      "constant": [lr] * (steps + 2),
      "cosine": [lr * 0.5 * (1 + np.cos(np.pi * min(t, steps) / steps))
                 for t in range(steps + 2)],
      "linear_warmup": [lr * min(t, steps) / steps for t in range(steps + 2)],
  }[schedule]
  np.testing.assert_allclose(rates, expected, atol=1e-7)


def test_unknown_optimizer_or_schedule_raises():
  with pytest.raises(ValueError, match="optimizer"):
    update.make_optimizer(DistillConfig(optimizer="lion"))
  with pytest.raises(ValueError, match="schedule"):
    update.make_optimizer(DistillConfig(schedule="step"))
  with pytest.raises(ValueError, match="optimizer"):
    online.init_state(tiny_pair()[1].params,
                      online.OnlineConfig(distill=DistillConfig(optimizer="lion")),
                      1, 0)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_weight_decay_is_applied_or_refused(optimizer):
  cfg = DistillConfig(optimizer=optimizer, learning_rate=0.1, weight_decay=0.5)
  try:
    with_decay = flat(first_updates(cfg)[0])
  except ValueError:
    return  # refused: fine
  without = flat(first_updates(dataclasses.replace(cfg, weight_decay=0.0))[0])
  assert not np.allclose(with_decay, without)
