"""A small Llama (cut from the target, or a checkpoint) as the draft.

Its state is its own KV cache, holding a prefix c_0..c_{L-1} of the
committed tokens, L <= m: commit never reads anything, it only cuts the
cache back to what verification kept of what the proposal fed (c_m, then
each draw). A proposal first catches up, feeding c_L..c_m in one pass (the
kept tokens its last proposal did not feed, every token of the steps the
hybrid's lookup proposed alone, then c_m), and draws from the logits after
c_m; at L = m that is the one-token pass a proposal always began with.
The hybrid's lookup steps thus cost no draft pass at all, and a fully
accepted proposal's last draw is read with the next proposal's first.

With a confidence threshold (Hugging Face's `assistant_confidence_threshold`)
a row stops drafting after a token its draft gave less than that probability:
later draws would most likely be thrown away, so the step saves their draft
passes. The stop depends only on the draft's own draws, so rejection sampling
stays exact. With `stop_before_unconfident` the unlikely draw itself is not
proposed either, so a step may propose nothing: with verification trimmed to
the proposal's width, a draw that is mostly rejected costs more target time
than it saves (steps at full width propose it: `at_full_width`). Whether a
draw is proposed then depends on the draw itself, so its q is no longer the
draft's softmax: given that it is proposed it is the one token above the
threshold (the threshold must exceed 0.5, so there is at most one), and the
proposal is that token one-hot. Rejection sampling against the one-hot,
after a stop with probability 1 - q(token), gives the target's distribution.
(tests/test_sampling_exactness.py: keeping the softmax fails there.)
"""

import dataclasses

import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts.base import (Context, Forced, Proposal, apply_forced,
                                          one_hot_logits, token_picker)
