"""A learned draft that proposes the n-gram continuation whenever the context has a match.

Code and SQL answers copy names from their prompts; where lookup finds
nothing the learned draft proposes instead. The base drafter is fed the
chosen tokens, so its proposal is consistent with what was proposed.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts.base import Context, Forced, Proposal, one_hot_logits
from osd_jax.decoding.drafts.ngram import NGramDraft


@dataclasses.dataclass(frozen=True)
class HybridDraft:
  """n-gram rows where lookup matches, `base` rows elsewhere (per row, per step)."""

  base: Any  # a Drafter with parameters
  ngram: NGramDraft

  @property
  def needs_hidden(self) -> bool:
    return self.base.needs_hidden

  @property
  def commit_reads(self) -> bool:
    return self.base.commit_reads

  def prepare(self, params, target_params=None):
    return self.base.prepare(params, target_params)

  def init_state(self, batch_size, cache_size):
    return self.base.init_state(batch_size, cache_size)

  def prefill(self, params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD=None):
    return self.base.prefill(params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD)

  def propose(self, params, state, ctx: Context, rng_B, k, sampling, window,
              forced=None):
    """When lookup covers every row the base draft is skipped: its state
    then lags the committed tokens, and its next proposal catches up."""
    tokens, counts = self.ngram.lookup(ctx, k)
    lookup_only = lambda: (Proposal(tokens, one_hot_logits(tokens, self.ngram.vocab_size),
                                    counts), state)
    with_base = lambda: self.base.propose(params, state, ctx, rng_B, k, sampling,
                                          window, forced=Forced(tokens, counts))
    return jax.lax.cond(jnp.all(counts > 0), lookup_only, with_base)

  def commit(self, params, state, verified, window):
    return self.base.commit(params, state, verified, window)

  def insert_row(self, state, row, one):
    return self.base.insert_row(state, row, one)

  def at_full_width(self):
    return HybridDraft(self.base.at_full_width(), self.ngram.at_full_width())
