"""Batched speculative decoding with static k and exact rejection sampling.

Invariant between steps, per row: the target cache holds the committed
context c_0..c_{m-1}; `tokens` holds c_0..c_m, the last token c_m emitted
but not cached. A step asks the drafter for x_1..x_k, scores [c_m, x_1..x_k]
with the target in one pass, keeps an exact prefix plus one target token,
and rolls back by setting lengths. The drafter is static configuration: the
step never asks which kind it holds. k = 0 with `NoDraft` is plain decoding.
"""

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding import sampling as sampling_lib
from osd_jax.decoding import verify_policy
from osd_jax.decoding.drafts.base import Context, Proposal, Verified
from osd_jax.decoding.logprobs import LogProbs
from osd_jax.decoding.prefill import prefill_hidden
from osd_jax.decoding.row_writes import write_rows
from osd_jax.decoding.sampling import RowSampling, Sampling
from osd_jax.decoding.widths import at_smallest_width
from osd_jax.models import llama, packing
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache
from osd_jax.models.packing import Packing


@flax.struct.dataclass
class Metrics:
  """Running sums per row; every rate the engine reports is a ratio of two."""

  proposed: jax.Array  # [B] drafted tokens proposed
  accepted: jax.Array  # [B] drafted tokens accepted
  target_calls: jax.Array  # [B] verification passes
  emitted: jax.Array  # [B] tokens appended to the output
  alpha_sum: jax.Array  # [B] sum over verified positions of sum_v min(p, q)
  alpha_count: jax.Array  # [B] verified positions
  reached_by_position: jax.Array  # [B, k] times draft position i was verified
  accepted_by_position: jax.Array  # [B, k] times it was accepted
  proposed_by_position: jax.Array  # [B, k] times a proposal reached position i

  @classmethod
  def zeros(cls, batch_size: int, k: int) -> "Metrics":
    # Distinct buffers: a state holding one array twice cannot be donated.
    b = lambda: jnp.zeros((batch_size,), jnp.float32)
    bk = lambda: jnp.zeros((batch_size, k), jnp.float32)
    return cls(b(), b(), b(), b(), b(), b(), bk(), bk(), bk())

  def reset_row(self, row: jax.Array) -> "Metrics":
    return jax.tree.map(lambda x: x.at[row].set(0), self)


@flax.struct.dataclass
class SpecState:
  """Everything that changes while a batch of rows decodes."""

  target_cache: KVCache  # c_0..c_{m-1}; lengths = m
  draft: Any  # the drafter's own state (a KV cache, nothing, ...)
  tokens: jax.Array  # [B, S] prompt then output: c_0..c_m
  prompt_lens: jax.Array  # [B]
  budget: jax.Array  # [B] most new tokens of each row
  done: jax.Array  # [B] bool: EOS or budget reached (or an empty slot)
  rng: jax.Array  # [B] keys: each row draws from its own
  metrics: Metrics
  route: jax.Array  # [B] int32: which draft serves the row (per category)
  # Each row's own sampling settings, used when the step has no static one.
  sampling: RowSampling
  # The target's log-probs of the emitted tokens, for rows that ask; None:
  # the feature is off (no arrays, no compute).
  logprobs: LogProbs | None = None

  @property
  def lengths(self) -> jax.Array:
    """m per row."""
    return self.target_cache.lengths

  @property
  def num_generated(self) -> jax.Array:
    """[B] tokens emitted so far (EOS included)."""
    return self.target_cache.lengths + 1 - self.prompt_lens


@flax.struct.dataclass
class StepResult:
  """What one step saw, per row: enough for metrics and online distillation."""

  drafted: jax.Array  # [B, k] proposed tokens x_1..x_k
  num_proposed: jax.Array  # [B] how many of them were real proposals
  num_accepted: jax.Array  # [B] n in 0..k, before EOS/length cuts
  emitted: jax.Array  # [B, k+1] x_1..x_n then the correction/bonus y
  kept: jax.Array  # [B] tokens appended (0 for finished rows)
  alpha: jax.Array  # [B, k] sum_v min(p_i, q_i)
  is_verified: jax.Array  # [B, k] position i <= n on an active row
  active: jax.Array  # [B] row was unfinished when the step began
  start: jax.Array  # [B] sequence position of the first emitted token (m + 1)
  target_logits: jax.Array  # [B, k+1, V] the teacher, free from verification
  hidden: jax.Array  # [B, k+1, D] target hidden states at positions m..m+k


