"""The serve-and-learn step on the slot engine, replicated over a device mesh.

Compiled programs, each a shard_map over a 1-D mesh: `insert` prefills at
most one new request per device into a free slot; `serve` runs a bounded
number of speculative steps over every slot (one program per window and
batch); `learn` puts the requests that finished into the buffer of their
draft and, every I finished requests, takes that draft's update. A serve
call runs `serve`, then `learn` where it has work: a request finished, or
an update is due or under way. The update lives in one program, not in
each serve program: it is most of a serve program's kernels (every sample
length compiles a branch), so a copy in each of 20-40 serve programs
multiplied compile time, load time from the persistent cache and memory
mappings (program_maps.py).
Slots and buffers are split over devices; drafts and optimizer states are
replicated, and the update sums losses, weights and gradients over devices
before dividing, so every replica stays equal to what one device would
compute.
"""

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from osd_jax.decoding import slots as slot_lib
from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import MultiDraft
from osd_jax.decoding.drafts.gate import Gate
from osd_jax.decoding.sampling import RowSampling, Sampling
from osd_jax.decoding.speculative import SpecState
from osd_jax.distillation import samples, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.serving import distributed, learning
from osd_jax.serving.learning import StepOutput
from osd_jax.serving.records import WEIGHTINGS, Records
from osd_jax.when import when

