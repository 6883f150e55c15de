"""The slot engine's compiled verbs: insert a request into a slot, generate, free.

JetStream's shape, over a donated `SpecState` of fixed shape: every slot
row is an independent request. `insert` prefills one prompt (padded to a
bucket) straight into a slot; `generate` runs a bounded number of
speculative steps over all slots (or the first `batch`, which hold every
request), and ends in the step a slot finishes when requests are waiting;
the host refills finished slots between calls, so no row waits for the
slowest one.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from osd_jax.decoding import speculative
from osd_jax.decoding.sampling import RowSampling, Sampling
from osd_jax.decoding.speculative import SpecState
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache

# Attention windows (and the engine's cache) are rounded up to one of these,
# capped at the cache size: one compiled program per bucket in use.
BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


# Prompt widths also take the midpoints (96, 192, 384, ...). Prefill is
# compute-bound on a CPU (SmolLM2 on 2 cores: about 1.4 ms a padded token),
# so padding costs what it holds: the main job's 240 prompts (26,232 tokens)
# padded to 39,488 at powers of two and to 32,320 with the midpoints, for 2
# more programs. Windows keep powers of two: a serving program compiles for
# minutes (one per window), an insert for seconds.
PROMPT_BUCKETS = tuple(sorted(set(BUCKETS) | {b * 3 // 2 for b in BUCKETS[:-1]}))


def bucket(size: int, cap: int, buckets: tuple[int, ...] = BUCKETS) -> int:
  """The smallest bucket >= size, or `cap` (the cache size) beyond them."""
  for b in buckets:
    if b >= size:
      return min(b, cap)
  return cap


def prompt_bucket(size: int, cap: int) -> int:
  """The width a prompt of `size` tokens is padded to for its prefill."""
  return bucket(size, cap, PROMPT_BUCKETS)


def batch_bucket(used: int, num_slots: int) -> int:
  """Slots a call computes when slots 0..used-1 hold every request: the next
  power of two, capped at num_slots. One program per bucket in use."""
  batch = 1
  while batch < used:
    batch *= 2
  return min(batch, num_slots)


def batch_buckets(num_slots: int) -> list[int]:
  """Every batch_bucket value: the programs a host may call."""
  return sorted({batch_bucket(n, num_slots) for n in range(1, num_slots + 1)})


def occupied_batch(occupied: list[int], slots_per_device: int) -> int:
  """The batch bucket of a call when global slots `occupied` hold requests
  (devices hold consecutive runs of slots_per_device)."""
  return batch_bucket(max(s % slots_per_device for s in occupied) + 1,
                      slots_per_device)


def _is_cache(x) -> bool:
  return isinstance(x, KVCache)


def first_slots(tree, n: int):
  """The first n slots of a per-slot pytree (a SpecState, Records, a drafter's
  state): arrays lead with the slot axis, and caches keep kv_heads rows per slot."""
  return jax.tree.map(lambda x: x.first_rows(n) if _is_cache(x) else x[:n], tree,
                      is_leaf=_is_cache)


def with_first_slots(tree, part):
  """`tree` with its first slots replaced by `part` (first_slots' inverse)."""
  return jax.tree.map(
      lambda x, p: x.with_first_rows(p) if _is_cache(x) else x.at[:p.shape[0]].set(p),
      tree, part, is_leaf=_is_cache)


def on_window(fn, tree, window: int):
  """fn(tree) computed with every cache cut to its first `window` positions,
  then written back.

  A step's attention reads only the window, but cutting it out of a larger
  cache copies it, in every layer of every step (XLA's CPU backend). Cut
  once per call, the steps run on caches whose size is the window: SmolLM2's
  1-token step over 256 of 512 positions took 85.8 ms cut each step, 49.3 ms
  cut once a call, 42.7 ms with no cut at batch 8 (34.0 / 27.8 / 27.4 at
  batch 1; experiments.bench_decode).
  """
  leaves = jax.tree.leaves(tree, is_leaf=_is_cache)
  if all(x.size <= window for x in leaves if _is_cache(x)):
    return fn(tree)
  cut = jax.tree.map(lambda x: x.first_positions(window) if _is_cache(x) else x,
                     tree, is_leaf=_is_cache)
  return jax.tree.map(lambda x, p: x.with_first_positions(p) if _is_cache(x) else p,
                      tree, fn(cut), is_leaf=_is_cache)


def on_first_slots(fn, trees, n: int, num_slots: int):
  """fn(trees) computed on the first n of num_slots slots; the others, which
  hold no request, are left as they are. Vectorised work scales with the
  rows computed, so a call with one request in eight slots costs about a
  batch-1 call, plus one copy of that slot's caches in and out."""
  if n >= num_slots:
    return fn(trees)
  return with_first_slots(trees, fn(first_slots(trees, n)))


@dataclasses.dataclass(frozen=True)
class SlotConfig:
  """What every slot program shares (hashable: a jit static argument)."""

  target_config: LlamaConfig
  drafter: object  # a decoding.drafts Drafter
  k: int
  sampling: Sampling | None  # None: each request brings its own (RowSampling)
  num_slots: int
  cache_size: int  # positions per slot: prompt + new tokens + k must fit
  # Verify only the positions proposals fill: at one slot as many as the
  # longest proposal needs (speculative.verify_pass), over more slots each
  # row's own, packed (speculative.verify_packed).
  trim_verify: bool = False
  # A verified position's cost as a fraction of a plain step: each row then
  # verifies only the drafted positions that pay (verify_policy.py).
  position_cost: float = 0.0

  def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
    """Whether a request can be served in one slot.

    The last step of a row starts at m <= prompt + new - 2 and writes k + 1
    positions into the cache and k + 1 tokens after c_m.
    """
    return 1 <= prompt_len and prompt_len + max_new_tokens + self.k <= self.cache_size

  def window(self, longest: int, steps: int) -> int:
    """Attention window for `steps` steps when the longest active row holds `longest`."""
    return bucket(longest + steps * (self.k + 1), self.cache_size)


def init(cfg: SlotConfig) -> SpecState:
  """All slots empty (done)."""
  return speculative.empty_state(cfg.target_config, cfg.drafter,
                                 batch_size=cfg.num_slots,
                                 cache_size=cfg.cache_size, k=cfg.k)


def insert_into(target_params, draft_params, state: SpecState, prompt_1xP,
                prompt_len, budget, slot, key, route=0,
                sampling: RowSampling | None = None, wants_logprobs=False, *,
                cfg: SlotConfig):
  """`state` with `slot` holding a freshly prefilled request; also its prompt hidden.

  Nothing of the slot's previous request survives: caches, tokens, counters,
  metrics and sampling settings are all overwritten (stale cache positions
  lie past the new length and are never read). Only a drafter that looks up
  served requests keeps the previous one, in its history. `sampling` (one row) is the
  request's own, read when cfg.sampling is None. `wants_logprobs` says whether
  the request asked for log-probs (read only when the state keeps them).
  """
  width = prompt_1xP.shape[1]
  # The request leaving the slot, c_0..c_m (none if the slot never served).
  leaving = (state.tokens[slot], jnp.where(state.prompt_lens[slot] > 0,
                                           state.lengths[slot] + 1, 0))
  one, hidden = speculative.start(
      target_params, draft_params, prompt_1xP, prompt_len[None], budget[None],
      key[None], target_config=cfg.target_config, drafter=cfg.drafter, k=cfg.k,
      cache_size=width, sampling=sampling)
  row = jnp.zeros((cfg.cache_size,), jnp.int32).at[:width].set(prompt_1xP[0])
  state = state.replace(
      target_cache=state.target_cache.insert_row(slot, one.target_cache),
      draft=cfg.drafter.insert_row(state.draft, slot, one.draft, leaving),
      tokens=state.tokens.at[slot].set(row),
      prompt_lens=state.prompt_lens.at[slot].set(prompt_len),
      budget=state.budget.at[slot].set(budget),
      done=state.done.at[slot].set(one.done[0]),
      rng=state.rng.at[slot].set(key),
      metrics=state.metrics.reset_row(slot),
      route=state.route.at[slot].set(route),
      sampling=jax.tree.map(lambda x, y: x.at[slot].set(y[0]), state.sampling,
                            one.sampling))
  if state.logprobs is not None:
    state = state.replace(logprobs=state.logprobs.with_row(slot, wants_logprobs))
  return state, hidden


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def insert(target_params, draft_params, state: SpecState, prompt_1xP, prompt_len,
           budget, slot, key, *, cfg: SlotConfig) -> SpecState:
  """The insert verb (prefill included); one program per prompt bucket."""
  return insert_into(target_params, draft_params, state, prompt_1xP, prompt_len,
                     budget, slot, key, cfg=cfg)[0]


def decode_loop(step_fn, state, carry, steps: int, refill=False,
                axis_name: str | None = None, window: int | None = None):
  """Up to `steps` calls of step_fn(state, carry) -> (state, carry).

  It stops early when every slot is done, and, when `refill` (the host has
  requests waiting), as soon as any slot finishes: a freed slot then waits
  for the host only until the step it finished in, not the call's last one.
  Over a mesh (`axis_name`) every device stops at the same step, so the call
  boundaries, and the learning that follows them, do not depend on the mesh.
  With `window` (the steps' attention window), the steps run on caches cut
  to it (on_window).
  """
  if window is not None:
    return on_window(lambda t: decode_loop(step_fn, *t, steps, refill, axis_name),
                     (state, carry), window)
  was_done = state.done

  def cond(c):
    i, state, _ = c
    finished = jnp.any(state.done & ~was_done)
    busy = jnp.any(~state.done)
    if axis_name is not None:
      finished = jax.lax.psum(finished.astype(jnp.int32), axis_name) > 0
      busy = jax.lax.psum(busy.astype(jnp.int32), axis_name) > 0
    return (i < steps) & busy & ~(refill & finished)

  def body(c):
    i, state, carry = c
    state, carry = step_fn(state, carry)
    return i + 1, state, carry

  _, state, carry = jax.lax.while_loop(cond, body, (0, state, carry))
  return state, carry


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "window", "batch"),
                   donate_argnames=("state",))
