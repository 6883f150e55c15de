"""The distillation update: what is differentiated, what is skipped, what is selectable.

Mostly update.py and objectives.py on hand-made buffers; one served buffer
comes from the slot engine's own step and records.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from osd_jax.decoding import slots as slot_lib
from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import ModelDraft
from osd_jax.decoding.sampling import GREEDY, Sampling
from osd_jax.distillation import losses, objectives, teacher, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.distillation.update import DistillConfig
from osd_jax.models import llama
from osd_jax.serving import online
from osd_jax.serving.records import Records, samples as record_samples
from tests.test_online import (VOCAB, host, max_abs_diff, tiny_pair,
                               tree_equal)

N, MAX_LEN, GEN_LEN = 4, 14, 6
CFG = DistillConfig(learning_rate=1e-2)
STATICS = ("drafter", "target_config", "cfg", "steps", "axis_name")
distill = jax.jit(objectives.distill, static_argnames=STATICS)
unbucketed = jax.jit(objectives._distill,  # pylint: disable=protected-access
                     static_argnames=STATICS)
loss_fn = jax.jit(update.loss_fn, static_argnums=(1, 4))
apply = jax.jit(llama.apply, static_argnames="config")


def learn(params, opt_state, buffer, cfg=CFG, steps=1):
  """objectives.distill for the tiny draft: (params, opt_state, loss, skipped)."""
  target, draft = tiny_pair()
  return distill(draft.drafter, target.params, target.config, params, opt_state,
                 buffer, cfg, steps=steps)


def target_probs(tokens, gen_start):
  """Plain target forward: the next-token distribution at each generated position."""
  target, _ = tiny_pair()
  logits, _ = apply(target.params, target.config, jnp.asarray(tokens))
  probs = jax.nn.softmax(logits, axis=-1)
  positions = gen_start[:, None] + np.arange(GEN_LEN)
  return np.asarray(jnp.take_along_axis(probs, positions[..., None], axis=1))


def make_buffer(teacher_k, seed=0, max_len=MAX_LEN, gen_start=(3, 5, 7, 2)):
  """N valid samples with random tokens, some weights zero, teacher from the target."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, VOCAB, (N, max_len)).astype(np.int32)
  gen_start = np.array(gen_start, np.int32)
  weight = (rng.random((N, GEN_LEN)) < 0.6).astype(np.float32)
  weight[:, 0] = 1.0
  p = target_probs(tokens, gen_start)
  if teacher_k:
    ids, probs = teacher.top_k(jnp.asarray(p), teacher_k)
  else:
    ids = probs = np.zeros((N, GEN_LEN, 0), np.float32)
  buffer = Buffer.empty(N, max_len, GEN_LEN, teacher_k)
  return buffer.add(tokens, gen_start, weight, ids, probs,
                    np.zeros(N, np.int32), jnp.ones(N, bool)), p


def start(distill_cfg=CFG):
  _, draft = tiny_pair()
  params = jax.tree.map(jnp.array, draft.params)
  return params, update.init_opt_state(params, distill_cfg)


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
  config = draft.drafter.config
  buffer, p = make_buffer(VOCAB)
  buffer = buffer.replace(is_valid=jnp.asarray([True, True, False, True]))
  loss, total = loss_fn(draft.params, config, buffer, jnp.asarray(p), CFG)
  logits, _ = apply(draft.params, config, buffer.tokens)
  positions = np.asarray(buffer.gen_start)[:, None] + np.arange(GEN_LEN)
  q = np.take_along_axis(np.asarray(jax.nn.softmax(logits, -1)),
                         positions[..., None], axis=1)
  per = np.sum(p * (np.log(p) - np.log(q)), axis=-1)
  w = np.asarray(buffer.loss_weight) * np.asarray(buffer.is_valid)[:, None]
  assert float(total) == w.sum()
  np.testing.assert_allclose(loss, (per * w).sum() / w.sum(), rtol=1e-4)