AXIS = "data"


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
  """Static settings of the loop (hashable: a jit static argument)."""

  k: int = 4
  sampling: Sampling | None = Sampling()  # None: each request brings its own
  max_new_tokens: int = 64  # the most any request may ask for
  cache_size: int = 512  # positions per slot: prompt + new tokens + k must fit
  train_len: int = 0  # positions of a buffer sample (0: cache_size)
  steps_per_call: int = 8  # speculative steps between host refills
  learn: bool = True  # False: the draft stays as it is, nothing is buffered
  update_interval: int = 8  # I: finished requests between updates, per draft
  update_steps: int = 1  # optimizer steps per update
  # At most this many of an update's steps per serve call, the rest in the
  # next calls: every stream waits for a few steps at a time, not a whole
  # update, which ends some calls later. 0: a whole update in one call.
  # Only with minibatch replay from a ring: each step draws anew from it.
  update_steps_per_call: int = 0
  # Samples per optimizer step, drawn from the ring anew each step (replay.py);
  # 0: every step over the whole buffer (as published).
  minibatch: int = 0
  # A reaction to a shift: where the loss before an update exceeds
  # shift_ratio x its running mean over past updates, shift_steps more steps.
  shift_steps: int = 0
  shift_ratio: float = 1.5
  buffer_capacity: int = 8  # samples per device and draft
  clear_after_update: bool = True  # as published; False keeps a ring
  teacher_k: int = 32  # 0: recompute the teacher with a target forward
  # Which generated positions carry the loss (records.WEIGHTINGS): corrected
  # or bonus tokens (as published), all, or those emitted where the hybrid's
  # lookup proposed nothing, the ones its learned draft is called on.
  loss_weighting: str = "corrected"
  sample_source: str = "served"
  source_mix: float = 0.5  # target share for the mixed sources
  num_drafts: int = 1
  # ((b, k_b), ...): a call over b or more slots per device drafts at most
  # k_b tokens per step. Verifying k + 1 tokens in every row gets
  # compute-bound as the batch grows (on CPU already at 4-8 rows). vLLM's
  # speculative_disable_by_batch_size is the k_b = 0 case, not offered here:
  # a draft that skips a step falls out of step with its cache.
  batch_k: tuple[tuple[int, int], ...] = ()
  trim_verify: bool = False  # see slots.SlotConfig
  # ((b, cost), ...): in a call over b slots per device a verified position
  # costs `cost` of a plain step (measured: serving/verify_costs.py), and
  # each row verifies only the drafted positions that pay for it
  # (decoding/verify_policy.py); () verifies every drafted position.
  position_costs: tuple[tuple[int, float], ...] = ()
  # Buffer a model draft's prompt keys and values as serving's prefill wrote
  # them, so an update need not run the draft over every prompt again
  # (Buffer.prompt_k; per sample 2 x layers x kv_heads x head_dim x
  # sample_len values of the draft's cache dtype).
  keep_prompt_cache: bool = True
  # After each update, a gated hybrid's gate takes the new draft's acceptance
  # on what the update trained on (drafts/gate.py, Gate.reestimated).
  reestimate_gate: bool = True
  # N: the slots keep each emitted token's target log-prob and its top N, for
  # the requests that ask (decoding/logprobs.py); None: they keep none, and
  # every program is as without the feature.
  max_logprobs: int | None = None
  distill: update.DistillConfig = update.DistillConfig()

  def __post_init__(self):
    if self.k < 0:
      raise ValueError(f"k must be >= 0, got {self.k}.")
    if self.loss_weighting not in WEIGHTINGS:
      raise ValueError(f"loss_weighting must be one of {WEIGHTINGS}, got"
                       f" {self.loss_weighting!r}.")
    if self.shift_steps < 0 or self.shift_ratio <= 1.0:
      raise ValueError(f"shift_steps must be >= 0 and shift_ratio > 1, got"
                       f" {self.shift_steps} and {self.shift_ratio}.")
    if self.minibatch < 0:
      raise ValueError(f"minibatch must be >= 0 (0: the whole buffer), got"
                       f" {self.minibatch}.")
    if self.update_steps_per_call < 0:
      raise ValueError(f"update_steps_per_call must be >= 0 (0: a whole update in"
                       f" one call), got {self.update_steps_per_call}.")
    if self.update_steps_per_call and (not self.minibatch or self.clear_after_update):
      raise ValueError("update_steps_per_call splits an update over serve calls"
                       " only with minibatch replay from a ring (minibatch > 0,"
                       " clear_after_update False): each step must draw anew from"
                       " what the ring holds by then.")
    if self.sample_source not in samples.SOURCES:
      raise ValueError(f"sample_source must be one of {samples.SOURCES}.")
    if min(self.update_interval, self.buffer_capacity, self.update_steps,
           self.steps_per_call, self.max_new_tokens, self.num_drafts) < 1:
      raise ValueError("update_interval, update_steps, buffer_capacity,"
                       " steps_per_call, max_new_tokens and num_drafts must be >= 1.")
    if any(min(b, k_b) < 1 for b, k_b in self.batch_k):
      raise ValueError(f"batch_k needs batches and draft lengths >= 1, got"
                       f" {self.batch_k}.")
    if self.position_costs and not self.trim_verify:
      raise ValueError("position_costs cut proposals only where verification is"
                       " trimmed (trim_verify).")
    if any(b < 1 or not 0.0 <= c < float("inf") for b, c in self.position_costs):
      raise ValueError(f"position_costs needs batches >= 1 and finite costs >= 0,"
                       f" got {self.position_costs}.")
    if self.train_len > self.cache_size:
      raise ValueError(f"train_len {self.train_len} is longer than a slot"
                       f" (cache_size {self.cache_size}).")
    if self.max_logprobs is not None and self.max_logprobs < 0:
      raise ValueError(f"max_logprobs must be >= 0 or None, got {self.max_logprobs}.")
    if self.max_new_tokens + self.k + 1 > self.cache_size:
      raise ValueError(f"cache_size {self.cache_size} cannot hold max_new_tokens"
                       f" {self.max_new_tokens} + k {self.k} after a prompt.")

  def k_at(self, batch: int) -> int:
    """Draft tokens per step in a call over `batch` slots per device."""
    k = self.k
    for b, k_b in sorted(self.batch_k):
      if batch >= b:
        k = min(k_b, self.k)
    return k

  def position_cost_at(self, batch: int) -> float:
    """A verified position's cost in a call over `batch` slots per device,
    from the nearest measured batch at or below it (0: no costs given)."""
    below = [c for b, c in sorted(self.position_costs) if b <= batch]
    return below[-1] if below else 0.0

  @property
  def sample_len(self) -> int:
    return self.train_len or self.cache_size

  def fits(self, prompt_len: int) -> bool:
    """Whether a prompt can be served with max_new_tokens in one slot."""
    return 1 <= prompt_len and prompt_len + self.max_new_tokens + self.k <= self.cache_size

  def window(self, longest: int) -> int:
    """Attention window of one call when the longest slot holds `longest` tokens."""
    return slot_lib.bucket(longest + self.steps_per_call * (self.k + 1),
                           self.cache_size)

  def slots(self, target_config: LlamaConfig, drafter, num_slots: int):
    return slot_lib.SlotConfig(target_config, drafter, self.k, self.sampling,
                               num_slots, self.cache_size, self.trim_verify)


