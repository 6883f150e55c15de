"""The live engine: one thread owns the online state and drives the slot engine.

HTTP handlers `submit` tokenized requests and read events back; only the
engine thread touches device arrays. Each turn of its loop takes new
commands, frees the slots of cancelled requests, admits queued requests into
free slots (at most one per device per insert call), runs one serve call
(decode, buffer, and the online update every I finished requests), hands
each request its new tokens and finishes those that are done. The state is
checkpointed every N updates and when the engine stops; the draft is
exported as an HF directory on request.
"""

import collections
import concurrent.futures
import dataclasses
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from osd_jax.checkpoints import loading
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.decoding import slots as slot_lib
from osd_jax.decoding.drafts import Draft, ModelDraft
from osd_jax.decoding.sampling import RowSampling
from osd_jax.distillation import objectives
from osd_jax.models import llama
from osd_jax import progress
from osd_jax.serving import distributed, online, program_maps
from osd_jax.serving.call_choice import CallChoice
from osd_jax.serving.checkpoint import Checkpointer
from osd_jax.serving.learning_budget import LearningBudget
from osd_jax.serving.live_request import (Failed, Finished, LiveRequest, RequestStats,
                                          TokenLogprob, Tokens)
from osd_jax.serving.server_metrics import ServerMetrics

_IDLE_WAIT_S = 0.5  # how long an idle engine sleeps between looks at its queue
_busy_clock = time.perf_counter  # what the learning budget reads (tests replace it)


class EngineUnavailable(RuntimeError):
  """The engine is stopping or has failed: no new work is taken."""


@dataclasses.dataclass(frozen=True)
class LiveConfig:
  """Host-side settings of the live engine."""

  num_slots: int = 8
  checkpoint_every: int = 0  # draft updates between checkpoints; 0: only at stop
  export_dir: str | None = None  # where draft exports go (None: no exports)
  rolling_window: int = 16  # requests in the rolling alpha
  seed: int = 0  # draws the seeds of requests that bring none
  # Share of the engine's busy time updates may take (learning_budget.py).
  learning_budget: float = 0.0
  # Share of the seconds the learned draft saved that updates may take
  # (learning_budget.py); 0: no such limit.
  learning_payback: float = 0.0
  # Each call speculates or runs the target alone, whichever has been faster
  # at its batch size (call_choice.py; its plain programs compile too);
  # False: every call speculates.
  choose_calls: bool = False


def _free_program(mesh: jax.sharding.Mesh):
  """done | mask, kept on the slots' sharding so the serve program never recompiles."""
  return jax.jit(lambda done, mask: done | mask,
                 out_shardings=NamedSharding(mesh, P(online.AXIS)), donate_argnums=0)