@functools.partial(jax.jit, static_argnames=("sampling", "keep_prompts"))
def served_buffer(params, prompts_NxP, lens_N, rng, sampling, draft_params=None,
                  keep_prompts=False):
  """What the slot engine buffers when a draft of the target's shape (the
  target itself by default) serves; with the draft's prompt keys/values."""
  target, _ = tiny_pair()
  config, drafter = target.config, ModelDraft(target.config)
  params = llama.for_decoding(params, config)
  draft_params = params if draft_params is None else draft_params
  state, _ = speculative.start(
      params, draft_params, prompts_NxP, lens_N, jnp.full((N,), GEN_LEN),
      speculative.row_keys(rng, N), target_config=config, drafter=drafter, k=2,
      cache_size=MAX_LEN)

  def step(state, records):
    state, result = speculative.speculate_and_verify(
        params, draft_params, state, target_config=config, drafter=drafter, k=2,
        sampling=sampling)
    return state, records.record(result, corrected_only=False)

  state, records = slot_lib.decode_loop(
      step, state, Records.empty(N, MAX_LEN, VOCAB, 0).replace(keeps=jnp.ones(N, bool)),
      GEN_LEN)
  rows = record_samples(records, state, max_len=MAX_LEN, gen_len=GEN_LEN,
                        weighting="all")
  prompts = state.draft if keep_prompts else None
  return Buffer.empty(N, MAX_LEN, GEN_LEN, VOCAB, prompt_cache=prompts).add(
      *rows[:5], jnp.zeros(N, jnp.int32), jnp.ones(N, bool), prompt_cache=prompts)


def test_an_update_on_the_served_prompt_cache_equals_one_recomputing_it():
  """Serving's prefill left the draft's prompt keys and values in its cache;
  an update reading them takes the step one running the draft over the
  prompts again takes. Kept from another draft, they give another step."""
  target, _ = tiny_pair()
  noise = lambda x, seed: x + 0.05 * jax.random.normal(jax.random.key(seed), x.shape)
  draft_params = jax.tree.map(lambda x: noise(x, 7), target.params)
  rng = np.random.default_rng(2)
  prompts = jnp.asarray(rng.integers(3, VOCAB, (N, 6)), jnp.int32)
  lens = jnp.asarray([5, 3, 6, 4], jnp.int32)
  serve = lambda params: served_buffer(
      target.params, prompts, lens, jax.random.key(0), GREEDY,
      llama.for_decoding(params, target.config), keep_prompts=True)
  kept = serve(draft_params)
  assert kept.keeps_prompt_cache
  recomputing = kept.replace(prompt_k=(), prompt_v=())
  drafter = ModelDraft(target.config)

  def step(buffer):
    opt_state = update.init_opt_state(draft_params, CFG)
    return distill(drafter, target.params, target.config, draft_params, opt_state,
                   buffer, CFG)

  params, _, loss, skipped = step(kept)
  again, _, loss_again, _ = step(recomputing)
  assert int(skipped) == 0 and float(loss) > 1e-3
  np.testing.assert_allclose(float(loss), float(loss_again), rtol=1e-5)
  assert max_abs_diff(params, draft_params) > 1e-3
  assert max_abs_diff(params, again) < 1e-5
  # The same samples with the prompts' keys/values of another draft.
  other = kept.replace(prompt_k=serve(target.params).prompt_k,
                       prompt_v=serve(target.params).prompt_v)
  assert max_abs_diff(step(other)[0], again) > 1e-4


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0),
                                      Sampling(temperature=2.0),
                                      Sampling(temperature=0.5),
                                      Sampling(temperature=1.0, top_k=4)])
def test_draft_equal_to_target_has_zero_loss(sampling):
  """The kept teacher is the plain softmax whatever the serving sampler."""
  target, _ = tiny_pair()
  rng = np.random.default_rng(1)
  prompts = jnp.asarray(rng.integers(3, VOCAB, (N, 6)), jnp.int32)
  buffer = served_buffer(target.params, prompts, jnp.full((N,), 5, jnp.int32),
                         jax.random.key(0), sampling)
  p = update.teacher_probs(target.params, target.config, buffer)
  loss, total = loss_fn(target.params, target.config, buffer, p, CFG)
  assert float(total) > 0
  assert abs(float(loss)) < 1e-5


def test_only_the_draft_is_differentiated():
  target, draft = tiny_pair()
  buffer, p = make_buffer(0)
  grad_p = jax.jit(jax.grad(lambda p: update.loss_fn(
      draft.params, draft.drafter.config, buffer, p, CFG)[0]))(jnp.asarray(p))
  np.testing.assert_array_equal(grad_p, 0.0)  # the teacher is a constant
  # The recompute path: several updates, the target stays bitwise the same.
  before = host(target.params)
  params, opt_state = start()
  for _ in range(3):
    params, opt_state, loss, skipped = learn(params, opt_state, buffer)
    assert int(skipped) == 0 and np.isfinite(float(loss))
  assert tree_equal(before, host(target.params))
  assert max_abs_diff(params, draft.params) > 1e-3