@flax.struct.dataclass
class OnlineState:
  """Everything that changes as the stream goes on; leading axis = draft."""

  # [num_drafts, ...] replicated over devices; a model draft's layers one
  # dict each (per_layer)
  draft_params: dict
  opt_state: optax.OptState  # [num_drafts, ...] replicated
  buffer: Buffer  # [devices, num_drafts, ...]: one buffer per device and draft
  slots: SpecState  # [slots, ...] split over devices
  records: Records  # [slots, ...] split over devices
  rng: jax.Array  # [devices] keys (for draft-sourced samples)
  replay_key: jax.Array  # [num_drafts] keys of the minibatch draws, replicated
  since_update: jax.Array  # [num_drafts] finished requests since the last update
  num_updates: jax.Array  # [num_drafts]
  num_skipped: jax.Array  # [num_drafts] optimizer steps skipped (non-finite)
  last_loss: jax.Array  # [num_drafts] loss at the latest update (NaN: none yet)
  loss_mean: jax.Array  # [num_drafts] running mean of losses before updates
  # The latest update's draft's acceptance on what it trained on (NaN: none).
  last_acceptance: jax.Array  # [num_drafts] float32
  # An update split over calls (update_steps_per_call): the steps it has
  # taken (0: none in progress) and its first step's loss (NaN: none), which
  # decides the shift's extra steps. Its draws' key is replay_key's next,
  # which advances as it ends.
  update_steps_done: jax.Array  # [num_drafts] int32
  update_first_loss: jax.Array  # [num_drafts] float32


def multi(drafter, cfg: OnlineConfig) -> MultiDraft:
  """The loop's drafter: `num_drafts` copies of `drafter`, routed per slot."""
  return MultiDraft(drafter, cfg.num_drafts)


def per_layer(draft_params):
  """A model draft's weights with each layer in arrays of its own, the layout
  decoding reads (llama.for_decoding); other drafts' as they are.

  Kept stacked ([layers, ...]), every serve and insert call would slice
  them into fresh copies before its first step: 6 of a 160 ms call at one
  slot on a 2-core CPU, 4 % of the gated hybrid's serving time, spent even
  where its learned draft proposes nothing. Training reads either layout.
  """
  if isinstance(draft_params, dict) and "layers" in draft_params:
    return llama.unstack_layers(draft_params)  # a no-op on a list
  return draft_params


