"""A learned draft that proposes the n-gram continuation whenever the context has a match.

Code and SQL answers copy names from their prompts; where lookup finds
nothing the learned draft proposes instead. The base drafter is fed the
chosen tokens, so its proposal is consistent with what was proposed.
A lookup with a history keeps its ring beside the base's state.
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

  def _split(self, state):
    """(the base's state, the lookup's): the lookup has one only with a history."""
    return state if self.ngram.history else (state, ())

  def _join(self, base, lookup):
    return (base, lookup) if self.ngram.history else base

  def init_state(self, batch_size, cache_size):
    return self._join(self.base.init_state(batch_size, cache_size),
                      self.ngram.init_state(batch_size, cache_size))

  def prefill(self, params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD=None):
    base, lookup = self._split(state)
    return self._join(self.base.prefill(params, base, prompts_BxP, prompt_lens_B,
                                        hidden_BxPxD), lookup)

  def propose(self, params, state, ctx: Context, rng_B, k, sampling, window,
              forced=None):
    """When lookup covers every row the base draft is skipped: its state
    then lags the committed tokens, and its next proposal catches up."""
    base, lookup = self._split(state)
    tokens, counts = self.ngram.lookup(ctx, k, lookup)
    lookup_only = lambda: (Proposal(tokens, one_hot_logits(tokens, self.ngram.vocab_size),
                                    counts), base)
    with_base = lambda: self.base.propose(params, base, ctx, rng_B, k, sampling,
                                          window, forced=Forced(tokens, counts))
    proposal, base = jax.lax.cond(jnp.all(counts > 0), lookup_only, with_base)
    return proposal, self._join(base, lookup)

  def commit(self, params, state, verified, window):
    base, lookup = self._split(state)
    return self._join(self.base.commit(params, base, verified, window), lookup)

  def insert_row(self, state, row, one, leaving=None):
    (base, lookup), (one_base, one_lookup) = self._split(state), self._split(one)
    return self._join(self.base.insert_row(base, row, one_base, leaving),
                      self.ngram.insert_row(lookup, row, one_lookup, leaving))

  def at_full_width(self):
    return HybridDraft(self.base.at_full_width(), self.ngram.at_full_width())