class LiveEngine:
  """The slot engine with online learning, fed from a thread-safe queue."""

  def __init__(self, target: LoadedModel, draft: Draft, cfg: online.OnlineConfig,
               live: LiveConfig, *, mesh: jax.sharding.Mesh,
               checkpointer: Checkpointer | None = None,
               memory_maps: Callable[[], tuple[int, int] | None] = program_maps.memory_maps):
    if cfg.sampling is not None:
      raise ValueError("The live engine takes each request's sampling: set"
                       " OnlineConfig.sampling to None.")
    if cfg.num_drafts != 1:
      raise ValueError("The live engine serves one draft.")
    if live.num_slots % mesh.size:
      raise ValueError(f"{live.num_slots} slots do not split over {mesh.size} devices.")
    self.target, self.draft, self.cfg, self.live = target, draft, cfg, live
    self.mesh, self.checkpointer = mesh, checkpointer
    self.metrics = ServerMetrics(cfg.k, live.num_slots, live.rolling_window)
    self._step = online.make_step(mesh, target_config=target.config,
                                  drafter=draft.drafter, cfg=cfg)
    self._free = _free_program(mesh)
    self._rows = lambda x: distributed.shard_leading(x, mesh, online.AXIS)
    self._target_params = distributed.replicate(
        llama.for_decoding(target.params, target.config), mesh)
    # Placed before a restore, so that orbax restores straight onto the mesh.
    self._state = online.place_state(online.init_state(
        draft.params, draft.drafter, target.config, cfg, num_devices=mesh.size,
        num_slots=live.num_slots, seed=live.seed), mesh)
    self._saves = 0
    self.resumed_from: int | None = None
    if checkpointer is not None:
      restored = checkpointer.restore_latest(self._state)
      if restored is not None:
        self._state, host = restored
        self._saves = self.resumed_from = int(host["saves"])
        # Requests in flight at that save died with their connections.
        self._free_slots(np.ones(live.num_slots, bool))
    self._state = online.place_state(self._state, mesh)
    self.calls = CallChoice(live.choose_calls and cfg.k > 0)  # plain or not
    # Before any program compiles: the programs it will hold must fit.
    self.plan = self._plan(memory_maps())
    # What calls may run: the plan's programs compiled so far (all of them
    # when the engine compiles on first use instead, start(warm_up=False)).
    self.compiled = self.plan
    self._commands: queue.Queue = queue.Queue()
    self._pending: collections.deque[LiveRequest] = collections.deque()
    self._owner: list[LiveRequest | None] = [None] * live.num_slots
    self._lengths = np.zeros(live.num_slots, np.int64)  # host copy of m per slot
    self._seeds = np.random.default_rng(live.seed)
    self._key_shape = jax.random.key_data(jax.random.key(0)).shape  # the PRNG's
    self._counts = self._counters()  # (updates, skipped, last loss) after the last call
    self._updates_saved = self._counts[0]
    self._learning = (LearningBudget(live.learning_budget, live.learning_payback)
                      if cfg.learn else LearningBudget(0.0))
    self._speculation_saved = 0.0  # by speculative calls, against plain ones
    self._thread: threading.Thread | None = None
    self._compiler: threading.Thread | None = None  # compiles while serving
    self._ready = threading.Event()  # warmed up: requests are taken
    self._accepting = True
    self.failure: str | None = None
    self.on_failure: Callable[[str], None] = lambda message: None
    self.on_ready: Callable[[], None] = lambda: None

  # Any thread ------------------------------------------------------------

  def problem(self, prompt_len: int, max_tokens: int) -> str | None:
    """Why a request of this size cannot be served, or None."""
    cfg = self.cfg
    if prompt_len < 1:
      return "The prompt is empty: it needs at least 1 token."
    room = cfg.cache_size - cfg.k - prompt_len  # the most new tokens a slot holds
    if room < 1:
      return (f"The prompt has {prompt_len} tokens; this server's context holds"
              f" at most {cfg.cache_size - cfg.k - 1} prompt tokens.")
    if max_tokens < 1:
      return f"max_tokens must be at least 1, got {max_tokens}."
    if max_tokens > min(room, cfg.max_new_tokens):
      return (f"max_tokens {max_tokens} is beyond the context: at most"
              f" {min(room, cfg.max_new_tokens)} for this {prompt_len}-token prompt"
              f" (the server allows {cfg.max_new_tokens}).")
    return None

  def default_max_tokens(self, prompt_len: int) -> int:
    """max_tokens of a request that names none: all the slot has room for."""
    return max(min(self.cfg.cache_size - self.cfg.k - prompt_len,
                   self.cfg.max_new_tokens), 1)

  @property
  def starting(self) -> bool:
    """Still compiling its programs (start in the background)."""
    return self._running() and not self._ready.is_set()

  @property
  def healthy(self) -> bool:
    """Running and taking requests."""
    return self._running() and self._ready.is_set()

  def _running(self) -> bool:
    return self.failure is None and self._thread is not None and self._thread.is_alive()

  def submit(self, request: LiveRequest) -> None:
    """Queues a checked request; its events come back through request.on_event."""
    if self._accepting and self.starting:
      raise EngineUnavailable("The server is starting: it takes requests once its"
                              " programs are compiled (/health answers 200).")
    if not self._accepting or not self.healthy:
      raise EngineUnavailable(self.failure or "The server is shutting down.")
    asked, most = request.params.logprobs, self.cfg.max_logprobs
    if asked is not None and (most is None or not 0 <= asked <= most):
      raise ValueError(f"This engine keeps the top {most} log-probs; a request"
                       f" asked for {asked}.")
    self._commands.put(("request", request))

  def export(self, name: str) -> concurrent.futures.Future:
    """An HF directory of the current draft under export_dir/name (a future path)."""
    future = concurrent.futures.Future()
    if not self.healthy:
      future.set_exception(EngineUnavailable(self.failure or "The engine is not running."))
    else:
      self._commands.put(("export", name, future))
    return future

  def start(self, warm_up: bool = True, background: bool = False) -> None:
    """Compiles every program a request can call (unless told not to), then
    serves. In the `background` the engine thread compiles them: `starting`
    until it is done, then `healthy`; on_ready is called then."""
    if not (warm_up and background):
      if warm_up:
        self._warm_up()
      self._ready.set()  # before the thread: a submit right after start is taken
    self._thread = threading.Thread(target=self._run, args=(warm_up and background,),
                                    name="osd-engine", daemon=True)
    self._thread.start()

  def drain(self) -> None:
    """Takes no new requests; those already queued or in slots are still served."""
    self._accepting = False

  def stop(self, timeout: float | None = None) -> None:
    """Fails what is left, checkpoints and exports, and ends the engine thread."""
    self._accepting = False
    if self._thread is not None:
      self._commands.put(("stop",))
      self._thread.join(timeout)
    if self._compiler is not None and self._compiler.is_alive():
      # It ends after the program it is compiling (a compile cannot be cut).
      print("stopping: waiting for the program being compiled", flush=True)
      self._compiler.join(timeout)

  # Engine thread ---------------------------------------------------------

  def _widths(self) -> list[int]:
    """The prompt widths a request may need: a request that asks for few
    tokens may bring a prompt of all but k + 1 of the slot's positions."""
    cfg = self.cfg
    return sorted({slot_lib.prompt_bucket(n, cfg.cache_size)
                   for n in range(1, cfg.cache_size - cfg.k)})

  def _plan(self, maps: tuple[int, int] | None) -> program_maps.Plan:
    """The serve programs this engine may call, as many as fit the host's
    vm.max_map_count (program_maps)."""
    cfg = self.cfg
    windows = {cfg.window(n) for n in range(1, cfg.cache_size + 1)}
    batches = slot_lib.batch_buckets(self.live.num_slots // self.mesh.size)
    learner = objectives.learnable(self.draft.drafter)
    draft_layers = getattr(getattr(learner, "config", None), "num_layers", 0)
    target_layers = self.target.config.num_layers
    lengths = (len([n for n in objectives._LENGTHS if n < cfg.sample_len]) + 1  # pylint: disable=protected-access
               if cfg.learn and learner is not None else 0)
    plain_maps = (lambda batch: program_maps.plain_program_maps(target_layers)
                  ) if self.calls.enabled else None
    plan = program_maps.plan(
        windows, batches, serve_maps=lambda batch: program_maps.serve_program_maps(
            batch, target_layers + draft_layers),
        inserts=len(self._widths()),
        learn_maps=program_maps.learn_program_maps(lengths), maps=maps,
        flag_hint="lower --cache_size (fewer windows and update lengths) or"
        " --slots, or pass --nolearn", plain_maps=plain_maps)
    full = len(windows) * len(batches)
    full_plain = full if plain_maps else 0
    if len(plan.programs) < full or len(plan.plain) < full_plain:
      shown = lambda programs: ", ".join(f"{w}x{b}" for w, b in programs)
      plain = (f" and {len(plan.plain)} of {full_plain} plain ones"
               f" ({shown(plan.plain) or 'none'})" if plain_maps else "")
      print(f"compiling {len(plan.programs)} of {full} serve programs (window x"
            f" batch: {shown(plan.programs)}){plain}: all would pass"
            f" vm.max_map_count = {maps[1]:,} (raise it: {program_maps.RAISE_IT})",
            flush=True)
    return plan

  def _warm_up(self) -> None:
    """Compiles the inserts, the learn program and the programs that hold
    any call (the widest window over every slot, speculative and plain):
    the engine is ready then. Where this host serves alone, the rest of the
    plan compiles on a thread of its own while the engine serves, each
    program taken up as it is ready: a start is minutes sooner on a CPU,
    where a serve program takes 30-60 s to compile and 5-10 s to load from
    the persistent cache. Hosts serving together compile them all first: a
    call's program must be the same on every host."""
    widths, plan = self._widths(), self.plan
    any_call = max(plan.programs)  # the widest window over every slot
    every = ([(shape, False) for shape in plan.programs]
             + [(shape, True) for shape in plan.plain])
    alone = jax.process_count() == 1
    first = [p for p in every if p[0] == any_call or not alone]
    # Plain programs first: under load most calls run them, and they compile
    # in a fifth of a serve program's time.
    rest = sorted((p for p in every if p not in first),
                  key=lambda p: (not p[1], -p[0][0], p[0][1]))
    bar = progress.bar(len(widths) + int(self.cfg.learn) + len(first), "compiling",
                       "programs")
    for width in widths:
      if not self._accepting:  # stopped while starting: compile no more
        return
      self._insert_nothing(width)
      bar.update(1)
    scratch = jax.tree.map(jnp.copy, self._state)  # serve donates it
    if self.cfg.learn:  # serve calls run it only when it has work
      scratch = self._step.learn_nothing(self._target_params, scratch)
      bar.update(1)
    scratch = self._compile(first, scratch, bar.update)
    bar.close()
    if scratch is None:
      return
    self._free_slots(np.zeros(self.live.num_slots, bool))
    self.compiled = plan.only(first)
    if rest:
      print(f"{len(rest)} more programs (narrower windows, fewer slots) compile"
            f" while serving", flush=True)
      self._compiler = threading.Thread(target=self._compile_rest,
                                        args=(rest, scratch), name="osd-compile")
      self._compiler.start()

  def _compile(self, programs, scratch, done: Callable[[int], object]):
    """Compiles these serve programs ((window, batch), plain), each run as a
    no-op on `scratch`, which it returns (None: the engine stopped)."""
    for (window, batch), plain in programs:
      if not self._accepting:
        return None
      scratch, _ = self._step.serve(self._target_params, scratch,
                                    steps=self.cfg.steps_per_call, window=window,
                                    batch=batch, may_update=False, plain=plain)
      jax.block_until_ready(scratch)
      done(1)
    return scratch

  def _compile_rest(self, programs, scratch) -> None:
    """The compile thread: the plan's other programs, each usable by the
    next call once compiled (`compiled` is replaced whole, never changed)."""
    start = time.monotonic()
    try:
      for program in programs:
        scratch = self._compile([program], scratch, lambda _: None)
        if scratch is None:
          return
        self.compiled = self.compiled.with_program(*program)
    except Exception as error:  # pylint: disable=broad-except
      self.failure = f"compile error: {type(error).__name__}: {error}"
      traceback.print_exc()
      self.on_failure(self.failure)
      return
    print(f"compiled the other {len(programs)} programs while serving, in"
          f" {time.monotonic() - start:.0f} s", flush=True)

  def _insert_nothing(self, width: int) -> None:
    """Compiles the insert program of one prompt width (no slot is touched)."""
    devices, rows = self.mesh.size, self._rows
    ones = np.ones(devices, np.int32)
    scratch = jax.tree.map(jnp.copy, self._state)  # insert donates it
    jax.block_until_ready(self._step.insert(
        self._target_params, scratch, rows(np.zeros((devices, width), np.int32)),
        rows(ones), rows(ones), rows(np.full(devices, -1, np.int32)),
        rows(np.zeros(devices, np.int32)),
        rows(jax.random.wrap_key_data(np.zeros((devices,) + self._key_shape,
                                               np.uint32))),
        rows(RowSampling(np.zeros(devices, np.float32), np.zeros(devices, np.int32),
                         np.ones(devices, np.float32))), rows(np.zeros(devices, bool)),
        *self._logprobs_input(np.zeros(devices, bool))))

  def _logprobs_input(self, wants: np.ndarray) -> tuple:
    """The insert program's last input, which it takes only where the slots
    keep log-probs."""
    return () if self.cfg.max_logprobs is None else (self._rows(wants),)

  def _run(self, warm_up: bool) -> None:
    try:
      if warm_up:
        self._warm_up()
      self._ready.set()
      self.on_ready()
      while True:
        if not self._take_commands(wait=not (self._pending or self._occupied())):
          break
        self._free_cancelled()
        self._admit()
        if self._occupied():
          self._serve_once()
        self._publish_gauges()
    except Exception as error:  # pylint: disable=broad-except
      self.failure = f"engine error: {type(error).__name__}: {error}"
      traceback.print_exc()
      self._fail_all(self.failure)
      self.on_failure(self.failure)
      return
    self._fail_all("The server is shutting down.")
    self._free_slots(np.ones(self.live.num_slots, bool))
    self._save()
    if self.live.export_dir and _exportable(self.draft.drafter) is not None:
      print(f"draft exported to {self._export(self._default_export_name())}")

  def _take_commands(self, wait: bool) -> bool:
    """Moves new commands off the queue; False once told to stop."""
    try:
      command = self._commands.get(timeout=_IDLE_WAIT_S) if wait else \
          self._commands.get_nowait()
    except queue.Empty:
      return True
    while True:
      kind = command[0]
      if kind == "stop":
        return False
      if kind == "request":
        self._pending.append(command[1])
      elif kind == "export":
        _, name, future = command
        try:
          future.set_result(self._export(name or self._default_export_name()))
        except Exception as error:  # pylint: disable=broad-except
          future.set_exception(error)
      try:
        command = self._commands.get_nowait()
      except queue.Empty:
        return True

  def _occupied(self) -> list[int]:
    return [s for s, r in enumerate(self._owner) if r is not None]

  def _free_slots(self, mask: np.ndarray) -> None:
    slots = self._state.slots
    self._state = self._state.replace(slots=slots.replace(
        done=self._free(slots.done, self._rows(mask))))

  def _free_cancelled(self) -> None:
    gone = [r for r in self._pending if r.cancelled]
    self._pending = collections.deque(r for r in self._pending if not r.cancelled)
    for request in gone:
      # Never admitted: nothing was computed for it.
      stats = RequestStats(0, 0, 0, 0, 0, (0,) * self.cfg.k, 0, 0.0, 0.0)
      self.metrics.observe(stats, "abort", **self._occupancy())
      request.on_event(Finished("cancelled", stats))
    cancelled = [s for s in self._occupied() if self._owner[s].cancelled]
    if not cancelled:
      return
    mask = np.zeros(self.live.num_slots, bool)
    mask[cancelled] = True
    self._free_slots(mask)
    metrics, lengths, prompt_lens = distributed.gather(
        (self._state.slots.metrics, self._state.slots.lengths,
         self._state.slots.prompt_lens))
    for s in cancelled:
      self._finish(s, "cancelled", metrics, int(lengths[s] + 1 - prompt_lens[s]))

  def _admit(self) -> None:
    """Fills free slots from the queue, at most one per device per insert call."""
    devices, cfg = self.mesh.size, self.cfg
    per_device = self.live.num_slots // devices
    while self._pending:
      picks = []  # (device, local slot, request)
      for device in range(devices):
        free = [s for s in range(per_device)
                if self._owner[device * per_device + s] is None]
        if free and self._pending:
          picks.append((device, free[0], self._pending.popleft()))
      if not picks:
        return
      width = slot_lib.prompt_bucket(max(len(r.prompt_ids) for _, _, r in picks),
                                     cfg.cache_size)
      prompts = np.full((devices, width), self.target.config.pad_id, np.int32)
      lens, budgets = np.ones(devices, np.int32), np.ones(devices, np.int32)
      slot, routes = np.full(devices, -1, np.int32), np.zeros(devices, np.int32)
      key_data = np.zeros((devices,) + self._key_shape, np.uint32)
      temperature, top_p = np.zeros(devices, np.float32), np.ones(devices, np.float32)
      top_k = np.zeros(devices, np.int32)
      wants_logprobs = np.zeros(devices, bool)
      # Whether they become samples (read only when learning): one answer
      # for the call, on every host.
      keep = np.full(devices, self._learning.worth_keeping(
          cfg.buffer_capacity * devices, distributed.all_agree))
      for device, local, request in picks:
        n, p = len(request.prompt_ids), request.params
        prompts[device, :n] = request.prompt_ids
        lens[device], budgets[device], slot[device] = n, p.max_tokens, local
        seed = p.seed if p.seed is not None else int(self._seeds.integers(1 << 32))
        key_data[device] = jax.random.key_data(jax.random.key(seed % (1 << 32)))
        temperature[device], top_k[device], top_p[device] = (p.temperature, p.top_k,
                                                             p.top_p)
        wants_logprobs[device] = p.logprobs is not None
        s = device * per_device + local
        self._owner[s], self._lengths[s] = request, n - 1
      rows = self._rows
      self._state = self._step.insert(
          self._target_params, self._state, rows(prompts), rows(lens), rows(budgets),
          rows(slot), rows(routes), rows(jax.random.wrap_key_data(key_data)),
          rows(RowSampling(temperature, top_k, top_p)), rows(keep),
          *self._logprobs_input(wants_logprobs))

  def _serve_once(self) -> None:
    """One compiled call over every slot; new tokens out, finished requests done."""
    occupied = self._occupied()
    # Of the call's StepOutput only whether it trained and whether an update
    # ended: the state holds the update counts.
    needs = (self.cfg.window(int(self._lengths[occupied].max())),
             slot_lib.occupied_batch(occupied, self.live.num_slots // self.mesh.size))
    # The choice is per load (slots in use), between the programs serving it.
    compiled = self.compiled
    plain_program = compiled.plain_program(*needs)
    plain = (plain_program is not None
             and self.calls.plain(needs[1], distributed.all_agree))
    window, batch = plain_program if plain else compiled.program(*needs)
    # Dispatch is asynchronous: unwaited, the inserts' prefills would run
    # inside this call's timing, and the call choice and the learning budget
    # would book them to whichever kind of call came next.
    jax.block_until_ready(self._state)
    start = _busy_clock()
    self._state, out = self._step.serve(
        self._target_params, self._state, steps=self.cfg.steps_per_call,
        window=window, batch=batch, refill=bool(self._pending),
        may_update=self._learning.allows(distributed.all_agree), plain=plain)
    slots = self._state.slots
    (done, lengths, prompt_lens, tokens, updates, skipped, loss,
     trained, completed) = distributed.gather(
        (slots.done, slots.lengths, slots.prompt_lens, slots.tokens,
         self._state.num_updates, self._state.num_skipped, self._state.last_loss,
         out.trained, out.did_update))
    seconds = _busy_clock() - start
    # A split update's steps cost in every call that takes some; the choice
    # of call compares serving without them.
    learning = self._learning.record((window, batch, plain), seconds,
                                     bool(trained.any()), bool(completed.any()))
    emitted = int((lengths - self._lengths)[occupied].sum())
    self._speculation_saved += self.calls.seconds_saved(needs[1], plain,
                                                        seconds - learning, emitted)
    self.calls.record(needs[1], plain, seconds - learning, emitted)
    self._lengths = lengths.astype(np.int64)
    self._counts = int(updates.sum()), int(skipped.sum()), float(loss[0])
    # Fetched only in calls where some request asked: each is [slots, S, N].
    logprobs = (distributed.gather(slots.logprobs) if any(
        self._owner[s].params.logprobs is not None for s in occupied) else None)
    finished = []
    for s in occupied:
      request, start = self._owner[s], int(prompt_lens[s])
      generated = int(lengths[s] + 1 - prompt_lens[s])
      if generated > request.sent and not request.cancelled:
        new = slice(start + request.sent, start + generated)
        request.on_event(Tokens([int(t) for t in tokens[s, new]],
                                _token_logprobs(logprobs, s, new,
                                                request.params.logprobs)))
        request.sent = generated
      if done[s]:
        finished.append((s, generated))
    if finished:
      metrics = distributed.gather(slots.metrics)
      # A gated hybrid's learned draft served some of the accepted tokens;
      # any other draft all of them.
      drafted = online.learned_draft_counts(slots)
      accepted = (metrics.accepted if drafted is None
                  else distributed.gather(drafted[1]))
      for s, generated in finished:
        last = int(tokens[s, prompt_lens[s] + generated - 1]) if generated else -1
        reason = "eos" if last == self.target.config.eos_id else "length"
        self._learning.finished(generated, int(accepted[s]))
        self._finish(s, reason, metrics, generated)
    if (self.live.checkpoint_every and self.checkpointer is not None
        and self._counts[0] - self._updates_saved >= self.live.checkpoint_every):
      self._save()

  def _finish(self, s: int, reason: str, metrics, generated: int) -> None:
    """Frees slot s on the host; its request gets its stats."""
    request = self._owner[s]
    self._owner[s] = None
    used = generated if request.tokens_used is None else min(generated,
                                                             request.tokens_used)
    k = self.cfg.k
    stats = RequestStats(
        prompt_tokens=len(request.prompt_ids), completion_tokens=used,
        num_drafts=int(metrics.reached_by_position[s, 0]) if k else 0,
        num_draft_tokens=int(metrics.proposed[s]),
        num_accepted_tokens=int(metrics.accepted[s]),
        accepted_per_pos=tuple(int(x) for x in metrics.accepted_by_position[s]),
        target_calls=int(metrics.target_calls[s]),
        alpha_sum=float(metrics.alpha_sum[s]), alpha_count=float(metrics.alpha_count[s]))
    if reason == "cancelled":
      outcome = "stop" if request.tokens_used is not None else "abort"
    else:
      outcome = "stop" if reason == "eos" else "length"
    self.metrics.observe(stats, outcome, **self._occupancy())
    request.on_event(Finished(reason, stats))

  def _fail_all(self, message: str) -> None:
    for request in list(self._pending) + [r for r in self._owner if r is not None]:
      request.on_event(Failed(message))
    self._pending.clear()
    self._owner = [None] * self.live.num_slots

  def _counters(self) -> tuple[int, int, float]:
    """(updates, skipped updates, last loss) of the draft, from the device state."""
    updates, skipped, loss = distributed.gather(
        (self._state.num_updates, self._state.num_skipped, self._state.last_loss))
    return int(updates.sum()), int(skipped.sum()), float(loss[0])

  def _occupancy(self) -> dict[str, int]:
    """The slot and queue gauges as they stand now."""
    return {"queue_depth": len(self._pending) + self._commands.qsize(),
            "slots_in_use": len(self._occupied())}

  def _publish_gauges(self) -> None:
    updates, skipped, loss = self._counts
    self.metrics.set_engine(**self._occupancy(), draft_updates=updates,
                            draft_updates_skipped=skipped, draft_last_loss=loss,
                            serve_calls=sum(self.calls.calls.values()),
                            plain_calls=self.calls.calls[True],
                            serve_seconds=self._learning.serving_seconds,
                            update_seconds=self._learning.update_seconds,
                            saved_seconds=self._speculation_saved,
                            draft_saved_seconds=self._learning.saved_seconds)

  def _save(self) -> None:
    if self.checkpointer is None:
      return
    self._saves += 1
    self._updates_saved = self._counters()[0]
    self.checkpointer.save(self._saves, self._state,
                           {"saves": self._saves, "num_updates": self._updates_saved,
                            "time": time.time()})
    self._state = online.place_state(self._state, self.mesh)

  def _default_export_name(self) -> str:
    return f"updates-{self._counters()[0]}"

  def _export(self, name: str) -> str:
    """Writes the draft as an HF directory; returns its path."""
    if not self.live.export_dir:
      raise EngineUnavailable("Start the server with --export_dir to export the draft.")
    if os.path.basename(name) != name or name in (".", ".."):
      raise ValueError(f"An export name is one folder name, got {name!r}.")
    model = _exportable(self.draft.drafter)
    if model is None:
      raise EngineUnavailable(f"A {type(self.draft.drafter).__name__} has no model"
                              " to export.")
    params = jax.tree.map(lambda x: np.asarray(x[0]),
                          distributed.gather(self._state.draft_params))
    path = os.path.join(self.live.export_dir, name)
    loading.save_hf(LoadedModel(model.config, params, self.target.tokenizer,
                                f"online draft of {self.draft.source}"), path)
    return path


def _token_logprobs(logprobs, s: int, positions: slice,
                    top_n: int | None) -> list[TokenLogprob] | None:
  """Slot s's log-probs at `positions`, with its request's top_n (None: it
  did not ask)."""
  if top_n is None:
    return None
  return [TokenLogprob(float(lp), tuple(zip(ids[:top_n].tolist(),
                                            top[:top_n].tolist())))
          for lp, ids, top in zip(logprobs.token[s, positions],
                                  logprobs.top_ids[s, positions],
                                  logprobs.top[s, positions])]


def _exportable(drafter) -> ModelDraft | None:
  """The model an HF export writes: the learned drafter (a hybrid's base) when
  it is a model draft; None for other kinds."""
  learner = objectives.learnable(drafter)
  return learner if isinstance(learner, ModelDraft) else None