def init_state(draft_params, drafter, target_config: LlamaConfig, cfg: OnlineConfig,
               *, num_devices: int, num_slots: int, seed: int) -> OnlineState:
  """N copies of the starting draft, fresh optimizer states, empty slots and buffers."""
  if num_slots % num_devices:
    raise ValueError(f"{num_slots} slots do not split over {num_devices} devices.")
  stack = lambda x: jnp.broadcast_to(x, (cfg.num_drafts,) + x.shape).copy()
  params = jax.tree.map(stack, per_layer(draft_params))
  # A draft without parameters (n-gram, none) has no optimizer state.
  opt_state = jax.vmap(lambda p: update.init_opt_state(p, cfg.distill))(params) if jax.tree.leaves(params) else ()
  hidden_dim = target_config.hidden_dim if drafter.needs_hidden else 0
  slots = speculative.empty_state(target_config, multi(drafter, cfg),
                                  batch_size=num_slots, cache_size=cfg.cache_size,
                                  k=cfg.k, max_logprobs=cfg.max_logprobs)
  prompt_cache = learning.kept_prompts(cfg, drafter, slots.draft[0])
  one = Buffer.empty(cfg.buffer_capacity, cfg.sample_len, cfg.max_new_tokens,
                     cfg.teacher_k, hidden_dim, prompt_cache)
  buffer = jax.tree.map(
      lambda x: jnp.broadcast_to(x, (num_devices, cfg.num_drafts) + x.shape).copy(),
      one)
  records = Records.empty(num_slots, cfg.cache_size, cfg.teacher_k, hidden_dim)
  if (cfg.learn and cfg.loss_weighting == "lookup_missed"
      and not learning.reports_misses(drafter)):
    raise ValueError("loss_weighting lookup_missed needs a gated hybrid draft"
                     " (its lookup says where it missed).")
  counters = lambda dtype: jnp.zeros((cfg.num_drafts,), dtype)  # distinct buffers
  nan = jnp.full((cfg.num_drafts,), jnp.nan, jnp.float32)
  serve_key, replay_key = jax.random.split(jax.random.key(seed))
  return OnlineState(params, opt_state, buffer, slots, records,
                     jax.random.split(serve_key, num_devices),
                     jax.random.split(replay_key, cfg.num_drafts),
                     counters(jnp.int32), counters(jnp.int32), counters(jnp.int32),
                     nan, nan, nan, counters(jnp.int32), nan.copy())


def insert(target_params, state: OnlineState, prompt_1xP, prompt_len_1, budget_1,
           slot_1, route_1, key_1, sampling_1: RowSampling, keep_1,
           wants_logprobs_1=None, *, target_config, drafter, cfg: OnlineConfig):
  """One device: a new request into local slot `slot` (none when slot < 0).

  `sampling_1` is the request's own sampling, used when cfg.sampling is None;
  `keep_1` whether, when learning, the request becomes a buffer sample
  (records.py); `wants_logprobs_1` whether it asks for log-probs (an input
  only when cfg.max_logprobs is set).
  """
  drafter = multi(drafter, cfg)
  slot_cfg = cfg.slots(target_config, drafter, state.slots.done.shape[0])
  target_params = llama.for_decoding(target_params, target_config)
  draft_params = drafter.prepare(state.draft_params, target_params)
  slot = jnp.maximum(slot_1[0], 0)

  def admit(state):
    slots, hidden = slot_lib.insert_into(
        target_params, draft_params, state.slots, prompt_1xP, prompt_len_1[0],
        budget_1[0], slot, key_1[0], route_1[0], sampling_1,
        False if wants_logprobs_1 is None else wants_logprobs_1[0], cfg=slot_cfg)
    records = state.records
    if cfg.learn:
      records = records.with_prompt(slot, hidden, key_1[0], keep_1[0])
    return state.replace(slots=slots, records=records)

  return when(slot_1[0] >= 0, admit, state)


