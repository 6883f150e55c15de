"""A small Llama (cut from the target, or a checkpoint) as the draft.

Its state is its own KV cache. Each proposal re-reads [c_{m-1}, c_m] from
position m-1, so the cache is right whether or not it had cached c_{m-1}
(it had not when all k drafts were accepted) and rollback is only a length.
At m = 0 (a 1-token prompt) the pair is [c_0, c_0] from position 0: the
first read alone counts and the second is rolled back.
"""

import dataclasses

import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts.base import (Context, Forced, Proposal, apply_forced,
                                          token_picker)
from osd_jax.decoding.prefill import prefill as prefill_model
from osd_jax.decoding.sampling import Sampling
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class ModelDraft:
  """Autoregressive drafting with a small model sharing the target's tokenizer."""

  config: LlamaConfig
  needs_hidden: bool = False

  def prepare(self, params, target_params=None):
    return llama.for_decoding(params, self.config)

  def init_state(self, batch_size: int, cache_size: int) -> KVCache:
    return self.config.init_cache(batch_size, cache_size)

  def prefill(self, params, cache: KVCache, prompts_BxP, prompt_lens_B,
              hidden_BxPxD=None) -> KVCache:
    """Caches all but the last prompt token (the first proposal re-reads it)."""
    _, cache = prefill_model(params, self.config, prompts_BxP,
                             jnp.maximum(prompt_lens_B - 1, 0), cache)
    return cache

  def propose(self, params, cache: KVCache, ctx: Context, rng_B, k: int,
              sampling: Sampling, window, forced: Forced | None = None):
    """k draws, each fed back (or the forced token, for the hybrid's rows)."""
    start = jnp.maximum(ctx.lengths - 1, 0)
    prev = jnp.take_along_axis(ctx.tokens, start[:, None], axis=1)[:, 0]
    pair = jnp.stack([prev, ctx.last_token], axis=1)
    logits, cache = llama.apply(params, self.config, pair,
                                cache.with_lengths(start), window=window)
    is_first = ctx.lengths == 0  # c_0 alone: no c_{m-1} to re-read
    first_logits = jnp.where(is_first[:, None], logits[:, 0], logits[:, 1])
    cache = cache.with_lengths(cache.lengths - is_first)
    pick = token_picker(rng_B, k, sampling, forced)
    first = pick(0, first_logits)

    def step(carry, i):
      token, cache = carry
      logits, cache = llama.apply(params, self.config, token[:, None], cache,
                                  window=window)
      nxt = pick(i, logits[:, 0])
      return (nxt, cache), (nxt, logits[:, 0])

    (_, cache), (rest, rest_logits) = jax.lax.scan(step, (first, cache),
                                                   jnp.arange(1, k))
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    all_logits = jnp.concatenate(
        [first_logits[:, None], jnp.swapaxes(rest_logits, 0, 1)], axis=1)
    proposal = Proposal(tokens, all_logits,
                        jnp.full(ctx.lengths.shape, k, jnp.int32))
    return apply_forced(proposal, forced, self.config.vocab_size), cache

  def commit(self, params, cache: KVCache, verified, window) -> KVCache:
    return cache  # the next proposal sets the length

  def insert_row(self, cache: KVCache, row, one: KVCache) -> KVCache:
    return cache.insert_row(row, one)
