"""A small Llama (cut from the target, or a checkpoint) as the draft.

Its state is its own KV cache, holding the committed tokens c_0..c_{m-1}.
A proposal feeds c_m, then each draw, so its cache already holds what
verification keeps unless all was accepted; commit re-reads the kept tokens
(the target's own input [c_m, x_1..x_k]) from position m only when some row
kept more than was fed, or the draft did not propose at all (the hybrid
skips it when n-gram lookup covers every row). Rollback is a length.

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
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache
from osd_jax.when import when


@dataclasses.dataclass(frozen=True)
class ModelDraft:
  """Autoregressive drafting with a small model sharing the target's tokenizer."""

  config: LlamaConfig
  needs_hidden: bool = False
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
    cache = cache.with_lengths(ctx.lengths)

    def draw(i, token, cache):
      logits, cache = llama.apply(params, self.config, token[:, None], cache,
                                  window=window)
      return pick(i, logits[:, 0]), logits[:, 0], cache

    if self.confidence_threshold:
      proposal, cache = self._draw_while_confident(draw, ctx.last_token, cache, k,
                                                   sampling, forced)
    else:
      def step(carry, i):
        nxt, logits, cache = draw(i, *carry)
        return (nxt, cache), (nxt, logits)

      (_, cache), (tokens, logits) = jax.lax.scan(
          step, (ctx.last_token, cache), jnp.arange(k))
      proposal = Proposal(tokens.T, jnp.swapaxes(logits, 0, 1),
                          jnp.full(ctx.lengths.shape, k, jnp.int32))
    return apply_forced(proposal, forced, self.config.vocab_size), cache

  def _draw_while_confident(self, draw, token, cache, k: int, sampling, forced):
    """Up to k draws; the loop ends when no row is still confident."""
    b = token.shape[0]
    going = jnp.ones((b,), bool) if forced is None else ~forced.is_forced
    init = (jnp.int32(0), token, cache, jnp.zeros((b, k), jnp.int32),
            jnp.zeros((b, k, self.config.vocab_size), jnp.float32),
            jnp.zeros((b,), jnp.int32), going)

    def body(carry):
      i, token, cache, tokens, logits, counts, going = carry
      nxt, step_logits, cache = draw(i, token, cache)
      q_x = jnp.take_along_axis(sampling.probs(step_logits), nxt[:, None], axis=1)[:, 0]
      confident = q_x >= self.confidence_threshold
      proposed = going & confident if self.stop_before_unconfident else going
      return (i + 1, nxt, cache, tokens.at[:, i].set(nxt),
              logits.at[:, i].set(step_logits), counts + proposed, going & confident)

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
    """Keeps the kept positions m..m+kept-1, re-reading them (no head: only
    keys and values) unless the proposal already cached them all.

    A proposal feeds c_m, x_1, .. in turn, so after it positions m..length-1
    hold the verified tokens' keys and values, if the row's proposal was the
    draft's own. Most steps keep no more than was fed (only a fully accepted
    proposal's bonus is new) and then cost no draft pass; a step where n-gram
    lookup proposed for every row fed nothing.
    """
    fed = cache.lengths - verified.start
    own = True if verified.own is None else verified.own
    cached = own & (verified.kept <= fed)

    def reread(cache):
      _, new = llama.forward(params, self.config, verified.tokens,
                             cache.with_lengths(verified.start), window=window)
      return new

    cache = when(~jnp.all(cached), reread, cache)
    return cache.with_lengths(verified.start + verified.kept)

  def insert_row(self, cache: KVCache, row, one: KVCache) -> KVCache:
    return cache.insert_row(row, one)

  def at_full_width(self):
    return dataclasses.replace(self, stop_before_unconfident=False)