def row_keys(rng: jax.Array, batch_size: int) -> jax.Array:
  """[B] independent keys from one."""
  return jax.random.split(rng, batch_size)


def empty_state(target_config: LlamaConfig, drafter, *, batch_size: int,
                cache_size: int, k: int, max_logprobs: int | None = None) -> SpecState:
  """`batch_size` empty (done) rows: the slot engine fills them one by one.

  With `max_logprobs` N (not None), the state keeps each emitted token's
  target log-prob and the top N for the rows that ask (decoding/logprobs.py).
  """
  b = batch_size
  zeros = lambda: jnp.zeros((b,), jnp.int32)
  return SpecState(
      target_config.init_cache(b, cache_size),
      drafter.init_state(b, cache_size),
      jnp.zeros((b, cache_size), jnp.int32), zeros(), zeros(),
      jnp.ones((b,), bool), row_keys(jax.random.key(0), b), Metrics.zeros(b, k),
      zeros(), RowSampling.fill(Sampling(), b),
      None if max_logprobs is None else LogProbs.empty(b, cache_size, max_logprobs))


def start(target_params, draft_params, prompts_BxP, prompt_lens_B, budget_B, rng_B,
          *, target_config: LlamaConfig, drafter, k: int, cache_size: int,
          sampling: RowSampling | None = None) -> tuple[SpecState, jax.Array]:
  """Prefills target and draft on each prompt but its last token.

  `sampling` holds each row's own settings (default: greedy), read when a
  step has no static sampling. Returns the state and the target's hidden
  states at the prompt positions [B, P, D] (the feature draft reads them).
  """
  b, width = prompts_BxP.shape
  cached = jnp.maximum(prompt_lens_B - 1, 0)
  hidden, target_cache = prefill_hidden(target_params, target_config, prompts_BxP,
                                        cached, target_config.init_cache(b, cache_size))
  draft = drafter.prefill(draft_params, drafter.init_state(b, cache_size),
                          prompts_BxP, prompt_lens_B,
                          hidden if drafter.needs_hidden else None)
  tokens = jnp.zeros((b, cache_size), jnp.int32).at[:, :width].set(prompts_BxP)
  state = SpecState(target_cache, draft, tokens, prompt_lens_B.astype(jnp.int32),
                    budget_B.astype(jnp.int32), budget_B < 1, rng_B,
                    Metrics.zeros(b, k), jnp.zeros((b,), jnp.int32),
                    sampling or RowSampling.fill(Sampling(), b))
  return state, hidden


def _accept(proposal: Proposal, target_logits, keys_B, sampling):
  """Leviathan et al.'s rule: (n accepted, correction/bonus token y, alpha [B, k]).

  `sampling` is one static Sampling, or a RowSampling whose greedy rows take
  the greedy rule and whose other rows the stochastic one.
  """
  drafted = proposal.tokens
  k = drafted.shape[1]
  is_real = jnp.arange(k) < proposal.num_proposed[:, None]
  # The metric uses the plain softmax in greedy mode, the sampler's otherwise.
  p = sampling.probs(target_logits)  # [B, k+1, V]
  q = sampling.probs(proposal.logits)  # [B, k, V]
  alpha = jnp.minimum(p[:, :k], q).sum(axis=-1)
  choice = sampling_lib.argmax(target_logits)  # [B, k+1]
  n_greedy = jnp.cumprod((drafted == choice[:, :k]) & is_real, axis=1).sum(axis=1)
  y_greedy = jnp.take_along_axis(choice, n_greedy[:, None], axis=1)[:, 0]
  if isinstance(sampling, Sampling) and sampling.is_greedy:
    return n_greedy, y_greedy, alpha
  n, y = _accept_sampled(proposal, p, q, keys_B, is_real)
  if isinstance(sampling, RowSampling):
    n = jnp.where(sampling.is_greedy, n_greedy, n)
    y = jnp.where(sampling.is_greedy, y_greedy, y)
  return n, y, alpha


