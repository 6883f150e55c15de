"""Host side of the online loop: admit requests into slots, call, collect, checkpoint.

The host never touches parameters. It keeps a queue in stream order and the
request each slot holds; between compiled calls it refills free slots
(continuous batching) and reads back the requests that finished. Every
request is served: one that cannot fit a slot gets an error record and the
stream goes on. Scheduling depends only on the stream and the device state,
so a run resumed from a checkpoint (requests in flight included) makes the
same calls as an uninterrupted one; with a learning budget, when updates
run depends on the clock too.
"""

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax import progress
from osd_jax.checkpoints import tokenizer as tokenizers
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.decoding import slots as slot_lib
from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import Draft
from osd_jax.decoding.sampling import RowSampling, Sampling
from osd_jax.models import llama
from osd_jax.serving import distributed, online, program_maps
from osd_jax.serving.checkpoint import Checkpointer
from osd_jax.serving.learning_budget import LearningBudget
from osd_jax.serving.program_maps import memory_maps

# Per-row running sums of speculative.Metrics.
ROW_METRICS = ("proposed", "accepted", "target_calls", "emitted", "alpha_sum",
               "alpha_count")
# Record fields read off the serving clock: they differ from run to run.
CLOCK_FIELDS = ("queue_s", "ttft_s", "itl_s", "finished_s", "update_s", "draft_saved_s")


@dataclasses.dataclass(frozen=True)
class Query:
  """One request of a stream; `category` routes it to a draft."""

  prompt: str
  category: str = "default"
  domain: str = ""


def encode_prompts(model: LoadedModel, prompts: Sequence[str],
                   chat: bool) -> list[list[int]]:
  """Token ids per prompt, through the chat template when asked."""
  return tokenizers.encode(model.tokenizer, prompts, chat, model.source)


def request_record(index: int, query: Query, slot_metrics: dict, new_tokens: int,
                   prompt_tokens: int) -> dict:
  """The metrics record of one served request."""
  m = slot_metrics
  return {"request": index, "category": query.category, "domain": query.domain,
          "alpha": m["alpha_sum"] / max(m["alpha_count"], 1.0),
          "acceptance_rate": m["accepted"] / max(m["proposed"], 1.0),
          "tokens_per_target_call": m["emitted"] / max(m["target_calls"], 1.0),
          "accepted": m["accepted"], "proposed": m["proposed"],
          "target_calls": m["target_calls"], "new_tokens": new_tokens,
          "prompt_tokens": prompt_tokens}


_host_seconds = time.perf_counter  # what ServingClock reads (tests replace it)


class ServingClock:
  """Seconds of serving: a host clock that stops while a checkpoint is saved.

  Saving is the online pass's fault tolerance, not serving; with the clock
  running through it, a save every 64 requests (1.1 s each for SmolLM2 at
  batch 1 on the CPU) would read as slower decoding next to passes that save
  nothing. Its cost is reported on its own (Checkpointer.seconds).
  """

  def __init__(self):
    self._now, self._stopped = _host_seconds, 0.0

  def __call__(self) -> float:
    return self._now() - self._stopped

  @contextlib.contextmanager
  def stopped(self):
    start = self._now()
    try:
      yield
    finally:
      self._stopped += self._now() - start


class _Host:
  """The scheduler's bookkeeping: what each slot holds and where the stream is."""

  def __init__(self, num_slots: int):
    self.owner = [-1] * num_slots  # request index per slot, -1 free
    self.next_request = 0
    self.served = 0
    self.calls = 0

  def to_json(self) -> dict:
    return {"owner": self.owner, "next_request": self.next_request,
            "served": self.served, "calls": self.calls}

  def load(self, saved: dict) -> None:
    self.owner, self.next_request = list(saved["owner"]), saved["next_request"]
    self.served, self.calls = saved["served"], saved["calls"]