from osd_jax.decoding.prefill import prefill as prefill_model
from osd_jax.decoding.sampling import Sampling
from osd_jax.decoding.widths import at_smallest_width
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class ModelDraft:
  """Autoregressive drafting with a small model sharing the target's tokenizer."""

  config: LlamaConfig
  needs_hidden: bool = False
  commit_reads = False  # a class attribute, not a field
  # Stop a row's proposal after a draw of lower probability (0: always k).
  confidence_threshold: float = 0.0
  # Propose only the draws at or above the threshold (not the one below it).
  stop_before_unconfident: bool = False

  def __post_init__(self):
    if not 0.0 <= self.confidence_threshold < 1.0:
      raise ValueError("The draft confidence threshold must be in [0, 1), got"
                       f" {self.confidence_threshold}.")
    if self.stop_before_unconfident and self.confidence_threshold <= 0.5:
      raise ValueError("Stopping before an unconfident draw needs a confidence"
                       " threshold above 0.5 (at most one confident token),"
                       f" got {self.confidence_threshold}.")

  def prepare(self, params, target_params=None):
    return llama.for_decoding(params, self.config, fuse=False)

  def init_state(self, batch_size: int, cache_size: int) -> KVCache:
    return self.config.init_cache(batch_size, cache_size)

  def prefill(self, params, cache: KVCache, prompts_BxP, prompt_lens_B,
              hidden_BxPxD=None) -> KVCache:
    """Caches all but the last prompt token (the first proposal feeds it)."""
    _, cache = prefill_model(params, self.config, prompts_BxP,
                             jnp.maximum(prompt_lens_B - 1, 0), cache)
    return cache

  def propose(self, params, cache: KVCache, ctx: Context, rng_B, k: int,
              sampling: Sampling, window, forced: Forced | None = None):
    """k draws, each fed back (or the forced token, for the hybrid's rows)."""
    pick = token_picker(rng_B, k, sampling, forced)
    idle = None if forced is None else forced.idle
    first_logits, cache = self.catch_up(params, cache, ctx, k + 1, window, idle)
    caught_up = cache.lengths

    def draw(i, token, cache):
      logits, cache = llama.apply(params, self.config, token[:, None], cache,
                                  window=window)
      return pick(i, logits[:, 0]), logits[:, 0], cache

    first = pick(0, first_logits)
    if self.confidence_threshold:
      proposal, cache = self._draw_while_confident(draw, first, first_logits, cache,
                                                   k, sampling, forced, ctx.limit)
    else:
      def step(carry, i):
        nxt, logits, cache = draw(i, *carry)
        return (nxt, cache), (nxt, logits)

      (_, cache), (tokens, logits) = jax.lax.scan(
          step, (first, cache), jnp.arange(1, k))
      tokens = jnp.concatenate([first[:, None], tokens.T], axis=1)
      logits = jnp.concatenate([first_logits[:, None], jnp.swapaxes(logits, 0, 1)],
                               axis=1)
      proposal = Proposal(tokens, logits, jnp.full(ctx.lengths.shape, k, jnp.int32))
    if idle is not None:  # their draws, fed after a partial catch-up, are dropped
      cache = cache.with_lengths(jnp.where(idle, caught_up, cache.lengths))
    return apply_forced(proposal, forced, self.config.vocab_size), cache

  def catch_up(self, params, cache: KVCache, ctx: Context, chunk: int, window,
               idle=None):
    """Feeds c_L..c_m: (logits after c_m [B, V], the cache holding c_0..c_m).

    Lags longer than `chunk` (k + 1) first advance `chunk` tokens a pass.
    The last pass runs at the smallest width holding every row's rest (one
    branch per width, as verification). Every row reads from its own L, so
    each entry is computed once, whatever the other rows need; a row with a
    shorter rest also reads tokens past c_m, whose entries lie beyond its
    length and at most k past c_m, where verification writes anyway. The
    branches only read the cache (llama.score): it is written after them.
    `idle` rows [B] need not catch up: the passes run for the other rows
    move them on as far as they reach (their logits are not theirs).
    """
    m = ctx.lengths
    needs = True if idle is None else ~idle

    def feed(cache, width):
      idx = cache.lengths[:, None] + jnp.arange(width)[None, :]
      return jnp.take_along_axis(ctx.tokens, jnp.minimum(idx, ctx.tokens.shape[1] - 1),
                                 axis=1)

    def advance(cache):  # rows with more than `chunk` to go move `chunk` on
      far = m + 1 - cache.lengths > chunk
      _, fed = llama.forward(params, self.config, feed(cache, chunk), cache,
                             window=window)
      return fed.with_lengths(jnp.where(far, cache.lengths + chunk, cache.lengths))

    cache = jax.lax.while_loop(
        lambda c: jnp.any(needs & (m + 1 - c.lengths > chunk)), advance, cache)
    rest = m + 1 - cache.lengths

    def at_width(w):
      reached = jnp.minimum(rest, w)
      hidden, new = llama.score(params, self.config, feed(cache, w), cache,
                                window=window)
      last = jnp.take_along_axis(hidden, (reached - 1)[:, None, None], axis=1)
      return last, new.padded_to(chunk), cache.lengths + reached

    last, new, lengths = at_smallest_width(
        tuple(range(1, chunk + 1)), jnp.max(jnp.where(needs, rest, 1)), at_width)
    cache = cache.append(new, starts_B=cache.lengths).with_lengths(lengths)
    return llama.logits(params, self.config, last)[:, 0], cache

  def _draw_while_confident(self, draw, first, first_logits, cache, k: int,
                            sampling, forced, limit=None):
    """Up to k draws (a row's `limit` [B], where given); the loop ends when
    no row is still confident and within its limit."""
    b = first.shape[0]
    going = jnp.ones((b,), bool) if forced is None else forced.is_served
    limit = jnp.full((b,), k, jnp.int32) if limit is None else limit
    going &= limit > 0

    def record(i, nxt, step_logits, tokens, logits, counts, going):
      q_x = jnp.take_along_axis(sampling.probs(step_logits), nxt[:, None], axis=1)[:, 0]
      confident = q_x >= self.confidence_threshold
      proposed = going & confident if self.stop_before_unconfident else going
      return (tokens.at[:, i].set(nxt), logits.at[:, i].set(step_logits),
              counts + proposed, going & confident & (i + 1 < limit))

    init = (jnp.int32(1), first, cache) + record(
        0, first, first_logits, jnp.zeros((b, k), jnp.int32),
        jnp.zeros((b, k, self.config.vocab_size), jnp.float32),
        jnp.zeros((b,), jnp.int32), going)

    def body(carry):
      i, token, cache, tokens, logits, counts, going = carry
      nxt, step_logits, cache = draw(i, token, cache)
      return (i + 1, nxt, cache) + record(i, nxt, step_logits, tokens, logits, counts,
                                          going)

    _, _, cache, tokens, logits, counts, _ = jax.lax.while_loop(
        lambda c: (c[0] < k) & c[-1].any(), body, init)
    if self.stop_before_unconfident:
      logits = self._given_proposed(logits, tokens, sampling)
    return Proposal(tokens, logits, counts), cache

  def _given_proposed(self, logits, tokens, sampling):
    """q of a draw given that it was proposed: one-hot for sampled rows. The
    greedy rule reads no q, so greedy rows keep the softmax (for alpha)."""
    hot = one_hot_logits(tokens, self.config.vocab_size)
    greedy = sampling.is_greedy
    if isinstance(greedy, bool):
      return logits if greedy else hot
    return jnp.where(greedy[:, None, None], logits, hot)

  def commit(self, params, cache: KVCache, verified, window) -> KVCache:
    """Keeps what the proposal fed of the kept positions m..m+kept-1; reads
    nothing (the next proposal catches up on the rest).

    After its own proposal the cache holds c_m, x_1, .. from position m, so
    it keeps min(kept, fed) of them. A step the draft did not run (lookup
    proposed for every row) fed nothing and the cache stays as it was; a
    per-category copy that did not serve the row (MultiDraft) fed its own
    draws, so only c_m holds.
    """
    own = True if verified.own is None else verified.own
    valid = verified.start + jnp.where(own, verified.kept,
                                       jnp.minimum(verified.kept, 1))
    return cache.with_lengths(jnp.minimum(cache.lengths, valid))

  def insert_row(self, cache: KVCache, row, one: KVCache, leaving=None) -> KVCache:
    return cache.insert_row(row, one)

  def at_full_width(self):
    return dataclasses.replace(self, stop_before_unconfident=False)