def _accept_sampled(proposal: Proposal, p, q, keys_B, is_real):
  """The stochastic rule: accept x_i w.p. min(1, p/q), then y from the residual."""
  drafted = proposal.tokens
  k = drafted.shape[1]
  split = jax.vmap(jax.random.split)(keys_B)
  accept_keys, residual_keys = split[:, 0], split[:, 1]
  at_draft = lambda probs: jnp.take_along_axis(
      probs[:, :k], drafted[..., None], axis=-1)[..., 0]
  p_x, q_x = at_draft(p), at_draft(q)
  u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(accept_keys)
  # u < p/q without dividing; q_x > 0 because x was drawn from q.
  is_accepted = (u * q_x < p_x) & is_real
  n = jnp.cumprod(is_accepted, axis=1).sum(axis=1)
  # Past the proposals (the bonus, or no draft at all) q is 0: y ~ p.
  q_padded = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)
  q_row = jnp.where(n < proposal.num_proposed, n, k)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  q_n = jnp.take_along_axis(q_padded, q_row[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - q_n, 0.0)
  # All-zero residual happens only when p == q numerically; p is then exact.
  residual = jnp.where(residual.sum(-1, keepdims=True) > 1e-12, residual, p_n)
  return n, jax.vmap(sampling_lib.categorical)(residual_keys, jnp.log(residual))


def verify_widths(k: int) -> tuple[int, ...]:
  """Widths a trimmed verification may take: every one from 1 to k + 1."""
  return tuple(range(1, k + 2))


def verify_pass(target_params, target_config: LlamaConfig, verify_BxT,
                 cache: KVCache, window, widths: tuple[int, ...], needed):
  """The target's hidden states and logits over `verify`, and the cache
  holding its keys/values; the pass runs on only the first `needed` positions.

  It runs at the smallest of `widths` that holds `needed`, padded back to
  the full width. On a 2-core AVX2 CPU a pass over 5 tokens costs about 1.9x
  one over 1, over 2 about 1.25x, so a step whose drafts all stopped early
  pays for what was drafted, not for k. Positions past `needed` were never
  proposed: nothing reads their zero padding, and their cache entries lie
  past every row's committed length. The branches only read the cache
  (llama.score); it is written once, after them, so XLA copies no cache
  into a branch.
  """
  full = verify_BxT.shape[1]
  if len(widths) == 1:  # no choice: write, then attend, in place (llama.forward)
    # On the 2-core EPYC at batch 8 this is 42.5 ms a 1-token step, against
    # 53.6 ms reading with `score` and writing after.
    hidden, cache = llama.forward(target_params, target_config, verify_BxT, cache,
                                  window=window)
    return hidden, llama.logits(target_params, target_config, hidden), cache

  def at_width(w):
    hidden, new = llama.score(target_params, target_config, verify_BxT[:, :w],
                              cache, window=window)
    logits = llama.logits(target_params, target_config, hidden)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, full - w), (0, 0)))
    return pad(hidden), pad(logits), new.padded_to(full)

  hidden, logits, new = at_smallest_width(widths, needed, at_width)
  return hidden, logits, cache.append(new, starts_B=cache.lengths)


def verify_packed(target_params, target_config: LlamaConfig, verify_BxT,
                  cache: KVCache, window, counts_B):
  """verify_pass on only each row's first counts[b] positions (its last token
  and its proposal; 0 for a finished row), packed into the smallest of
  packing.sizes that holds them all: a batch of 8 rows where 3 proposed 2
  tokens computes 14 positions, not 24 (on a 2-core CPU a batch-8 pass
  costs about 42 / 57 / 70 ms at 8 / 16 / 24 positions). Every proposed
  position is verified, as at full width; the rest read as zeros.
  """
  b, full = verify_BxT.shape

  def at_size(n):
    packed = Packing.of_counts(counts_B, full, n)
    hidden, new = llama.score_packed(target_params, target_config, verify_BxT, cache,
                                     packed, window=window)
    logits = llama.logits(target_params, target_config, hidden)
    return packed.scatter(hidden), packed.scatter(logits), new

  hidden, logits, new = at_smallest_width(packing.sizes(b, full), counts_B.sum(),
                                          at_size)
  return hidden, logits, cache.append(new, starts_B=cache.lengths)


