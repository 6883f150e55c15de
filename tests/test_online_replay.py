"""When an update runs and what it trains on: the interval after a clear, a
ring that must not overwrite what it has not trained on, and minibatch replay.

The first tests drive the compiled step directly (test_online's admit and
serve_until_done): requests with one prompt finish in the same call.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding.drafts import Draft, HybridDraft, NGramDraft
from osd_jax.distillation import objectives, replay, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import driver, learning, online
from tests.test_online import (K, MAX_NEW, VOCAB, admit, fresh_state, host, max_abs_diff,
                               per_request, placed_target, query, random_prompts,
                               serve_stream, serve_until_done, tiny_pair)

PROMPT, OTHER = random_prompts([5, 7], seed=3)
BASE = online.OnlineConfig(
    k=K, max_new_tokens=MAX_NEW, cache_size=64, steps_per_call=4,
    update_interval=4, buffer_capacity=8, teacher_k=8, loss_weighting="all",
    distill=DistillConfig(learning_rate=1e-2))


def serve_round(step, state, slots: list[int], prompt=PROMPT):
  """Admits `prompt` into `slots` and serves until all are done: (state, outs)."""
  mesh = step.mesh
  state = admit(step, mesh, placed_target(mesh), state, {s: prompt for s in slots})
  return serve_until_done(step, placed_target(mesh), state)


def updates_in(outs) -> list:
  return [out for out in outs if out.did_update.any()]


def test_after_a_clear_the_next_interval_starts_afresh():
  """6 requests finish at once with I = 4: the update trains on all 6 and
  clears them, so the next update waits for 4 more, not 2."""
  cfg = dataclasses.replace(BASE, clear_after_update=True)
  mesh = online.make_mesh(1)
  step = online.make_step(mesh, target_config=tiny_pair()[0].config,
                          drafter=tiny_pair()[1].drafter, cfg=cfg)
  state = fresh_state(cfg, mesh, 8)
  state, outs = serve_round(step, state, list(range(6)))
  assert len(updates_in(outs)) == 1
  assert int(host(state.buffer).num_fresh.sum()) == 0
  np.testing.assert_array_equal(state.since_update, [0])
  state, outs = serve_round(step, state, [0, 1])
  assert not updates_in(outs)  # 2 of the next 4
  np.testing.assert_array_equal(state.since_update, [2])


def test_requests_that_would_overwrite_untrained_samples_wait_for_their_update():
  """A ring of 4 holds 3 samples not yet trained on when 4 more finish at
  once: the update trains on the 3 first, then the 4 go in and count
  towards the next update."""
  cfg = dataclasses.replace(BASE, buffer_capacity=4, clear_after_update=False)
  target, draft = tiny_pair()
  mesh = online.make_mesh(1)
  step = online.make_step(mesh, target_config=target.config,
                          drafter=draft.drafter, cfg=cfg)
  state = fresh_state(cfg, mesh, 4)
  initial = host(state.draft_params)
  state, outs = serve_round(step, state, [0, 1, 2])
  assert not updates_in(outs)
  waiting = jax.tree.map(lambda x: x[0, 0], host(state.buffer))
  assert int(waiting.is_valid.sum()) == 3
  state, outs = serve_round(step, state, [0, 1, 2, 3], OTHER)
  (out,) = updates_in(outs)
  # Its loss is the initial draft's on the 3 waiting samples (another
  # prompt's 4 would give another loss).
  params = jax.tree.map(lambda x: x[0], initial)
  p = update.teacher_probs(target.params, target.config, waiting)
  total, weight = objectives.loss_sum(draft.drafter, params, target.params,
                                      waiting, p, cfg.distill)
  np.testing.assert_allclose(out.loss[0], total / weight, rtol=1e-5)
  np.testing.assert_array_equal(state.since_update, [4])
  buffer = jax.tree.map(lambda x: x[0, 0], host(state.buffer))
  assert int(buffer.num_fresh) == 4 and int(buffer.is_valid.sum()) == 4


# Minibatch replay -----------------------------------------------------------


def ring(uids, weight_rows=None, capacity=8) -> Buffer:
  """A buffer of len(uids) valid samples with the given request ids."""
  buffer = Buffer.empty(capacity, 6, 3, 0)
  n = len(uids)
  weight = np.ones((n, 3), np.float32) if weight_rows is None else weight_rows
  return buffer.add(np.zeros((n, 6), np.int32), np.zeros(n, np.int32), weight,
                    np.zeros((n, 3, 0), np.int32), np.zeros((n, 3, 0), np.float32),
                    np.zeros(n, np.int32), np.ones(n, bool),
                    uid_B=np.asarray(uids, np.uint32))


def drawn(buffer: Buffer) -> set[int]:
  return {int(u) for u, v in zip(buffer.uid, buffer.is_valid) if v}


def test_a_draw_is_the_same_however_samples_are_laid_out():
  """Eight samples in one ring, or four each in two rings in another order:
  the same minibatch of 3, without repeats, never an unweighted sample."""
  uids = [11, 22, 33, 44, 55, 66, 77, 88]
  weight = np.ones((8, 3), np.float32)
  weight[2] = 0  # nothing to learn in request 33
  key = jax.random.key(4)
  alone = replay.draw(ring(uids, weight), key, 3)
  assert len(drawn(alone)) == 3 and 33 not in drawn(alone)
  assert alone.uid.shape == (3,)
  halves = [ring(uids[i::2], weight[i::2], capacity=4) for i in (1, 0)]
  mesh = online.make_mesh(2)
  stacked = jax.tree.map(lambda *x: np.stack(x), *halves)
  parts = jax.jit(jax.shard_map(
      lambda b: jax.tree.map(lambda x: x[None], replay.draw(
          jax.tree.map(lambda x: x[0], b), key, 3, "data")),
      mesh=mesh, in_specs=jax.sharding.PartitionSpec("data"),
      out_specs=jax.sharding.PartitionSpec("data")))(stacked)
  split = set().union(*(drawn(jax.tree.map(lambda x, i=i: x[i], parts))
                        for i in range(2)))
  assert split == drawn(alone)
  # Other keys draw other minibatches, and every sample comes up.
  seen = set().union(*(drawn(replay.draw(ring(uids, weight), jax.random.key(s), 3))
                       for s in range(20)))
  assert seen == set(uids) - {33}


REPLAY = dataclasses.replace(
    BASE, cache_size=64, steps_per_call=2, buffer_capacity=32, minibatch=3,
    update_steps=3, clear_after_update=False)
QUERIES = [query(p) for p in random_prompts((3, 6, 11, 20, 4, 9, 14, 7), seed=8) * 3]


@pytest.fixture(scope="module")
def replayed():
  _, draft = tiny_pair()
  runs = {n: serve_stream(QUERIES, REPLAY, devices=n, num_slots=8, fresh=True)
          for n in (1, 8)}
  return dict(runs, initial=host(draft.params))


def test_replayed_learning_on_eight_devices_equals_one(replayed):
  """Minibatches drawn from rings laid out over 8 devices are the ones one
  device draws: same records, updates, losses and draft after every update
  (24 requests never wrap a ring of 32, on either layout)."""
  one, eight = replayed[1], replayed[8]
  a, b = per_request(one["records"]), per_request(eight["records"])
  assert a.keys() == b.keys() == set(range(len(QUERIES)))
  for i in a:
    for key, value in a[i].items():
      if isinstance(value, float):
        np.testing.assert_allclose(b[i][key], value, rtol=1e-5, atol=1e-6)
      else:
        assert b[i][key] == value, (i, key)
  updates = one["tap"].snapshots
  assert len(updates) >= 4
  assert [u["call"] for u in updates] == [u["call"] for u in eight["tap"].snapshots]
  for u, v in zip(updates, eight["tap"].snapshots):
    np.testing.assert_allclose(u["out"].loss, v["out"].loss, rtol=1e-5)
    # Adam's first step divides each gradient by its own size: an entry near
    # zero, summed over devices in another order, moves by up to a few % of
    # the 1e-2 rate (5e-5 here, not growing: the losses stay equal).
    assert max_abs_diff(u["draft_params"], v["draft_params"]) < 1e-4
  assert max_abs_diff(replayed["initial"], updates[-1]["draft_params"]) > 1e-2
  # The draws move on: the key advanced once an update.
  assert not np.array_equal(updates[0]["replay_key"], updates[-1]["replay_key"])


def test_a_minibatch_as_large_as_the_ring_is_the_full_buffer_step():
  """Replay with every sample drawn is the published full-buffer step."""
  target, draft = tiny_pair()
  rng = np.random.default_rng(0)
  n, length, gen = 4, 12, 5
  tokens = rng.integers(3, 32, (n, length)).astype(np.int32)
  weight = (rng.random((n, gen)) < 0.7).astype(np.float32)
  buffer = Buffer.empty(n, length, gen, 0).add(
      tokens, np.array([2, 3, 4, 5], np.int32), weight,
      np.zeros((n, gen, 0), np.int32), np.zeros((n, gen, 0), np.float32),
      np.zeros(n, np.int32), np.ones(n, bool), uid_B=np.arange(n, dtype=np.uint32))
  opt = update.init_opt_state(draft.params, BASE.distill)
  run = jax.jit(objectives.distill, static_argnames=(
      "drafter", "target_config", "cfg", "steps", "minibatch"))
  args = (draft.drafter, target.params, target.config, draft.params, opt, buffer,
          BASE.distill)
  full = run(*args, steps=2)
  drawn_all = run(*args, steps=2, minibatch=n, key=jax.random.key(1))
  assert max_abs_diff(full[0], drawn_all[0]) < 1e-5
  np.testing.assert_allclose(full[2], drawn_all[2], rtol=1e-5)
  part = run(*args, steps=2, minibatch=2, key=jax.random.key(1))
  assert max_abs_diff(full[0], part[0]) > 1e-5


def test_minibatch_replay_needs_a_key_and_a_sane_size():
  target, draft = tiny_pair()
  with pytest.raises(ValueError, match="key"):
    objectives.distill(draft.drafter, target.params, target.config, draft.params,
                       (), ring([1]), BASE.distill, minibatch=2)
  with pytest.raises(ValueError, match="minibatch"):
    online.OnlineConfig(minibatch=-1)


def test_a_gated_hybrid_learns_where_lookup_missed_and_reports_its_draft():
  """lookup_missed weighting through the loop: samples weigh only some of
  their tokens, every update estimates the new draft's acceptance for the
  gate, and every record says what the learned draft proposed."""
  target, draft = tiny_pair()
  drafter = HybridDraft(draft.drafter, NGramDraft(VOCAB, max_ngram=3, min_ngram=2),
                        draft_cost=0.3, explore_every=2)
  cfg = dataclasses.replace(BASE, loss_weighting="lookup_missed", minibatch=4,
                            update_steps=2, buffer_capacity=16,
                            clear_after_update=False, steps_per_call=2)
  records = []
  queries = [query(p) for p in random_prompts((4, 9, 6, 12), seed=2) * 3]
  state = driver.run_stream(target, Draft(drafter, draft.params, "gated"), queries,
                            cfg, num_slots=4, mesh=online.make_mesh(1), seed=0,
                            chat=False, on_request=records.append)
  assert int(state.num_updates[0]) >= 2
  assert 0.0 <= float(state.last_acceptance[0]) <= 1.0
  buffer = jax.tree.map(lambda x: x[0, 0], host(state.buffer))
  generated = sum(r["new_tokens"] for r in records[-int(buffer.is_valid.sum()):])
  assert 0 < buffer.loss_weight.sum() < generated
  assert all(0 <= r["draft_accepted"] <= r["draft_proposed"] <= r["proposed"]
             for r in records)
  assert sum(r["draft_proposed"] for r in records) > 0


def test_lookup_missed_weighting_needs_a_gated_hybrid():
  target, draft = tiny_pair()
  cfg = dataclasses.replace(BASE, loss_weighting="lookup_missed")
  with pytest.raises(ValueError, match="gated hybrid"):
    online.init_state(draft.params, draft.drafter, target.config, cfg,
                      num_devices=1, num_slots=1, seed=0)


def test_a_loss_above_its_threshold_takes_the_extra_steps():
  """A reaction to a shift is the same loop run on: 3 steps + 2 extra equal
  5 steps where the loss before the update is above the bar, 3 where not."""
  target, draft = tiny_pair()
  uids = np.arange(6, dtype=np.uint32)
  rng = np.random.default_rng(1)
  buffer = Buffer.empty(6, 12, 5, 0).add(
      rng.integers(3, 32, (6, 12)).astype(np.int32), np.full(6, 3, np.int32),
      np.ones((6, 5), np.float32), np.zeros((6, 5, 0), np.int32),
      np.zeros((6, 5, 0), np.float32), np.zeros(6, np.int32), np.ones(6, bool),
      uid_B=uids)
  opt = update.init_opt_state(draft.params, BASE.distill)
  run = jax.jit(objectives.distill, static_argnames=(
      "drafter", "target_config", "cfg", "steps", "minibatch", "extra_steps"))
  args = (draft.drafter, target.params, target.config, draft.params, opt, buffer,
          BASE.distill)
  key = jax.random.key(2)
  five = run(*args, steps=5, minibatch=2, key=key)
  three = run(*args, steps=3, minibatch=2, key=key)
  reacted = run(*args, steps=3, minibatch=2, key=key, extra_steps=2,
                extra_above=0.5 * float(three[2]))
  calm = run(*args, steps=3, minibatch=2, key=key, extra_steps=2,
             extra_above=2.0 * float(three[2]))
  assert max_abs_diff(reacted[:2], five[:2]) == 0.0
  assert max_abs_diff(calm[:2], three[:2]) == 0.0
  assert max_abs_diff(five[0], three[0]) > 1e-4
  # No mean yet (NaN): no reaction.
  nan = run(*args, steps=3, minibatch=2, key=key, extra_steps=2,
            extra_above=jnp.float32(jnp.nan))
  assert max_abs_diff(nan[:2], three[:2]) == 0.0


def test_the_running_loss_mean_starts_at_the_first_update_and_follows():
  mean = learning._running_mean  # pylint: disable=protected-access
  assert float(mean(jnp.float32(jnp.nan), jnp.float32(2.0), jnp.bool_(True))) == 2.0
  assert np.isnan(mean(jnp.float32(jnp.nan), jnp.float32(2.0), jnp.bool_(False)))
  moved = float(mean(jnp.float32(2.0), jnp.float32(4.0), jnp.bool_(True)))
  assert moved == pytest.approx(2.0 + learning.LOSS_RATE * 2.0)
  assert float(mean(jnp.float32(2.0), jnp.float32(jnp.nan), jnp.bool_(True))) == 2.0


def test_shift_settings_are_checked():
  with pytest.raises(ValueError, match="shift"):
    online.OnlineConfig(shift_steps=-1)
  with pytest.raises(ValueError, match="shift"):
    online.OnlineConfig(shift_ratio=1.0)
