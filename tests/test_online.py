"""The serve-and-learn loop on the slot engine: devices, learning, NaN, compiles.

Compiles dominate on CPU, so most tests share two streams served through the
driver (module fixtures: one device and eight) and assert on what a Tap on
the compiled step saw: each request's tokens, the draft after every update,
traces and compiles. Helpers for the other test_online* files live here too.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.decoding import slots as slot_lib
from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import Draft, ModelDraft
from osd_jax.decoding.sampling import RowSampling, Sampling
from osd_jax.distillation.update import DistillConfig
from osd_jax.models import config as configs
from osd_jax.models import llama
from osd_jax.serving import distributed, driver, online
from tests import compiles
from tests.tiny_models import random_params, word_tokenizer

VOCAB = 32
MAX_NEW = 8
K = 2
TIMING = driver.CLOCK_FIELDS  # differ run to run


# Helpers shared by the test_online_* files ---------------------------------


@functools.lru_cache(maxsize=None)
def tiny_pair() -> tuple[LoadedModel, Draft]:
  """A 2-layer random target and a draft cut from its first layer (alpha ~0.8)."""
  # Untied head: tied random models just repeat their last token.
  config = configs.tiny(vocab_size=VOCAB, num_layers=2, tie_embeddings=False)
  target = LoadedModel(config, random_params(config, 3), word_tokenizer(VOCAB),
                       "tiny target")
  cut = draft_lib.derive(target, [0])
  return target, Draft(ModelDraft(cut.config), cut.params, cut.source)


def query(ids, category: str = "default", domain: str = "") -> driver.Query:
  """The request whose prompt tokenizes to `ids` (token i is the word "<i>")."""
  return driver.Query(" ".join(f"<{int(i)}>" for i in ids), category, domain)


def prompt_ids(q: driver.Query) -> tuple[int, ...]:
  return tuple(int(word[1:-1]) for word in q.prompt.split())


def random_prompts(lengths, seed: int) -> list[tuple[int, ...]]:
  rng = np.random.default_rng(seed)
  return [tuple(rng.integers(3, VOCAB, n).tolist()) for n in lengths]


_REFERENCE_WIDTH = 136  # every reference sequence is padded to it: one compile


@functools.partial(jax.jit, static_argnames="config")
def _logits(params, config, tokens_1xS):
  return llama.apply(params, config, tokens_1xS)[0][0]


@functools.lru_cache(maxsize=None)
def greedy(ids: tuple[int, ...], model: str = "target") -> tuple[int, ...]:
  """One request alone, decoded greedily without any cache: a full forward per
  token, the argmax appended, until EOS (included) or MAX_NEW tokens."""
  target, draft = tiny_pair()
  config, params = ((target.config, target.params) if model == "target"
                    else (draft.drafter.config, draft.params))
  tokens = np.zeros((1, _REFERENCE_WIDTH), np.int32)
  tokens[0, :len(ids)] = ids
  out = []
  while len(out) < MAX_NEW and (not out or out[-1] != config.eos_id):
    n = len(ids) + len(out)
    out.append(int(np.argmax(_logits(params, config, tokens)[n - 1])))
    tokens[0, n] = out[-1]
  return tuple(out)


def host(tree):
  """A numpy copy (the compiled programs donate their state); keys as their data."""
  def copy(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.array(x)
  return jax.tree.map(copy, tree)


def tree_equal(a, b) -> bool:
  return all(np.array_equal(x, y, equal_nan=True) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def max_abs_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


class Counter:
  """Traces of the step's programs, and programs compiled (or loaded from
  the persistent cache) while `active`."""

  def __init__(self):
    self.traces = 0
    self.compiles = 0
    self.active = False

  def wrap(self, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
      self.traces += 1
      return fn(*args, **kwargs)
    return counted

  def count(self):
    self.compiles += self.active


_SNAPSHOT = ("draft_params", "opt_state", "buffer", "since_update", "num_updates",
             "num_skipped", "replay_key", "last_acceptance")


class Tap:
  """A Step as the driver calls it, watched: each request's tokens, the state
  after each call that updated (or every call), traces and compiles per call.

  Requests are told apart as the driver admits them: in stream order
  (`servable`: the indices that fit a slot), each into the slot its insert names.
  """

  def __init__(self, step: online.Step, servable, *, counter=None,
               every_call=False):
    self.step, self.cfg, self.counter = step, step.cfg, counter
    self.every_call = every_call
    self.pending = iter(servable)
    self.owner = {}  # global slot -> request index
    self.outputs = {}  # request index -> generated tokens (EOS included)
    self.finished = []  # per serve call, the requests that finished in it
    self.snapshots = []  # per serve call (or per update): out and _SNAPSHOT
    self.programs = []  # per call: (program, traces, compiles) after it

  def _run(self, program, fn, *args, **kwargs):
    if self.counter is None:
      return fn(*args, **kwargs)
    self.counter.active = True
    try:
      result = jax.block_until_ready(fn(*args, **kwargs))
    finally:
      self.counter.active = False
    self.programs.append((program, self.counter.traces, self.counter.compiles))
    return result

  def insert(self, target_params, state, prompts, lens, budget, slot, *rest):
    local = np.asarray(slot)
    per_device = state.slots.done.shape[0] // local.shape[0]
    for device, s in enumerate(local):
      if s >= 0:
        self.owner[device * per_device + int(s)] = next(self.pending)
    return self._run(("insert", prompts.shape[1]), self.step.insert, target_params,
                     state, prompts, lens, budget, slot, *rest)

  def serve(self, target_params, state, *, steps, window, batch=None, refill=False,
            may_update=True):
    state, out = self._run(("serve", window, batch), self.step.serve, target_params,
                           state, steps=steps, window=window, batch=batch,
                           refill=refill, may_update=may_update)
    done = jax.device_get(state.slots.done)
    ended = [s for s in sorted(self.owner) if done[s]]
    self.finished.append([self.owner[s] for s in ended])
    for s, tokens in outputs_of(state, ended).items():
      self.outputs[self.owner.pop(s)] = tokens
    out = host(out)
    if self.every_call or out.did_update.any():
      snapshot = {name: host(getattr(state, name)) for name in _SNAPSHOT}
      self.snapshots.append(dict(call=len(self.finished) - 1, out=out, **snapshot))
    return state, out


def serve_stream(queries, cfg: online.OnlineConfig, *, devices: int, num_slots: int,
                 fresh: bool = False, counter: Counter | None = None,
                 every_call: bool = False, **kwargs) -> dict:
  """Serves `queries` with driver.run_stream through a Tap.

  `fresh` builds a new Step (counting its traces with `counter`) instead of
  the memoised one, so that its compiles happen here.
  """
  target, draft = tiny_pair()
  mesh = online.make_mesh(devices)
  statics = dict(target_config=target.config, drafter=draft.drafter, cfg=cfg)
  servable = [i for i, q in enumerate(queries) if cfg.fits(len(prompt_ids(q)))]
  records = []
  with pytest.MonkeyPatch.context() as mp, contextlib.ExitStack() as stack:
    if counter is not None:
      mp.setattr(online, "insert", counter.wrap(online.insert))
      mp.setattr(online, "serve", counter.wrap(online.serve))
      mp.setattr(online, "learn", counter.wrap(online.learn))
      stack.enter_context(compiles.counting(counter.count))
    step = (online.Step(mesh, **statics) if fresh
            else online.make_step(mesh, **statics))
    tap = Tap(step, servable, counter=counter, every_call=every_call)
    mp.setattr(online, "make_step", lambda *args, **kw: tap)
    state = driver.run_stream(target, draft, queries, cfg, num_slots=num_slots,
                              mesh=mesh, seed=0, chat=False,
                              on_request=records.append, **kwargs)
  return dict(records=records, tap=tap, state=state, step=step, mesh=mesh)


def placed_target(mesh):
  target, _ = tiny_pair()
  return distributed.replicate(llama.for_decoding(target.params, target.config),
                               mesh)


def fresh_state(cfg, mesh, num_slots):
  target, draft = tiny_pair()
  return online.place_state(online.init_state(
      draft.params, draft.drafter, target.config, cfg, num_devices=mesh.size,
      num_slots=num_slots, seed=0), mesh)


def admit(step, mesh, target_params, state, requests: dict):
  """Inserts {global slot: prompt ids} as the driver does: one per device per call."""
  devices = mesh.size
  per_device = state.slots.done.shape[0] // devices
  rows = lambda x: distributed.shard_leading(x, mesh, online.AXIS)
  budget = rows(np.full((devices,), step.cfg.max_new_tokens, np.int32))
  route = rows(np.zeros((devices,), np.int32))
  keys = rows(speculative.row_keys(jax.random.key(0), devices))
  sampling = rows(RowSampling.fill(step.cfg.sampling or Sampling(), devices))
  keep = rows(np.ones((devices,), bool))
  pending = dict(requests)
  while pending:
    picks = {}
    for s in sorted(pending):
      picks.setdefault(s // per_device, s)
    width = slot_lib.prompt_bucket(max(len(pending[s]) for s in picks.values()),
                                   step.cfg.cache_size)
    prompts = np.zeros((devices, width), np.int32)
    lens = np.ones((devices,), np.int32)
    slot = np.full((devices,), -1, np.int32)
    for device, s in picks.items():
      ids = pending.pop(s)
      prompts[device, :len(ids)] = ids
      lens[device], slot[device] = len(ids), s % per_device
    state = step.insert(target_params, state, rows(prompts), rows(lens), budget,
                        rows(slot), route, keys, sampling, keep)
  return state


def serve_until_done(step, target_params, state):
  """Serve calls until every slot is done; their StepOutputs, as numpy."""
  outs = []
  while True:
    done, lengths = jax.device_get((state.slots.done, state.slots.lengths))
    if done.all():
      return state, outs
    window = step.cfg.window(int(lengths[~done].max()))
    state, out = step.serve(target_params, state, steps=step.cfg.steps_per_call,
                            window=window)
    outs.append(host(out))


def outputs_of(state, slots) -> dict:
  """{slot: its generated tokens (EOS included)} for the given slots."""
  tokens, starts, lengths = jax.device_get(
      (state.slots.tokens, state.slots.prompt_lens, state.slots.lengths))
  return {s: tuple(int(t) for t in tokens[s, starts[s]:lengths[s] + 1]) for s in slots}


# The main stream: repeated prompts of both buckets, 1 device and 8 ----------

CACHE = 128  # prompt buckets 64 and 96, attention windows 64 and 128
SLOTS = 16
PROMPTS = random_prompts((3, 70, 6, 11, 95, 20, 33, 47), seed=2)
# Five rounds of the same eight prompts (learning shows on repeats), then
# short ones alone, so that the last calls need only the small window.
QUERIES = [query(p) for p in PROMPTS * 5 + [PROMPTS[0], PROMPTS[2], PROMPTS[3]] * 4]
MAIN = online.OnlineConfig(
    k=K, max_new_tokens=MAX_NEW, cache_size=CACHE, steps_per_call=2,
    update_interval=4, buffer_capacity=24, teacher_k=8, loss_weighting="all",
    distill=DistillConfig(learning_rate=1e-2), trim_verify=True)
# The main job's trimmed verification (it verifies narrower only in calls
# where every busy slot proposed less than k, or none is busy).
# 24 samples per device hold every request between two updates (< 4 + 16),
# so one device's ring never overwrites what eight devices' rings keep.


@pytest.fixture(scope="module")
def single():
  _, draft = tiny_pair()
  run = serve_stream(QUERIES, MAIN, devices=1, num_slots=SLOTS, fresh=True,
                     counter=Counter())
  return dict(run, initial=host(draft.params))


@pytest.fixture(scope="module")
def multi():
  run = serve_stream(QUERIES, MAIN, devices=8, num_slots=SLOTS, fresh=True,
                     counter=Counter())
  replicas = [[np.asarray(s.data) for s in leaf.addressable_shards]
              for leaf in jax.tree.leaves(run["state"].draft_params)]
  return dict(run, replicas=replicas)


def test_every_request_equals_its_greedy_decoding_alone(single, multi):
  """Continuous batching is invisible: mixed lengths, EOS anywhere, more
  requests than slots, and the draft changing under them."""
  lengths = [len(greedy(p)) for p in PROMPTS]
  assert len(set(lengths)) >= 3 and min(lengths) < MAX_NEW, lengths  # EOS varies
  assert {slot_lib.prompt_bucket(len(p), CACHE) for p in PROMPTS} == {64, 96}
  assert len(QUERIES) > 2 * SLOTS
  for run in (single, multi):
    outputs = run["tap"].outputs
    assert sorted(outputs) == list(range(len(QUERIES)))
    for i, q in enumerate(QUERIES):
      assert outputs[i] == greedy(prompt_ids(q)), i
    for r in run["records"]:
      assert r["new_tokens"] == len(outputs[r["request"]])
      assert r["prompt_tokens"] == len(prompt_ids(QUERIES[r["request"]]))
    assert [r["served"] for r in run["records"]] == list(range(1, len(QUERIES) + 1))


def per_request(records):
  """Records by request, without what depends on slot order or the clock."""
  drop = set(TIMING) | {"served", "loss", "update_skipped", "updates"}
  return {r["request"]: {k: v for k, v in r.items() if k not in drop}
          for r in records}


def test_multi_device_equals_single_device(single, multi):
  """Same stream, mesh of 8 vs 1 (slots laid out differently): same records per
  request, updates in the same calls, same loss and draft after every update."""
  one, eight = per_request(single["records"]), per_request(multi["records"])
  assert one.keys() == eight.keys()
  for i in one:
    assert one[i].keys() == eight[i].keys()
    for key, value in one[i].items():
      if isinstance(value, float):
        np.testing.assert_allclose(eight[i][key], value, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{key} of request {i}")
      else:
        assert eight[i][key] == value, (i, key)
  # The slot layouts differ (one device: request s in slot s; eight: request 1
  # on device 1, global slot 2), so requests end in another order within a call.
  assert single["tap"].finished != multi["tap"].finished
  updates = single["tap"].snapshots
  assert [u["call"] for u in updates] == [u["call"] for u in multi["tap"].snapshots]
  assert len(updates) >= 5
  for a, b in zip(updates, multi["tap"].snapshots):
    np.testing.assert_array_equal(a["out"].did_update, b["out"].did_update)
    np.testing.assert_allclose(a["out"].loss, b["out"].loss, rtol=1e-5)
    diff = max_abs_diff(a["draft_params"], b["draft_params"])
    assert diff < 1e-5, (a["call"], diff)
  # The draft did move, so the comparison is not between two copies of the start.
  assert max_abs_diff(single["initial"], updates[-1]["draft_params"]) > 1e-3


def test_replicas_of_the_draft_stay_identical(multi):
  for shards in multi["replicas"]:
    assert len(shards) == 8
    for shard in shards[1:]:
      np.testing.assert_array_equal(shard, shards[0])


def test_loss_falls_and_alpha_rises_on_repeated_prompts(single):
  losses = [float(u["out"].loss[0]) for u in single["tap"].snapshots]
  assert not any(u["out"].skipped.any() for u in single["tap"].snapshots)
  assert losses[-1] < 0.7 * losses[0], losses
  alpha = {r["request"]: r["alpha"] for r in single["records"]}
  n = len(PROMPTS)
  rounds = [np.mean([alpha[i] for i in range(start, start + n)])
            for start in range(0, 5 * n, n)]
  # A static draft repeats round 1's alpha exactly (greedy); the mean of the
  # last three rounds evens out the update-to-update noise of a tiny model.
  assert np.mean(rounds[2:]) > rounds[0] + 0.015, rounds
  assert int(single["state"].num_updates[0]) == len(losses)


def test_target_params_are_never_changed(single, multi):
  target, _ = tiny_pair()
  assert tree_equal(random_params(target.config, 3), host(target.params))


def test_no_recompilation_as_the_stream_goes_on(single, multi):
  """One program per prompt bucket and per (window, batch bucket), and one
  learn program, each traced and compiled on its first call; no call after
  that traces or compiles anything."""
  for run, slots_per_device in ((single, SLOTS), (multi, SLOTS // 8)):
    programs = run["tap"].programs
    names = {p for p, _, _ in programs}
    assert {p for p in names if p[0] == "insert"} == {("insert", 64), ("insert", 96)}
    serves = {p[1:] for p in names if p[0] == "serve"}
    assert {window for window, _ in serves} == {64, 128}
    # Whether the stream's last calls run over fewer slots depends on where
    # its last requests landed (the draft's updates change when each one
    # ends): the programs differ by window at least.
    batches = {batch for _, batch in serves}
    assert set(slot_lib.batch_buckets(slots_per_device)) >= batches
    assert slots_per_device in batches
    assert len(programs) >= 16  # a long stream: many calls per program
    seen, traces, compiles, learn_traced = set(), 0, 0, []
    for program, t, c in programs:
      is_new = program not in seen
      seen.add(program)
      # The first serve call that learns (a request finished in it) also
      # traces and compiles the learn program, once.
      learns = t - traces - int(is_new)
      assert learns in (0, 1) and (c > compiles) == bool(is_new or learns), (
          program, programs)
      if learns:
        learn_traced.append(program)
      traces, compiles = t, c
    assert len(learn_traced) == 1 and learn_traced[0][0] == "serve", programs


def test_compile_first_leaves_nothing_to_compile_while_serving():
  """run_stream(compile_first=True) compiles each program once, up front, as
  no-ops: the stream that follows (whose records time serving) compiles nothing."""
  static = dataclasses.replace(MAIN, learn=False)  # same shapes, quicker compile
  run = serve_stream(QUERIES[:24], static, devices=8, num_slots=SLOTS, fresh=True,
                     counter=Counter(), compile_first=True)
  programs = run["tap"].programs
  warm = len({p for p, _, _ in programs})
  # 2 prompt buckets, then 2 windows x each batch bucket of 2 slots per device.
  assert warm == 2 + 2 * len(slot_lib.batch_buckets(SLOTS // 8)) == 6
  assert len({p for p, _, _ in programs[:warm]}) == warm
  assert programs[warm - 1][2] >= warm
  assert all(p[1:] == programs[warm - 1][1:] for p in programs[warm:]), programs
  assert run["tap"].outputs == {i: greedy(prompt_ids(q))
                                for i, q in enumerate(QUERIES[:24])}


# Direct calls of the compiled step (the programs the streams compiled) ------


def test_a_smaller_k_from_a_batch_size_on_changes_speed_not_output():
  """batch_k=((1, 1),): every call drafts 1 token, not K; outputs still equal
  greedy decoding, and the second draft position is never reached. Without
  it, the same stream drafts more than one token per call."""
  queries = [query(p) for p in PROMPTS[:6]]
  static = dataclasses.replace(MAIN, learn=False)
  for batch_k in ((), ((1, 1),)):
    cfg = dataclasses.replace(static, batch_k=batch_k)
    run = serve_stream(queries, cfg, devices=1, num_slots=4)
    for i, q in enumerate(queries):
      assert run["tap"].outputs[i] == greedy(prompt_ids(q)), i
    most = max(r["proposed"] / r["target_calls"] for r in run["records"])
    reached = host(run["state"].slots.metrics.reached_by_position)
    assert reached.shape[1] == K
    if batch_k:
      assert most <= 1.0 and not reached[:, 1:].any()
    else:
      assert most > 1.0 and reached[:, 1:].any()
  with pytest.raises(ValueError, match="batch_k"):
    dataclasses.replace(static, batch_k=((8, 0),))
  assert dataclasses.replace(static, batch_k=((2, 1), (8, K + 5))).k_at(8) == K


def test_empty_slots_are_neither_buffered_nor_counted(single, multi):
  """3 requests in 16 slots: 3 samples, counted 3; the 13 empty slots add nothing."""
  ids = {s: PROMPTS[i] for s, i in ((0, 0), (3, 2), (9, 3))}
  for run in (single, multi):
    step, mesh = run["step"], run["mesh"]
    params = placed_target(mesh)
    state = admit(step, mesh, params, fresh_state(MAIN, mesh, SLOTS), ids)
    state, outs = serve_until_done(step, params, state)
    assert not any(out.did_update.any() for out in outs)  # 3 < the interval 4
    assert outputs_of(state, ids) == {s: greedy(p) for s, p in ids.items()}
    buffer = host(state.buffer)
    np.testing.assert_array_equal(state.since_update, [3])
    valid = buffer.is_valid[:, 0]  # [device, draft, sample]
    assert valid.sum() == 3 and buffer.num_added.sum() == 3
    # The samples are exactly the three requests: prompt, then output.
    held = {tuple(t[:g + 1 + MAX_NEW]) for t, g in
            zip(buffer.tokens[:, 0][valid], buffer.gen_start[:, 0][valid])}
    assert held == {(p + greedy(p) + (0,) * MAX_NEW)[:len(p) + MAX_NEW]
                    for p in ids.values()}
    if mesh.size == 8:  # two slots per device: slots 0, 3, 9 on devices 0, 1, 4
      np.testing.assert_array_equal(valid.sum(-1), [1, 1, 0, 0, 1, 0, 0, 0])
    # A call over slots that are all done again adds nothing.
    again, out = step.serve(params, state, steps=MAIN.steps_per_call, window=64)
    assert not np.asarray(out.did_update).any()
    assert tree_equal(host(again.buffer), buffer)
    np.testing.assert_array_equal(again.since_update, [3])


def test_nan_target_skips_the_update_and_is_counted(single):
  """A NaN target makes a NaN loss: the update is skipped and counted, the draft
  and optimizer state stay bitwise as they were; the next update applies."""
  step, mesh = single["step"], single["mesh"]
  params = placed_target(mesh)
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
  state = fresh_state(MAIN, mesh, SLOTS)
  before = host((state.draft_params, state.opt_state))
  four = {s: PROMPTS[i] for s, i in enumerate((0, 2, 3, 5))}  # short: window 64
  state = admit(step, mesh, nan, state, four)
  state, outs = serve_until_done(step, nan, state)
  did = [bool(out.did_update[0]) for out in outs]
  assert did[-1] and sum(did) == 1
  assert int(outs[-1].skipped[0]) == MAIN.update_steps
  assert not np.isfinite(outs[-1].loss[0])
  np.testing.assert_array_equal(state.num_updates, [1])
  np.testing.assert_array_equal(state.num_skipped, [1])
  assert tree_equal(before, host((state.draft_params, state.opt_state)))
  # Refilled and served by a healthy target: tokens right, update applied.
  state = admit(step, mesh, params, state, four)
  state, outs = serve_until_done(step, params, state)
  assert outputs_of(state, four) == {s: greedy(p) for s, p in four.items()}
  assert outs[-1].did_update[0] and int(outs[-1].skipped[0]) == 0
  np.testing.assert_array_equal(state.num_skipped, [1])
  assert max_abs_diff(before[0], host(state.draft_params)) > 0
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(host(state.draft_params)))


def garbled(state, seed=0):
  """Every slot's caches, tokens, metrics and records overwritten with finite
  garbage, as if earlier requests had left anything at all behind."""
  rng = np.random.default_rng(seed)

  def noise(x):
    x = np.asarray(x)
    if x.dtype == bool:
      return rng.random(x.shape) < 0.5
    if np.issubdtype(x.dtype, np.integer):
      return rng.integers(0, VOCAB, x.shape).astype(x.dtype)
    return (100 * rng.standard_normal(x.shape)).astype(x.dtype)

  slots = state.slots
  mess = lambda tree: jax.tree.map(noise, tree)
  slots = slots.replace(target_cache=slots.target_cache.replace(
      k=mess(slots.target_cache.k), v=mess(slots.target_cache.v)),
      draft=mess(slots.draft), tokens=mess(slots.tokens),
      metrics=mess(slots.metrics))
  return state.replace(slots=slots, records=mess(state.records))


def test_slot_refill_leaves_no_trace(single):
  """A request served in slots full of garbage gives the same tokens, metrics
  and buffered sample, bit for bit, as in empty slots."""
  step, mesh = single["step"], single["mesh"]
  params = placed_target(mesh)
  ids = {1: PROMPTS[1], 4: PROMPTS[3]}  # long and short: the big window
  seen = []
  for state in (fresh_state(MAIN, mesh, SLOTS),
                garbled(fresh_state(MAIN, mesh, SLOTS))):
    state = admit(step, mesh, params, online.place_state(state, mesh), ids)
    state, _ = serve_until_done(step, params, state)
    metrics = jax.tree.map(lambda x: x[list(ids)], host(state.slots.metrics))
    buffer = host(state.buffer)
    weighted = buffer.loss_weight > 0
    seen.append((outputs_of(state, ids), metrics, buffer.tokens, weighted,
                 buffer.teacher_ids[weighted], buffer.teacher_probs[weighted]))
  assert seen[0][0] == {s: greedy(p) for s, p in ids.items()}
  assert tree_equal(seen[0], seen[1])


def test_stale_nan_in_a_refilled_slot_is_never_read(single):
  step, mesh = single["step"], single["mesh"]
  params = placed_target(mesh)
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
  long, short = PROMPTS[1], PROMPTS[0]
  state = admit(step, mesh, nan, fresh_state(MAIN, mesh, SLOTS), {0: long})
  state, _ = serve_until_done(step, nan, state)  # NaN at positions 0..~78
  # Slot 0's short prompt rewrites positions < 64; slot 1 makes the window 128.
  state = admit(step, mesh, params, state, {0: short, 1: long})
  state, _ = serve_until_done(step, params, state)
  assert outputs_of(state, [0]) == {0: greedy(short)}


def test_keeping_served_prompts_changes_nothing_at_one_slot():
  """At one slot every buffered request came in after the previous update,
  so the prompt keys/values its prefill left are what the update would
  compute: with each sample in one update, both ways serve the same tokens
  and learn the same draft (to float rounding: prefill and the update's
  pass bucket differently)."""
  cfg = dataclasses.replace(MAIN, buffer_capacity=4, update_interval=4)
  queries = QUERIES[:20]
  runs = [serve_stream(queries, dataclasses.replace(cfg, keep_prompt_cache=keep),
                       devices=1, num_slots=1) for keep in (True, False)]
  kept, recomputed = runs
  assert kept["state"].buffer.prompt_k and not recomputed["state"].buffer.prompt_k
  assert kept["tap"].outputs == recomputed["tap"].outputs
  assert int(kept["state"].num_updates[0]) == 5
  _, draft = tiny_pair()
  assert max_abs_diff(kept["state"].draft_params, draft.params) > 1e-3
  assert max_abs_diff(kept["state"].draft_params,
                      recomputed["state"].draft_params) < 1e-4