def commit_pass(drafter, draft_params, draft, verified: Verified, window,
                widths: tuple[int, ...], needed):
  """The drafter's commit on the first `needed` verified positions, at the
  smallest of `widths` that holds them (as verify_pass). No row keeps more
  than its proposal plus one token, so the rest hold nothing to commit (a
  feature draft re-reads the kept tokens; a 2-layer pass on 1 token costs
  about 0.4x one on 5 on a 2-core CPU). A commit that reads nothing (the
  model draft's: `commit_reads` False) takes no branch."""
  if len(widths) == 1 or not drafter.commit_reads:  # nothing to narrow
    return drafter.commit(draft_params, draft, verified, window)
  return at_smallest_width(widths, needed, lambda w: drafter.commit(
      draft_params, draft, verified.narrowed(w), window))


def speculate_and_verify(target_params, draft_params, state: SpecState, *,
                         target_config: LlamaConfig, drafter, k: int,
                         sampling: Sampling | None,
                         window: int | None = None,
                         trim_verify: bool = False,
                         position_cost: float = 0.0) -> tuple[SpecState, StepResult]:
  """One draft-k, verify-once step over every row.

  `sampling` None draws each row with its own settings (state.sampling).
  `k` may be less than the k the state was built for (not more); at k = 0
  the step is a plain target step whatever the drafter: nothing is drafted,
  and the drafter only commits what was kept (a model draft catches up at
  its next proposal, a feature draft reads the target's features there).
  `window` bounds the cache positions attention reads (every row's length
  after the step must fit). The target's logits and hidden states at the
  verified positions come back in the result: the teacher for online
  distillation, with no second target pass. `trim_verify` verifies only
  the positions the proposals fill: over one row at the proposal's width
  (verify_pass), over more each row's own, packed (verify_packed); the
  drafter commits as many as the longest (commit_pass). Without it every
  row verifies k + 1 positions and the drafter proposes at full width
  (Drafter.at_full_width). With a `position_cost` (a verified position's
  cost as a fraction of a plain step, on this host and batch) each row
  verifies only the drafted positions that pay (verify_policy.py); it needs
  `trim_verify`, without which every position is verified anyway.
  """
  if position_cost and not trim_verify:
    raise ValueError("A position cost cuts proposals only where verification is"
                     " trimmed (trim_verify).")
  if sampling is None:
    sampling = state.sampling
  if not trim_verify:
    drafter = drafter.at_full_width()
  keys = jax.vmap(lambda key: jax.random.split(key, 3))(state.rng)
  next_keys, draft_keys, accept_keys = keys[:, 0], keys[:, 1], keys[:, 2]
  m = state.lengths
  limit = (verify_policy.limits(state.metrics, k, position_cost)
           if position_cost and k else None)
  ctx = Context(state.tokens, m, state.route, limit)
  if k:
    proposal, draft = drafter.propose(draft_params, state.draft, ctx, draft_keys, k,
                                      sampling, window)
  else:  # a plain target step: the drafter keeps in step through its commit
    proposal, draft = Proposal.empty(m.shape[0], target_config.vocab_size), state.draft
  proposal = proposal.replace(num_proposed=ctx.within_limit(proposal.num_proposed))
  verify = jnp.concatenate([ctx.last_token[:, None], proposal.tokens], axis=1)
  widths = verify_widths(k) if trim_verify else (k + 1,)
  counts = jnp.where(state.done, 0, proposal.num_proposed + 1)
  needed = jnp.maximum(jnp.max(counts), 1)
  if trim_verify and counts.shape[0] > 1 and k:  # k = 0: nothing to pack
    hidden, target_logits, target_cache = verify_packed(
        target_params, target_config, verify, state.target_cache, window, counts)
  else:
    hidden, target_logits, target_cache = verify_pass(
        target_params, target_config, verify, state.target_cache, window, widths,
        needed)
  n, y, alpha = _accept(proposal, target_logits, accept_keys, sampling)

  positions = jnp.arange(k + 1)
  emitted = jnp.where(positions < n[:, None],
                      jnp.pad(proposal.tokens, ((0, 0), (0, 1))),
                      jnp.where(positions == n[:, None], y[:, None], 0))
  active = ~state.done
  generated = state.num_generated
  kept = jnp.where(active, jnp.minimum(n + 1, state.budget - generated), 0)
  is_eos = (emitted == target_config.eos_id) & (positions < kept[:, None])
  hit_eos = is_eos.any(axis=1)
  kept = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, kept)
  done = state.done | hit_eos | (generated + kept >= state.budget)
  tokens = write_rows(state.tokens, emitted, kept, m + 1)
  logprobs = state.logprobs
  if logprobs is not None:
    logprobs = logprobs.record(target_logits, emitted, kept, m + 1)
  target_cache = target_cache.with_lengths(m + kept)
  draft = commit_pass(drafter, draft_params, draft,
                      Verified(hidden, verify, emitted, kept, m, ctx.route),
                      window, widths, needed)

  is_verified = (jnp.arange(k) <= n[:, None]) & (
      jnp.arange(k) < proposal.num_proposed[:, None]) & active[:, None]
  is_accepted = (jnp.arange(k) < n[:, None]) & active[:, None]
  is_proposed = (jnp.arange(k) < proposal.num_proposed[:, None]) & active[:, None]
  f32 = lambda x: x.astype(jnp.float32)
  mt = state.metrics
  # A step may draft fewer tokens than the state was built for (a loaded
  # server's smaller k): the positions it did not reach count nothing.
  by_position = lambda x: jnp.pad(
      f32(x), ((0, 0), (0, mt.reached_by_position.shape[1] - k)))
  metrics = Metrics(
      proposed=mt.proposed + f32(jnp.where(active, proposal.num_proposed, 0)),
      accepted=mt.accepted + f32(jnp.where(active, n, 0)),
      target_calls=mt.target_calls + f32(active),
      emitted=mt.emitted + f32(kept),
      alpha_sum=mt.alpha_sum + (alpha * is_verified).sum(axis=1),
      alpha_count=mt.alpha_count + f32(is_verified).sum(axis=1),
      reached_by_position=mt.reached_by_position + by_position(is_verified),
      accepted_by_position=mt.accepted_by_position + by_position(is_accepted),
      proposed_by_position=mt.proposed_by_position + by_position(is_proposed))
  state = state.replace(target_cache=target_cache, draft=draft, tokens=tokens,
                        done=done, rng=next_keys, metrics=metrics,
                        logprobs=logprobs)
  result = StepResult(proposal.tokens, proposal.num_proposed, n, emitted, kept,
                      alpha, is_verified, active, m + 1, target_logits, hidden)
  return state, result


