"""A small Llama (cut from the target, or a checkpoint) as the draft.

Its state is its own KV cache, holding the committed tokens c_0..c_{m-1}.
A proposal feeds c_m, then each draw; commit re-reads what verification
kept (the target's own input [c_m, x_1..x_k]) from position m, so the cache
is right whatever was proposed, or whether the draft proposed at all (the
hybrid skips it when n-gram lookup covers every row). Rollback is a length.
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
    """Caches all but the last prompt token (the first proposal feeds it)."""
    _, cache = prefill_model(params, self.config, prompts_BxP,
                             jnp.maximum(prompt_lens_B - 1, 0), cache)
    return cache

  def propose(self, params, cache: KVCache, ctx: Context, rng_B, k: int,
              sampling: Sampling, window, forced: Forced | None = None):
    """k draws, each fed back (or the forced token, for the hybrid's rows)."""
    pick = token_picker(rng_B, k, sampling, forced)

    def step(carry, i):
      token, cache = carry
      logits, cache = llama.apply(params, self.config, token[:, None], cache,
                                  window=window)
      nxt = pick(i, logits[:, 0])
      return (nxt, cache), (nxt, logits[:, 0])

    (_, cache), (tokens, logits) = jax.lax.scan(
        step, (ctx.last_token, cache.with_lengths(ctx.lengths)), jnp.arange(k))
    proposal = Proposal(tokens.T, jnp.swapaxes(logits, 0, 1),
                        jnp.full(ctx.lengths.shape, k, jnp.int32))
    return apply_forced(proposal, forced, self.config.vocab_size), cache

  def commit(self, params, cache: KVCache, verified, window) -> KVCache:
    """Re-reads the kept positions m..m+kept-1 (no head: only keys and values)."""
    _, new = llama.forward(params, self.config, verified.tokens,
                           cache.with_lengths(verified.start), window=window)
    return new.with_lengths(verified.start + verified.kept)

  def insert_row(self, cache: KVCache, row, one: KVCache) -> KVCache:
    return cache.insert_row(row, one)