def test_prompt_read_without_gradient_keeps_the_loss_and_trains_generated_positions():
  """The default reads the prompt once without gradient: the loss is the same
  as a full forward's; the gradient equals the full one when there is no
  prompt to read (gen_start 0) and differs from it when there is."""
  _, draft = tiny_pair()
  config = draft.drafter.config
  full = dataclasses.replace(CFG, prompt_gradient=True)
  loss_and_grad = jax.jit(jax.value_and_grad(update.loss_fn, has_aux=True),
                          static_argnums=(1, 4))
  for gen_start, grads_equal in (((0, 0, 0, 0), True), ((3, 5, 7, 2), False)):
    buffer, p = make_buffer(VOCAB, gen_start=gen_start)
    (loss, _), grads = loss_and_grad(draft.params, config, buffer, jnp.asarray(p), CFG)
    (loss_full, _), grads_full = loss_and_grad(draft.params, config, buffer,
                                               jnp.asarray(p), full)
    np.testing.assert_allclose(float(loss), float(loss_full), rtol=1e-5)
    assert (max_abs_diff(grads, grads_full) < 1e-5) == grads_equal, gen_start


def test_updates_lower_the_loss():
  _, draft = tiny_pair()
  buffer, p = make_buffer(VOCAB)
  params, opt_state = start()
  first, _ = loss_fn(params, draft.drafter.config, buffer, jnp.asarray(p), CFG)
  for _ in range(5):
    params, opt_state, _, _ = learn(params, opt_state, buffer)
  last, _ = loss_fn(params, draft.drafter.config, buffer, jnp.asarray(p), CFG)
  assert float(last) < 0.8 * float(first)


def test_several_update_steps_equal_one_call_per_step():
  """steps=3 is three optimizer steps on the same buffer and teacher: the
  same as three calls of one step; the loss reported is the first one's."""
  buffer, _ = make_buffer(VOCAB)
  params, opt_state = start()
  at_once = learn(params, opt_state, buffer, steps=3)
  one = params, opt_state
  losses_seen = []
  for _ in range(3):
    *one, loss, skipped = learn(*one, buffer)
    losses_seen.append(float(loss))
    assert int(skipped) == 0
  assert max_abs_diff(at_once[:2], one) < 1e-6
  np.testing.assert_allclose(float(at_once[2]), losses_seen[0], rtol=1e-6)
  assert int(at_once[3]) == 0
  assert losses_seen[2] < losses_seen[0]  # they were steps, not one step thrice
  single = learn(params, opt_state, buffer)
  assert max_abs_diff(single[:2], at_once[:2]) > 1e-4


@pytest.mark.parametrize("gen_start, bucket", [((3, 10, 20, 30), 64),
                                               ((3, 10, 20, 57), 64),
                                               ((3, 50, 80, 90), 128)])
def test_length_bucketing_equals_scoring_the_full_buffer(gen_start, bucket):
  """Scoring only up to the bucket of the longest sample changes nothing: the
  positions cut off come after every weighted one (causal attention)."""
  target, draft = tiny_pair()
  buffer, _ = make_buffer(0, max_len=200, gen_start=gen_start)  # recomputed teacher
  buffer = buffer.replace(loss_weight=buffer.loss_weight.at[:, -1].set(1.0))
  need = int(buffer.needed_length())  # the last sample's last token: 64 at the edge
  assert bucket // 2 < need <= bucket < 200
  # SGD: Adam would blow the rounding noise of near-zero gradients up to whole steps.
  cfg = DistillConfig(optimizer="sgd", learning_rate=0.5)
  params, opt_state = start(cfg)
  bucketed = learn(params, opt_state, buffer, cfg, steps=2)
  full = unbucketed(draft.drafter, target.params, target.config, params, opt_state,
                    buffer=buffer, cfg=cfg, steps=2, axis_name=None)
  assert max_abs_diff(bucketed[:2], (params, opt_state)) > 1e-3
  assert max_abs_diff(bucketed[:2], full[:2]) < 1e-6
  np.testing.assert_allclose(float(bucketed[2]), float(full[2]), rtol=1e-5)
  assert int(bucketed[3]) == int(full[3]) == 0