def generate(target_params, draft_params, state: SpecState, refill=False, *,
             cfg: SlotConfig, steps: int, window: int,
             batch: int | None = None) -> SpecState:
  """The generate verb: up to `steps` speculative steps over the first `batch`
  slots (all if None), which must hold every request; fewer steps when
  `refill` and a slot finishes (see decode_loop)."""
  step = functools.partial(
      speculative.speculate_and_verify, target_params, draft_params,
      target_config=cfg.target_config, drafter=cfg.drafter, k=cfg.k,
      sampling=cfg.sampling, window=window,
      trim_verify=cfg.trim_verify, position_cost=cfg.position_cost)
  decode = lambda s: decode_loop(lambda s, c: (step(s)[0], c), s, (), steps,
                                 refill, window=window)[0]
  return on_first_slots(decode, state, batch or cfg.num_slots, cfg.num_slots)


@functools.partial(jax.jit, donate_argnames=("state",))
def free(state: SpecState, slot) -> SpecState:
  """The free verb: the slot stops decoding (its client went away)."""
  return state.replace(done=state.done.at[slot].set(True))


def prepare(target_params, draft_params, cfg: SlotConfig):
  """Both models in their decoding layout; do it once, not per call."""
  target_params = llama.for_decoding(target_params, cfg.target_config)
  return target_params, cfg.drafter.prepare(draft_params, target_params)
