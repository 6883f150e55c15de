"""The compiled serve-and-learn loop: devices, learning, pad rows, NaN, compiles.

Compiles dominate on CPU, so every test here shares a few compiled steps
(module fixtures) and asserts on the recorded stream. Helpers for the other
test_online_* files live here too.
"""

import functools

import jax
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.distillation.update import DistillConfig
from osd_jax.models import config as configs
from osd_jax.serving import distributed, online
from osd_jax.serving.driver import ROW_METRICS
from tests.tiny_models import word_tokenizer, random_params

VOCAB = 32
MAX_NEW = 8
PROMPT_LEN = 8
BATCH = 8
K = 2


# Helpers shared by the test_online_* files ---------------------------------


@functools.lru_cache(maxsize=None)
def tiny_pair():
  """A 2-layer random target and a draft cut from its first layer (alpha ~0.8)."""
  # Untied head: tied random models just repeat their last token.
  config = configs.tiny(vocab_size=VOCAB, num_layers=2, tie_embeddings=False)
  target = LoadedModel(config, random_params(config, 3), word_tokenizer(VOCAB),
                       "tiny target")
  return target, draft_lib.derive(target, [0])


def prompts(num, seed=0, min_len=3):
  """[num, PROMPT_LEN] right-padded prompts of random lengths, and the lengths."""
  rng = np.random.default_rng(seed)
  lens = rng.integers(min_len, PROMPT_LEN + 1, num).astype(np.int32)
  ids = rng.integers(3, VOCAB, (num, PROMPT_LEN)).astype(np.int32)
  ids[np.arange(PROMPT_LEN) >= lens[:, None]] = 0
  return ids, lens


_MAKE_STEP = online.make_step


@functools.lru_cache(maxsize=None)
def cached_make_step(mesh, *, target_config, draft_config, cfg):
  """online.make_step, compiled once per (mesh, configs) across test files."""
  return _MAKE_STEP(mesh, target_config=target_config,
                    draft_config=draft_config, cfg=cfg)


def host(tree):
  """A numpy copy (the step donates its state)."""
  return jax.tree.map(np.array, tree)