def warm_up(step: online.Step, target_params, state: online.OnlineState,
            prompt_lens: Sequence[int], mesh: jax.sharding.Mesh) -> None:
  """Compiles every program a stream with these prompt lengths can call.

  Runs them as no-ops (no slot admitted, every slot empty) on a copy of the
  state, so timing a stream afterwards measures serving, not compiling.
  """
  cfg = step.cfg
  widths = sorted({slot_lib.prompt_bucket(n, cfg.cache_size) for n in prompt_lens
                   if cfg.fits(n)})
  if not widths:
    return
  windows = sorted({cfg.window(n) for n in range(min(prompt_lens),
                                                   cfg.cache_size + 1)})
  devices = mesh.size
  rows = lambda x: distributed.shard_leading(x, mesh, online.AXIS)
  keys = rows(speculative.row_keys(jax.random.key(0), devices))
  batches = slot_lib.batch_buckets(state.slots.done.shape[0] // devices)
  bar = progress.bar(len(widths) + len(windows) * len(batches), "compiling",
                     "programs")
  scratch = jax.tree.map(jnp.copy, state)  # the programs donate their state
  sampling = rows(RowSampling.fill(cfg.sampling or Sampling(), devices))
  for width in widths:
    scratch = step.insert(target_params, scratch,
                          rows(np.zeros((devices, width), np.int32)),
                          rows(np.ones(devices, np.int32)),
                          rows(np.ones(devices, np.int32)),
                          rows(np.full(devices, -1, np.int32)),
                          rows(np.zeros(devices, np.int32)), keys, sampling,
                          rows(np.zeros(devices, bool)))
    bar.update(1)
  for window in windows:
    for batch in batches:
      scratch, _ = step.serve(target_params, scratch, steps=cfg.steps_per_call,
                              window=window, batch=batch)
      bar.update(1)
  if cfg.learn:  # serve calls above had nothing to learn
    scratch = step.learn_nothing(target_params, scratch)
  jax.block_until_ready(scratch)
  bar.close()


def run_stream(*args, **kwargs) -> online.OnlineState:
  """Serves a whole stream (serve_stream's arguments, no pauses); the final state."""
  for state in serve_stream(*args, **kwargs):
    pass
  return state


def serve_in_turns(runs: dict[str, Iterator], interleave: bool = True,
                   on_done: Callable[[str], None] = lambda name: None) -> None:
  """Drives serve_stream generators. Interleaved, the passes go round in
  turns, each up to its next pause (so a machine whose speed drifts slows
  every pass alike); otherwise each runs to its end before the next starts.

  Passes served in turns all keep their compiled programs: a pass of SmolLM2
  at 8 slots (16-20 programs) holds 8,000 (target only) to 33,000 (learning)
  memory mappings (program_maps). So a pass joins the turns only while it
  would fit under vm.max_map_count; otherwise it waits until the running
  ones end and their programs are dropped.
  """
  pending, running, largest = list(runs), [], 0

  def advance(name: str) -> bool:
    if next(runs[name], None) is not None:
      return True
    on_done(name)
    return False

  def run_to_end(names: list[str]) -> None:
    while names:
      names = [name for name in names if advance(name)]

  while pending:
    if running:  # the running passes end, then their programs are dropped
      run_to_end(running)
      running = []
      jax.clear_caches()
    joining = True
    while pending and joining:
      name, before = pending.pop(0), memory_maps()
      if advance(name):  # its first turn compiles its programs
        running.append(name)
      after = memory_maps()
      if before and after:
        largest = max(largest, after[0] - before[0])
      joining = interleave and bool(pending) and _fits(after, largest, pending[0])
  run_to_end(running)


def _fits(maps: tuple[int, int] | None, largest: int, name: str) -> bool:
  """Whether the next pass fits beside the running ones on every host."""
  if distributed.all_agree(program_maps.fits_another(maps, largest)):
    return True
  held = (f"hold {maps[0]:,} of this process's vm.max_map_count = {maps[1]:,}"
          if maps else "would not fit another host's vm.max_map_count")
  print(f"[{name}] waits for the passes before it to end: their compiled"
        f" programs {held} memory mappings (raise it to serve every pass in"
        f" turns: {program_maps.RAISE_IT})")
  return False


def serve_stream(target: LoadedModel, draft: Draft, queries: Sequence[Query],
                 cfg: online.OnlineConfig, *, num_slots: int,
                 mesh: jax.sharding.Mesh, seed: int = 0, chat: bool = True,
                 categories: Sequence[str] = ("default",),
                 checkpointer: Checkpointer | None = None,
                 checkpoint_every: int = 0,
                 on_request: Callable[[dict], None] = lambda record: None,
                 state: online.OnlineState | None = None,
                 compile_first: bool = False,
                 pauses: Sequence[int] = (),
                 learning_budget: float = 0.0,
                 learning_payback: float = 0.0) -> Iterator[online.OnlineState]:
  """Serves `queries` in order with continuous batching, learning online.

  A generator: it pauses before each request index in `pauses` (every
  request before it finished, none after it admitted) and at the end,
  yielding the state each time (valid until it resumes, whose first call
  donates it). While it is paused its serving clock stops, so several passes
  over one stream can be served in turns, each timed alone.

  `checkpointer` saves every `checkpoint_every` served requests and at the
  end. `on_request` receives one record per request as it finishes (served) or is
  refused (`error`). `compile_first` compiles every program the stream may
  call before serving it, so its records time serving alone.
  `learning_budget` is the share of the serve calls' time updates may take,
  and `learning_payback` the share of what the learned draft saved
  (learning_budget.py; 0: no limit; a resumed run starts its counts afresh).
  """
  devices = mesh.size
  if num_slots % devices:
    raise ValueError(f"{num_slots} slots must split evenly over {devices} devices.")
  route_of = {c: i for i, c in enumerate(categories)}
  if cfg.num_drafts not in (1, len(categories)):
    raise ValueError(f"{cfg.num_drafts} drafts for {len(categories)} categories.")

  def route(index: int) -> int:
    if cfg.num_drafts == 1:
      return 0
    category = queries[index].category
    if category not in route_of:
      raise ValueError(f"Request {index} has unknown category {category!r}.")
    return route_of[category]

  step = online.make_step(mesh, target_config=target.config,
                          drafter=draft.drafter, cfg=cfg)
  # Placed before a restore, so that orbax restores straight onto the mesh.
  state = online.place_state(state or online.init_state(
      draft.params, draft.drafter, target.config, cfg, num_devices=devices,
      num_slots=num_slots, seed=seed), mesh)
  target_params = distributed.replicate(
      llama.for_decoding(target.params, target.config), mesh)
  host = _Host(num_slots)
  if checkpointer is not None:
    restored = checkpointer.restore_latest(state)
    if restored is not None:
      state, saved = restored
      host.load(saved)
      print(f"Resumed at request {host.next_request} ({host.served} served,"
            f" {sum(o >= 0 for o in host.owner)} in flight).")
  saved_at = host.served if checkpointer is not None else None
  state = online.place_state(state, mesh)
  if compile_first:
    warm_up(step, target_params, state,
            [len(ids) for ids in encode_prompts(target, [q.prompt for q in queries],
                                                chat)], mesh)
  rows = lambda x: distributed.shard_leading(x, mesh, online.AXIS)
  keys = speculative.row_keys(jax.random.key(seed), max(len(queries), 1))
  # A stream's requests all sample as cfg.sampling says (static: unused).
  sampling = jax.device_get(RowSampling.fill(cfg.sampling or Sampling(), devices))
  ids_cache: dict[int, list[int]] = {}
  # Timings (seconds of the serving clock), measured at call boundaries. A
  # replayed stream arrives all at once, as a benchmark at an unbounded
  # request rate: queue_s is the wait for a slot, ttft_s ends with the call
  # that emitted a request's first token, and itl_s is its decoding time per
  # output token from the start of that call.
  clock = ServingClock()
  start_time = clock()
  admitted: dict[int, float] = {}
  first_token: dict[int, tuple[float, float]] = {}  # (call start, call end)
  call_start = start_time
  per_device = num_slots // devices
  learning = (LearningBudget(learning_budget, learning_payback) if cfg.learn
              else LearningBudget(0.0))

  def ids_of(index: int) -> list[int]:
    if index not in ids_cache:
      ids_cache[index] = encode_prompts(target, [queries[index].prompt], chat)[0]
    return ids_cache[index]

  def next_servable(until: int):
    """The next request before `until` that fits a slot; refused ones get
    their error record."""
    while host.next_request < until:
      index = host.next_request
      host.next_request += 1
      ids = ids_of(index)
      if cfg.fits(len(ids)):
        return index
      on_request({"request": index, "category": queries[index].category,
                  "domain": queries[index].domain, "prompt_tokens": len(ids),
                  "error": (f"prompt of {len(ids)} tokens + max_new_tokens"
                            f" {cfg.max_new_tokens} + k {cfg.k} does not fit a"
                            f" {cfg.cache_size}-position slot")})
    return None

  def admit(until: int):
    """Fills free slots from requests before `until`, at most one per device
    per insert call."""
    nonlocal state
    while True:
      picks = []  # (device, local slot, request)
      for device in range(devices):
        free = [s for s in range(per_device)
                if host.owner[device * per_device + s] < 0]
        if free:
          index = next_servable(until)
          if index is None:
            break
          picks.append((device, free[0], index))
      if not picks:
        return
      width = slot_lib.prompt_bucket(max(len(ids_of(i)) for _, _, i in picks),
                                     cfg.cache_size)
      prompts = np.full((devices, width), target.config.pad_id, np.int32)
      lens = np.ones((devices,), np.int32)
      slot = np.full((devices,), -1, np.int32)
      routes = np.zeros((devices,), np.int32)
      key_rows = np.zeros((devices,), np.int32)
      for device, local, index in picks:
        ids = ids_of(index)
        prompts[device, :len(ids)] = ids
        lens[device], slot[device] = len(ids), local
        routes[device], key_rows[device] = route(index), index
        host.owner[device * per_device + local] = index
        admitted[index] = clock()
      budget = np.full((devices,), cfg.max_new_tokens, np.int32)
      # Whether they become samples (read only when learning): one answer
      # for the call, on every host.
      keep = np.full((devices,), learning.worth_keeping(
          cfg.buffer_capacity * devices, distributed.all_agree))
      state = step.insert(target_params, state, rows(prompts), rows(lens),
                          rows(budget), rows(slot), rows(routes),
                          rows(keys[key_rows]), rows(sampling), rows(keep))

  def collect() -> list[dict]:
    """Records of the requests that finished in the last call; frees their slots."""
    done, lengths, prompt_lens, keeps = distributed.gather(
        (state.slots.done, state.slots.lengths, state.slots.prompt_lens,
         state.records.keeps))
    finished = [s for s in range(num_slots) if host.owner[s] >= 0 and done[s]]
    now = clock()
    for s in range(num_slots):
      if host.owner[s] >= 0 and lengths[s] + 1 > prompt_lens[s]:
        first_token.setdefault(host.owner[s], (call_start, now))
    if not finished:
      return []
    metrics = distributed.gather(state.slots.metrics)
    drafted = online.learned_draft_counts(state.slots)
    if drafted is not None:
      drafted = distributed.gather(drafted)
    records = []
    for s in finished:
      index = host.owner[s]
      host.owner[s] = -1
      host.served += 1
      slot_metrics = {f: float(getattr(metrics, f)[s]) for f in ROW_METRICS}
      record = request_record(index, queries[index], slot_metrics,
                              int(lengths[s] + 1 - prompt_lens[s]), int(prompt_lens[s]))
      record.update(reached_by_position=metrics.reached_by_position[s].tolist(),
                    accepted_by_position=metrics.accepted_by_position[s].tolist())
      if drafted is not None:  # of which the gated hybrid's learned draft
        record.update(draft_proposed=int(drafted[0][s]),
                      draft_accepted=int(drafted[1][s]))
      decoding, first = first_token.pop(index, (call_start, now))
      record.update(served=host.served, draft=route(index), call=host.calls,
                    queue_s=admitted.pop(index, start_time) - start_time,
                    ttft_s=first - start_time,
                    itl_s=(now - decoding) / max(record["new_tokens"], 1),
                    finished_s=now - start_time,
                    learned=bool(keeps[s] and prompt_lens[s] + record["new_tokens"]
                                 <= cfg.sample_len))
      records.append(record)
    return records

  # Updates not reported yet: each goes on the last record of its call, or
  # of the next call that finishes a request (a waiting update may run
  # mid-request).
  unreported = {"updates": 0, "update_s": 0.0, "update_skipped": False}

  def report_updates(out, shape, seconds: float, records: list[dict]) -> None:
    did, trained = np.asarray(out.did_update), np.asarray(out.trained)
    # An update split over calls costs in each of them; it is reported with
    # the call that finishes it.
    unreported["update_s"] += learning.record(shape, seconds, bool(trained.any()),
                                              bool(did.any()))
    unreported["update_skipped"] |= bool(np.asarray(out.skipped)[trained].sum() > 0)
    if did.any():
      unreported["updates"] += 1
      unreported["loss"] = float(np.nanmean(np.where(did, out.loss, np.nan)))
    if records and unreported["updates"]:
      records[-1].update(unreported)
      unreported.update(updates=0, update_s=0.0, update_skipped=False)

  def save():
    nonlocal saved_at, state
    if checkpointer is not None and saved_at != host.served:
      with clock.stopped():
        checkpointer.save(host.served, state, host.to_json())
        state = online.place_state(state, mesh)
      saved_at = host.served

  last_saved = host.served
  for until in sorted({min(max(p, 0), len(queries)) for p in pauses}
                      | {len(queries)}):
    # A request admitted before a pause is served before it (after a resume,
    # the requests in flight may already belong to a later piece).
    while (host.next_request < until
           or any(0 <= o < until for o in host.owner)):
      admit(until)
      occupied = [s for s in range(num_slots) if host.owner[s] >= 0]
      if not occupied:
        break  # the rest of this piece was refused
      lengths = distributed.gather(state.slots.lengths)
      window = cfg.window(int(lengths[occupied].max()))
      batch = slot_lib.occupied_batch(occupied, per_device)
      # The inserts' prefills are waited for, not timed as part of this call
      # (the learning budget's cost of an update, a request's decoding time).
      jax.block_until_ready(state)
      call_start = clock()
      state, out = step.serve(target_params, state, steps=cfg.steps_per_call,
                              window=window, batch=batch,
                              refill=host.next_request < until,
                              may_update=learning.allows(distributed.all_agree))
      out = distributed.gather(out)
      seconds = clock() - call_start
      records = collect()
      # Calls that finish a request end early (with refill): a shape of their own.
      report_updates(out, (window, batch, bool(records)), seconds, records)
      for record in records:
        # A gated hybrid's learned draft served some of the accepted tokens;
        # any other learning draft all of them.
        if cfg.learn:
          record["draft_saved_s"] = learning.finished(
              record["new_tokens"], record.get("draft_accepted", int(record["accepted"])))
        on_request(record)
      host.calls += 1
      if checkpoint_every and host.served - last_saved >= checkpoint_every:
        save()
        last_saved = host.served
    # Saved at the end, not at every pause: the main job's turns of 8
    # requests would save 30 times a stream (34 s at batch 1), and a resume
    # is exact from any save, mid-piece included.
    if until == len(queries):
      save()
    with clock.stopped():
      yield state
