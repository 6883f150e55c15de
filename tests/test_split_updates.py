"""Updates split over serve calls (OnlineConfig.update_steps_per_call): an
update taken a step per call ends where the whole update in one call ends,
its shift reaction included, while the streams in flight go on decoding.

The compiled step is driven directly (test_online's admit): four requests
finish together and make an update due; the calls after take its steps.
One program per setting: every call decodes at the slot's full window.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.serving import distributed, online
from osd_jax.serving.checkpoint import Checkpointer
from tests.test_online import (admit, fresh_state, host, max_abs_diff, placed_target,
                               random_prompts, tiny_pair)
from tests.test_online_replay import BASE

STEPS = 3
WHOLE = dataclasses.replace(
    BASE, steps_per_call=1, buffer_capacity=8, minibatch=2, update_steps=STEPS,
    clear_after_update=False, shift_steps=2)
SPLIT = dataclasses.replace(WHOLE, update_steps_per_call=1)
FIRST = random_prompts([5, 6, 7, 4], seed=11)  # finish together: the update is due
LATER = random_prompts([6, 5, 4, 7], seed=12)  # in flight while it is split
# orbax's asyncio helpers complain at garbage collection once closed.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")


def make(cfg):
  target, draft = tiny_pair()
  mesh = online.make_mesh(1)
  return online.make_step(mesh, target_config=target.config,
                          drafter=draft.drafter, cfg=cfg), mesh


def call(step, state):
  """One serve call at the slot's full window: (state, its StepOutput as numpy)."""
  state, out = step.serve(placed_target(step.mesh), state,
                          steps=step.cfg.steps_per_call, window=step.cfg.cache_size)
  return state, host(out)


def with_mean(state, mesh, mean: float):
  """The state with a running loss mean that makes the next update react
  (far below its loss) or not (far above)."""
  return state.replace(loss_mean=distributed.replicate(
      jnp.full(state.loss_mean.shape, mean, jnp.float32), mesh))


def until_due(cfg, mean=None):
  """FIRST served until all four finish; the last call starts the update."""
  step, mesh = make(cfg)
  state = fresh_state(cfg, mesh, 4)
  if mean is not None:
    state = with_mean(state, mesh, mean)
  state = admit(step, mesh, placed_target(mesh), state, dict(enumerate(FIRST)))
  outs = []
  while not bool(np.all(jax.device_get(state.slots.done))):
    state, out = call(step, state)
    outs.append(out)
  return step, state, outs


def whole_update(mean=None):
  _, state, outs = until_due(WHOLE, mean)
  assert outs[-1].did_update[0] and not any(o.did_update[0] for o in outs[:-1])
  return host(state)


def generated(state) -> np.ndarray:
  lengths, prompt_lens = jax.device_get((state.slots.lengths, state.slots.prompt_lens))
  return lengths - prompt_lens


def test_a_split_update_ends_where_the_whole_one_ends_while_streams_decode():
  whole = whole_update()
  step, state, outs = until_due(SPLIT)
  assert outs[-1].trained[0] and not outs[-1].did_update[0]
  assert int(state.update_steps_done[0]) == 1 and int(state.num_updates[0]) == 0
  state = admit(step, step.mesh, placed_target(step.mesh), state,
                dict(enumerate(LATER)))
  calls = []
  while not calls or not calls[-1][0].did_update[0]:
    before = generated(state)
    state, out = call(step, state)
    calls.append((out, generated(state) - before, host(state.num_updates)))
  # Steps 2 and 3 of 3, one per call; tokens streamed out of both.
  assert len(calls) == STEPS - 1
  assert [int(n[0]) for _, _, n in calls] == [0, 1]
  assert all(out.trained[0] for out, _, _ in calls)
  assert all((emitted > 0).all() for _, emitted, _ in calls)
  assert not np.asarray(jax.device_get(state.slots.done)).any()  # none finished
  state = host(state)
  initial = host(fresh_state(WHOLE, step.mesh, 4).draft_params)
  assert max_abs_diff(initial, whole.draft_params) > 1e-4  # the update moved it
  assert max_abs_diff(state.draft_params, whole.draft_params) < 1e-6
  assert max_abs_diff(state.opt_state, whole.opt_state) < 1e-6
  np.testing.assert_allclose(state.last_loss, whole.last_loss, rtol=1e-6)
  np.testing.assert_allclose(calls[-1][0].loss, whole.last_loss, rtol=1e-6)
  np.testing.assert_array_equal(state.replay_key, whole.replay_key)
  np.testing.assert_allclose(state.loss_mean, whole.loss_mean, rtol=1e-6)
  assert int(state.update_steps_done[0]) == 0
  # The update's requests were trained on as it started; nothing is fresh.
  assert int(state.buffer.num_fresh.sum()) == 0


@pytest.mark.parametrize("mean, steps", [(1e-3, STEPS + 2), (1e3, STEPS)])
def test_the_shift_reaction_takes_its_extra_steps_in_split_calls(mean, steps):
  """A loss far above its running mean adds shift_steps to the update, split
  or not; far below, none."""
  whole = whole_update(mean)
  step, state, outs = until_due(SPLIT, mean)
  calls = 1
  while not outs[-1].did_update[0]:
    state, out = call(step, state)
    outs.append(out)
    calls += 1
  assert calls == steps
  state = host(state)
  assert max_abs_diff(state.draft_params, whole.draft_params) < 1e-6
  assert max_abs_diff(state.opt_state, whole.opt_state) < 1e-6
  np.testing.assert_allclose(state.last_loss, whole.last_loss, rtol=1e-6)


def test_a_checkpoint_mid_update_resumes_it(tmp_path):
  """Saved after the update's first step and restored, the update goes on
  from its second: the same draft as without the interruption."""
  whole = whole_update()
  step, state, _ = until_due(SPLIT)
  saver = Checkpointer(str(tmp_path / "run"), {"test": 1}, resume=False)
  saver.save(1, state, {})
  saver.close()
  reader = Checkpointer(str(tmp_path / "run"), {"test": 1}, resume=True)
  restored, _ = reader.restore_latest(fresh_state(SPLIT, step.mesh, 4))
  reader.close()
  assert int(restored.update_steps_done[0]) == 1
  state = online.place_state(restored, step.mesh)
  for _ in range(STEPS - 1):
    state, out = call(step, state)
  assert out.did_update[0]
  state = host(state)
  assert max_abs_diff(state.draft_params, whole.draft_params) < 1e-6
  assert int(state.num_updates[0]) == 1


def test_only_minibatch_replay_from_a_ring_splits_updates():
  for cfg in (dict(minibatch=0), dict(clear_after_update=True)):
    with pytest.raises(ValueError, match="update_steps_per_call"):
      dataclasses.replace(SPLIT, **cfg)
  with pytest.raises(ValueError, match="update_steps_per_call"):
    dataclasses.replace(WHOLE, update_steps_per_call=-1)