def tree_equal(a, b) -> bool:
  return all(np.array_equal(x, y, equal_nan=True) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def max_abs_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def row_alpha(metrics) -> np.ndarray:
  return np.asarray(metrics.alpha_sum) / np.maximum(metrics.alpha_count, 1.0)


def run_steps(step, mesh, target_params, state, batches, *, nan_target_at=(),
              counter=None):
  """Feeds (prompts, lens, is_real, draft) batches placed as the driver places them.

  Returns the final state and per step the outputs and numpy state copies.
  """
  nan_params = distributed.replicate(jax.tree.map(
      lambda x: np.full(x.shape, np.nan, x.dtype), target_params), mesh)
  target_params = distributed.replicate(target_params, mesh)
  rows = lambda x: distributed.shard_leading(np.asarray(x), mesh, online.AXIS)
  records = []
  for i, (ids, lens, is_real, draft) in enumerate(batches):
    params = nan_params if i in nan_target_at else target_params
    args = (rows(ids), rows(lens), rows(is_real),
            distributed.replicate(np.int32(draft), mesh))
    if counter is not None:
      counter.active = True
    state, out = step(params, state, *args)
    jax.block_until_ready((state, out))
    if counter is not None:
      counter.active = False
      counter.calls.append((counter.traces, counter.compiles))
    records.append(dict(
        out=host(out),
        draft_params=host(state.draft_params),
        opt_state=host(state.opt_state),
        buffer=host(state.buffer),
        since_update=np.array(state.since_update),
        num_updates=np.array(state.num_updates),
        num_skipped=np.array(state.num_skipped)))
  return state, records


class Counter:
  """Traces of serve_and_learn and backend compiles during step calls.

  `calls` holds the running (traces, compiles) after each call.
  """

  def __init__(self):
    self.traces = 0
    self.compiles = 0
    self.active = False
    self.calls = []

  def wrap(self, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
      self.traces += 1
      return fn(*args, **kwargs)
    return counted

  def on_event(self, event, duration, **kwargs):
    del duration, kwargs
    if self.active and event == "/jax/core/compile/backend_compile_duration":
      self.compiles += 1


# The main stream: one config, one mesh of 1 and one of 8 devices -------------

MAIN = online.OnlineConfig(
    k=K, max_new_tokens=MAX_NEW, prompt_len=PROMPT_LEN, update_interval=BATCH,
    buffer_capacity=BATCH, teacher_k=8, loss_weighting="all",
    distill=DistillConfig(learning_rate=1e-2))
FULL_STEPS = 5  # repeated prompts, one update each
PAD_STEP = FULL_STEPS  # 5 real rows: buffered, no update yet (5 < 8)
PAD_UPDATE_STEP = FULL_STEPS + 1  # 3 real rows: the update over 8 buffered rows
NAN_STEP = FULL_STEPS + 2  # target params all NaN: the update must be skipped


def main_batches(with_nan: bool):
  ids, lens = prompts(BATCH, seed=3)  # no row meets EOS
  real = lambda n: np.arange(BATCH) < n
  batches = [(ids, lens, real(BATCH), 0)] * FULL_STEPS
  batches += [(ids, lens, real(5), 0), (ids, lens, real(3), 0)]
  if with_nan:
    batches += [(ids, lens, real(BATCH), 0)] * 2
  return batches


@pytest.fixture(scope="module")
def single():
  """One device, init_state placed as the driver places it, counting compiles."""
  target, draft = tiny_pair()
  counter = Counter()
  mesh = online.make_mesh(1)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(online, "serve_and_learn", counter.wrap(online.serve_and_learn))
    step = online.make_step(mesh, target_config=target.config,
                            draft_config=draft.config, cfg=MAIN)
  target_before = host(target.params)
  state = online.place_state(online.init_state(draft.params, MAIN, 1, seed=0),
                             mesh)
  initial = host(state.draft_params)
  jax.monitoring.register_event_duration_secs_listener(counter.on_event)
  try:
    state, records = run_steps(step, mesh, target.params, state,
                               main_batches(with_nan=True),
                               nan_target_at=(NAN_STEP,), counter=counter)
  finally:
    jax.monitoring.unregister_event_duration_listener(counter.on_event)
  ids, lens = main_batches(False)[0][:2]
  return dict(records=records, initial=initial, calls=counter.calls,
              target_before=target_before, ids=ids, lens=lens)


@pytest.fixture(scope="module")
def multi():
  """Eight devices, global batch 8 (one row per device)."""
  target, draft = tiny_pair()
  counter = Counter()
  mesh = online.make_mesh(8)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(online, "serve_and_learn", counter.wrap(online.serve_and_learn))
    step = online.make_step(mesh, target_config=target.config,
                            draft_config=draft.config, cfg=MAIN)
  state = online.place_state(online.init_state(draft.params, MAIN, 8, seed=0),
                             mesh)
  state, records = run_steps(step, mesh, target.params, state, main_batches(False))
  replicas = [[np.asarray(s.data) for s in leaf.addressable_shards]
              for leaf in jax.tree.leaves(state.draft_params)]
  return dict(records=records, traces=counter.traces, replicas=replicas)


def assert_same_outputs(a, b):
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.lengths, b.lengths)
  for name in ROW_METRICS:
    np.testing.assert_allclose(getattr(a.metrics, name), getattr(b.metrics, name),
                               rtol=1e-5, atol=1e-5, err_msg=name)
  assert bool(a.did_update) == bool(b.did_update)


def test_multi_device_equals_single_device(single, multi):
  """Same requests, mesh of 8 vs 1: same tokens and draft params after every update."""
  for i in range(PAD_UPDATE_STEP):
    one, eight = single["records"][i], multi["records"][i]
    # Precondition: no EOS, so every device holds the same loss weight.
    assert (one["out"].lengths == MAX_NEW).all()
    assert_same_outputs(one["out"], eight["out"])
    if one["out"].did_update:
      np.testing.assert_allclose(one["out"].loss, eight["out"].loss, rtol=1e-5)
    diff = max_abs_diff(one["draft_params"], eight["draft_params"])
    assert diff < 1e-5, (i, diff)
  assert int(single["records"][FULL_STEPS - 1]["num_updates"][0]) == FULL_STEPS
  # The draft did move, so the comparison above is not between two copies of the start.
  assert max_abs_diff(single["initial"],
                      single["records"][FULL_STEPS - 1]["draft_params"]) > 1e-3


def test_multi_device_equals_single_device_with_pad_rows(single, multi):
  one = single["records"][PAD_UPDATE_STEP]
  eight = multi["records"][PAD_UPDATE_STEP]
  assert bool(one["out"].did_update) and bool(eight["out"].did_update)
  assert_same_outputs(one["out"], eight["out"])
  np.testing.assert_allclose(one["out"].loss, eight["out"].loss, rtol=1e-5)
  assert max_abs_diff(one["draft_params"], eight["draft_params"]) < 1e-5


def test_per_position_metrics_equal_single_device(single, multi):
  one = single["records"][0]["out"].metrics
  eight = multi["records"][0]["out"].metrics
  for name in ("reached_by_position", "accepted_by_position"):
    np.testing.assert_array_equal(getattr(eight, name), getattr(one, name))


def test_replicas_of_the_draft_stay_identical(multi):
  for shards in multi["replicas"]:
    assert len(shards) == 8
    for shard in shards[1:]:
      np.testing.assert_array_equal(shard, shards[0])


def test_loss_falls_and_alpha_rises_on_repeated_prompts(single):
  records = single["records"][:FULL_STEPS]
  losses = [float(r["out"].loss) for r in records]
  alphas = [float(row_alpha(r["out"].metrics).mean()) for r in records]
  assert all(r["out"].did_update and r["out"].update_applied for r in records)
  assert losses[-1] < 0.7 * losses[0], losses
  # alpha of step i is measured with the draft after i updates.
  assert alphas[-1] > alphas[0] + 0.02, alphas


def test_target_params_are_never_changed(single):
  target, _ = tiny_pair()
  assert tree_equal(single["target_before"], host(target.params))


def test_pad_rows_are_neither_buffered_nor_counted(single, multi):
  rec = single["records"][PAD_STEP]
  assert not rec["out"].did_update
  assert int(rec["since_update"][0]) == 5
  valid = rec["buffer"].is_valid[0, 0]  # [device, draft, slot]
  assert valid.sum() == 5
  # The valid slots hold exactly the five real requests (prompt and gen_start).
  ids, lens = single["ids"], single["lens"]
  buffer = rec["buffer"]
  held = {(int(s), tuple(t[:s + 1])) for s, t in
          zip(buffer.gen_start[0, 0][valid], buffer.tokens[0, 0][valid])}
  assert held == {(int(n) - 1, tuple(ids[r, :n])) for r, n in enumerate(lens[:5])}
  # One row per device: devices 0..4 hold theirs, the pad rows' devices none.
  per_device = multi["records"][PAD_STEP]["buffer"].is_valid[:, 0].sum(axis=1)
  np.testing.assert_array_equal(per_device, [1, 1, 1, 1, 1, 0, 0, 0])
  # The next 3 real rows complete the interval: 5 + 3 = 8 triggers the update.
  after = single["records"][PAD_UPDATE_STEP]
  assert after["out"].did_update and int(after["since_update"][0]) == 0


def test_nan_loss_skips_the_update_and_is_counted(single):
  before = single["records"][NAN_STEP - 1]
  nan = single["records"][NAN_STEP]
  assert nan["out"].did_update and not nan["out"].update_applied
  assert int(nan["num_skipped"][0]) == 1
  assert int(nan["num_updates"][0]) == int(before["num_updates"][0]) + 1
  assert tree_equal(nan["draft_params"], before["draft_params"])
  assert tree_equal(nan["opt_state"], before["opt_state"])
  # The next, healthy update is applied and everything stays finite.
  after = single["records"][NAN_STEP + 1]
  assert after["out"].update_applied and int(after["num_skipped"][0]) == 1
  assert max_abs_diff(after["draft_params"], nan["draft_params"]) > 0
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(after["draft_params"]))


def test_no_recompilation_as_the_stream_goes_on(single, multi):
  """One trace and one compile, at the first call; none after, NaN target included."""
  calls = single["calls"]
  assert len(calls) == NAN_STEP + 2
  assert calls[0][0] == 1 and calls[0][1] >= 1  # the counters do count
  assert calls[-1] == calls[0], calls
  assert multi["traces"] == 1