@functools.partial(
    jax.jit, static_argnames=("target_config", "drafter", "k", "sampling",
                              "max_new_tokens", "cache_size", "trim_verify",
                              "position_cost"))
def generate(target_params, draft_params, prompts_BxP, prompt_lens_B, rng, *,
             target_config: LlamaConfig, drafter, k: int, sampling: Sampling,
             max_new_tokens: int, cache_size: int,
             trim_verify: bool = False, position_cost: float = 0.0) -> SpecState:
  """Decodes every row until EOS or max_new_tokens, in one compiled loop.

  The whole batch waits for its slowest row: the slot engine does not.
  """
  target_params = llama.for_decoding(target_params, target_config)
  draft_params = drafter.prepare(draft_params, target_params)
  b = prompts_BxP.shape[0]
  state, _ = start(target_params, draft_params, prompts_BxP, prompt_lens_B,
                   jnp.full((b,), max_new_tokens), row_keys(rng, b),
                   target_config=target_config, drafter=drafter, k=k,
                   cache_size=cache_size)
  step = functools.partial(speculate_and_verify, target_params, draft_params,
                           target_config=target_config, drafter=drafter, k=k,
                           sampling=sampling, trim_verify=trim_verify,
                           position_cost=position_cost)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: step(s)[0],
                            state)


def output_of(state: SpecState, row: int) -> list[int]:
  """The generated token ids of one row (host side; EOS included)."""
  # Whole arrays to the host, sliced there: slicing on device would compile
  # a program per output length.
  tokens, start, count = jax.device_get(
      (state.tokens[row], state.prompt_lens[row], state.num_generated[row]))
  return [int(t) for t in tokens[int(start):int(start) + int(count)]]