def serve(target_params, state: OnlineState, refill=False, may_update=True, *,
          target_config, drafter, cfg: OnlineConfig, steps: int, window: int,
          batch: int | None = None, axis_name: str | None = None,
          plain: bool = False):
  """One device's call: decode its slots (shard_map body); the state, which
  slots finished in it, and whether `learn` has anything to do after it
  (learning.has_work, the same on every device).

  Only the first `batch` local slots (all if None) are decoded: the host
  keeps every request there; each step drafts cfg.k_at(batch) tokens. With
  `refill` (requests are waiting) decoding stops at the first step in which
  a slot finishes, on every device (slots.decode_loop). A `plain` call
  takes plain target steps (k = 0: no draft runs).
  """
  drafter = multi(drafter, cfg)
  target_params = llama.for_decoding(target_params, target_config)
  draft_params = drafter.prepare(state.draft_params, target_params)
  was_done = state.slots.done
  corrected_only = cfg.loss_weighting == "corrected"

  num_slots = state.slots.done.shape[0]
  batch = batch or num_slots

  k = 0 if plain else cfg.k_at(batch)

  def step(slots, records):
    slots, result = speculative.speculate_and_verify(
        target_params, draft_params, slots, target_config=target_config,
        drafter=drafter, k=k, sampling=cfg.sampling, window=window,
        trim_verify=cfg.trim_verify, position_cost=cfg.position_cost_at(batch))
    if cfg.learn:
      missed = None
      if cfg.loss_weighting == "lookup_missed":
        # A plain step looked nothing up: its positions carry no loss.
        missed = (jnp.zeros_like(slots.done) if plain else
                  drafter.base.lookup_missed(slots.draft[0]))  # copies look up alike
      records = records.record(result, corrected_only=corrected_only,
                               lookup_missed=missed)
    return slots, records

  decode = lambda slots, records: slot_lib.decode_loop(step, slots, records, steps,
                                                       refill, axis_name, window)
  if cfg.learn:
    slots, records = slot_lib.on_first_slots(
        lambda t: decode(*t), (state.slots, state.records), batch, num_slots)
  else:  # nothing is recorded: the records are not even sliced
    slots, records = slot_lib.on_first_slots(
        lambda s: decode(s, state.records)[0], state.slots, batch,
        num_slots), state.records
  finished = slots.done & ~was_done
  state = state.replace(slots=slots, records=records)
  learns = jnp.bool_(False)
  if cfg.learn:
    learns = learning.has_work(state, finished, may_update, cfg=cfg,
                               axis_name=axis_name)
  return state, finished, learns


def learn(target_params, state: OnlineState, finished, may_update, *,
          target_config, drafter, cfg: OnlineConfig, axis_name: str | None = None):
  """One device's learning after a serve call (shard_map body): buffer the
  `finished` requests, update the drafts whose turn it is (learning.learn);
  without `may_update` a due update waits for a later call."""
  drafter = multi(drafter, cfg)
  target_params = llama.for_decoding(target_params, target_config)
  rng, learn_rng = jax.random.split(state.rng[0])
  state = state.replace(rng=rng[None])
  return learning.learn(target_params, state, finished, learn_rng, may_update,
                        target_config=target_config, drafter=drafter, cfg=cfg,
                        axis_name=axis_name)


def did_nothing(num_drafts: int) -> StepOutput:
  """The StepOutput of a call that did not learn."""
  nan = np.full((num_drafts,), np.nan, np.float32)
  return StepOutput(np.zeros((num_drafts,), bool), nan,
                    np.zeros((num_drafts,), np.int32), nan,
                    np.zeros((num_drafts,), bool))


_STATE_SPECS = OnlineState(P(), P(), P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(), P(),
                           P(), P(), P(), P(), P(), P(), P())