def test_nan_teacher_skips_the_update():
  buffer, _ = make_buffer(VOCAB)
  poisoned = buffer.replace(teacher_probs=buffer.teacher_probs.at[1, 0, 0].set(jnp.nan))
  params, opt_state = start()
  params, opt_state, _, _ = learn(params, opt_state, buffer)
  before = host((params, opt_state))
  new_params, new_opt, loss, skipped = learn(params, opt_state, poisoned, steps=2)
  assert int(skipped) == 2 and not np.isfinite(float(loss))
  assert tree_equal(before, host((new_params, new_opt)))


def test_nan_in_an_invalid_slot_does_not_block_updates():
  buffer, _ = make_buffer(VOCAB)
  stale = buffer.replace(
      teacher_probs=buffer.teacher_probs.at[1].set(jnp.nan),
      is_valid=buffer.is_valid.at[1].set(False))
  params, opt_state = start()
  _, _, loss, skipped = learn(params, opt_state, stale)
  assert np.isfinite(float(loss)) and int(skipped) == 0


def test_non_finite_loss_or_grads_skip_apply_update():
  params = {"w": jnp.arange(6.0).reshape(2, 3)}
  cfg = DistillConfig(learning_rate=0.1)
  opt_state = update.init_opt_state(params, cfg)
  grads = {"w": jnp.ones((2, 3))}
  step = jax.jit(update.apply_update, static_argnums=(4,))
  for loss, g in [(jnp.nan, grads), (jnp.inf, grads),
                  (1.0, {"w": grads["w"].at[0, 1].set(jnp.nan)})]:
    new_params, new_opt, applied = step(params, opt_state, g, jnp.float32(loss), cfg)
    assert not bool(applied)
    assert tree_equal(host((params, opt_state)), host((new_params, new_opt)))
  new_params, _, applied = step(params, opt_state, grads, jnp.float32(1.0), cfg)
  assert bool(applied) and not tree_equal(host(params), host(new_params))


def test_nan_divergence_skips_the_update(monkeypatch):
  """A divergence that returns NaN (patched in) leaves params and state alone."""
  buffer, _ = make_buffer(VOCAB)
  monkeypatch.setattr(losses, "divergence",
                      lambda name, beta=0.5: lambda p, lq: jnp.full(p.shape[:-1], jnp.nan))
  # A config no other test compiles, so the patched divergence is traced.
  cfg = DistillConfig(learning_rate=1e-2, loss="jsd", beta=0.123)
  params, opt_state = start(cfg)
  before = host((params, opt_state))
  new_params, new_opt, loss, skipped = learn(params, opt_state, buffer, cfg)
  assert int(skipped) == 1 and not np.isfinite(float(loss))
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
  target, draft = tiny_pair()
  with pytest.raises(ValueError, match="optimizer"):
    online.init_state(draft.params, draft.drafter, target.config,
                      online.OnlineConfig(distill=DistillConfig(optimizer="lion")),
                      num_devices=1, num_slots=1, seed=0)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_weight_decay_is_applied_or_refused(optimizer):
  cfg = DistillConfig(optimizer=optimizer, learning_rate=0.1, weight_decay=0.5)
  try:
    with_decay = flat(first_updates(cfg)[0])
  except ValueError:
    return  # refused: fine
  without = flat(first_updates(dataclasses.replace(cfg, weight_decay=0.0))[0])
  assert not np.allclose(with_decay, without)


def test_the_embedding_learns_only_when_asked():
  """Frozen by default: no change, and no optimizer moments for it."""
  buffer, _ = make_buffer(teacher_k=8)
  sizes = {}
  for train in (False, True):
    cfg = dataclasses.replace(CFG, train_embedding=train)
    params, opt_state = start(cfg)
    new, _, _, skipped = learn(params, opt_state, buffer, cfg)
    assert int(skipped) == 0
    assert not tree_equal(new["layers"], params["layers"])
    assert tree_equal(new["embed"], params["embed"]) == (not train)
    sizes[train] = sum(x.size for x in jax.tree.leaves(opt_state))
  assert sizes[True] - sizes[False] == 2 * params["embed"].size  # Adam's two moments