class Step:
  """The compiled programs for one (mesh, models, settings); memoised."""

  def __init__(self, mesh, *, target_config, drafter, cfg: OnlineConfig):
    self.mesh, self.cfg = mesh, cfg
    self.statics = dict(target_config=target_config, drafter=drafter, cfg=cfg)
    row = P(AXIS)
    # Whether each request asks for log-probs is an input only where the
    # slots keep them: elsewhere the program is as it was.
    rows = 8 if cfg.max_logprobs is None else 9
    self.insert = jax.jit(jax.shard_map(
        functools.partial(insert, **self.statics), mesh=mesh,
        in_specs=(P(), _STATE_SPECS) + (row,) * rows,
        out_specs=_STATE_SPECS, check_vma=False), donate_argnums=(1,))
    self._serve = {}
    self.learn = jax.jit(jax.shard_map(
        functools.partial(learn, **self.statics, axis_name=AXIS), mesh=mesh,
        in_specs=(P(), _STATE_SPECS, row, P()),
        out_specs=(_STATE_SPECS, StepOutput(P(), P(), P(), P(), P())),
        check_vma=False), donate_argnums=(1,))
    self._nothing = distributed.replicate(did_nothing(cfg.num_drafts), mesh)
    # The flags as the programs take them, placed once, not every call.
    self._flag = {flag: distributed.replicate(np.bool_(flag), mesh)
                  for flag in (False, True)}

  def serve(self, target_params, state: OnlineState, *, steps: int, window: int,
            batch: int | None = None, refill: bool = False,
            may_update: bool = True, plain: bool = False):
    """Up to `steps` speculative steps over the first `batch` slots of each
    device (all if None; fewer steps with `refill`; `plain`: target steps;
    see `serve`), then, when learning, `learn` (a due update waits without
    `may_update`); one serve program per (window, batch, plain)."""
    key = steps, window, batch, plain
    if key not in self._serve:
      body = functools.partial(serve, **self.statics, steps=steps, window=window,
                               batch=batch, axis_name=AXIS, plain=plain)
      self._serve[key] = jax.jit(jax.shard_map(
          body, mesh=self.mesh, in_specs=(P(), _STATE_SPECS, P(), P()),
          out_specs=(_STATE_SPECS, P(AXIS), P()), check_vma=False),
          donate_argnums=(1,))
    may_update = self._flag[bool(may_update)]
    state, finished, learns = self._serve[key](target_params, state,
                                               self._flag[bool(refill)], may_update)
    # Only a step that learns reads the flag: the host waits for the serve
    # call here, as its caller would next. Most calls finish no request and
    # step no update, and the learn program would still rewrite the buffer's
    # fields (milliseconds a call).
    if not (self.cfg.learn and bool(learns)):
      return state, self._nothing
    return self.learn(target_params, state, finished, may_update)

  def learn_nothing(self, target_params, state: OnlineState) -> OnlineState:
    """Runs the learn program with nothing finished and no update allowed,
    so that it compiles before serving (serve calls run it only when it has
    work); returns the state, as it was but for the rng."""
    nothing = distributed.shard_leading(np.zeros(state.slots.done.shape, bool),
                                        self.mesh, AXIS)
    return self.learn(target_params, state, nothing, self._flag[False])[0]


@functools.lru_cache(maxsize=16)
def make_step(mesh: jax.sharding.Mesh, *, target_config: LlamaConfig, drafter,
              cfg: OnlineConfig) -> Step:
  """The compiled insert and serve programs, shared by every stream with these settings."""
  return Step(mesh, target_config=target_config, drafter=drafter, cfg=cfg)


def learned_draft_counts(slots: SpecState):
  """(tokens a gated hybrid's learned draft proposed in each slot's request,
  how many of them were accepted), [slots] each; None for other drafts."""
  gates = [leaf for leaf in jax.tree.leaves(
      slots.draft, is_leaf=lambda x: isinstance(x, Gate)) if isinstance(leaf, Gate)]
  if not gates:
    return None
  # A per-category copy proposes only for its own rows: the sum is the row's.
  return sum(g.drafted for g in gates), sum(g.drafted_accepted for g in gates)


def make_mesh(num_devices: int | None = None) -> jax.sharding.Mesh:
  """A 1-D mesh over the first num_devices devices (all, every host, if None)."""
  if num_devices is not None and not 1 <= num_devices <= jax.device_count():
    raise ValueError(f"Asked for {num_devices} devices; this job has"
                     f" {jax.device_count()}.")
  devices = jax.devices()[:num_devices] if num_devices else jax.devices()
  return jax.sharding.Mesh(devices, (AXIS,))


def place_state(state: OnlineState, mesh: jax.sharding.Mesh) -> OnlineState:
  """Drafts and counters replicated; slots, records, buffers and rng split.

  Zero-size leaves (no hidden states kept) are replicated: that is how the
  compiled programs return them, and a state placed otherwise would compile
  every program a second time, once for each placement.
  """
  rep = lambda t: distributed.replicate(t, mesh)
  split = lambda t: jax.tree.map(
      lambda x: distributed.shard_leading(x, mesh, AXIS) if x.size else rep(x), t)
  return OnlineState(rep(state.draft_params), rep(state.opt_state),
                     split(state.buffer), split(state.slots), split(state.records),
                     split(state.rng), rep(state.replay_key),
                     rep(state.since_update), rep(state.num_updates),
                     rep(state.num_skipped), rep(state.last_loss),
                     rep(state.loss_mean), rep(state.last_acceptance),
                     rep(state.update_steps_done), rep(state.update_first_loss))
