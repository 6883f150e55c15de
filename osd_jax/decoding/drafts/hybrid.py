"""A learned draft that proposes the n-gram continuation whenever the context has a match.

Code and SQL answers copy names from their prompts; where lookup finds
nothing the learned draft proposes instead. Ungated, the base drafter is
fed the chosen tokens of every row, so its state keeps in step. A lookup
with a history keeps its ring beside the base's state, and a gated hybrid
(`draft_cost` > 0) its gate: the base then serves only the rows the gate
lets it, while its accepted tokens pay for its pass, and leaves the others
idle to catch up later (drafts/gate.py).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts.base import Context, Forced, Proposal, one_hot_logits
from osd_jax.decoding.drafts.gate import Gate
from osd_jax.decoding.drafts.ngram import NGramDraft


@dataclasses.dataclass(frozen=True)
class HybridDraft:
  """n-gram rows where lookup matches, `base` rows elsewhere (per row, per step)."""

  base: Any  # a Drafter with parameters
  ngram: NGramDraft
  # The base's pass as a fraction of a target step; 0 runs it wherever
  # lookup misses in some row, whatever it yields.
  draft_cost: float = 0.0
  # A gated hybrid also explores every n-th lookup-miss step of a request
  # (Gate.serves); 0: only a request's first steps.
  explore_every: int = 0

  def __post_init__(self):
    if not 0.0 <= self.draft_cost < 1.0:
      raise ValueError(f"The hybrid's draft cost is a fraction of a target step in"
                       f" [0, 1), got {self.draft_cost}.")
    if self.explore_every < 0:
      raise ValueError(f"The gate explores every n-th lookup miss, n >= 0 (0:"
                       f" off), got {self.explore_every}.")

  @property
  def needs_hidden(self) -> bool:
    return self.base.needs_hidden

  @property
  def commit_reads(self) -> bool:
    return self.base.commit_reads

  def prepare(self, params, target_params=None):
    return self.base.prepare(params, target_params)

  def base_state(self, state):
    """The base draft's own part of this drafter's state."""
    return self._split(state)[0]

  def _split(self, state):
    """(the base's state, the lookup's, the gate): the lookup has one only
    with a history, the gate is None unless gated."""
    if not (self.ngram.history or self.draft_cost):
      return state, (), None
    base, *rest = state
    lookup = rest.pop(0) if self.ngram.history else ()
    return base, lookup, rest.pop(0) if self.draft_cost else None

  def _join(self, base, lookup, gate):
    extra = (((lookup,) if self.ngram.history else ())
             + ((gate,) if self.draft_cost else ()))
    return (base,) + extra if extra else base

  def init_state(self, batch_size, cache_size):
    return self._join(self.base.init_state(batch_size, cache_size),
                      self.ngram.init_state(batch_size, cache_size),
                      Gate.empty(batch_size))

  def prefill(self, params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD=None):
    base, lookup, gate = self._split(state)
    return self._join(self.base.prefill(params, base, prompts_BxP, prompt_lens_B,
                                        hidden_BxPxD), lookup,
                      None if gate is None else gate.started())

  def propose(self, params, state, ctx: Context, rng_B, k, sampling, window,
              forced=None):
    """When the base does not run (lookup covers every row, or the gate is
    closed) its state lags the committed tokens; its next proposal catches up."""
    base, lookup, gate = self._split(state)
    tokens, counts = self.ngram.lookup(ctx, k, lookup)
    missed = counts == 0
    # A row that may propose nothing this step needs no draft pass.
    wanted = missed if ctx.limit is None else missed & (ctx.limit > 0)
    if gate is None:  # the base serves every row lookup missed, and is fed the rest
      forced = Forced(tokens, counts)
      run = jnp.any(wanted)
    else:  # only the rows the gate lets it serve; the others stay idle
      serves = gate.serves(wanted, self.draft_cost, self.explore_every)
      forced = Forced(tokens, counts, idle=~serves)
      run = jnp.any(serves)
    lookup_only = lambda: (Proposal(tokens, one_hot_logits(tokens, self.ngram.vocab_size),
                                    counts), base)
    with_base = lambda: self.base.propose(params, base, ctx, rng_B, k, sampling,
                                          window, forced=forced)
    proposal, base = jax.lax.cond(run, with_base, lookup_only)
    if gate is not None:
      gate = gate.proposed(serves, missed, ctx.within_limit(proposal.num_proposed))
    return proposal, self._join(base, lookup, gate)

  def lookup_missed(self, state) -> jax.Array:
    """[B] rows whose latest proposal lookup missed (a gated hybrid's)."""
    return self._split(state)[2].missed

  def with_estimate(self, state, acceptance: jax.Array, k: int):
    """The state after an update whose draft accepts `acceptance` [] of a
    token (NaN: unknown): the gate expects sum_i acceptance^i tokens of a
    k-token proposal (rows gated otherwise unchanged)."""
    base, lookup, gate = self._split(state)
    if gate is None:
      return state
    tokens = jnp.sum(acceptance ** jnp.arange(1, k + 1))
    return self._join(base, lookup, gate.reestimated(tokens))

  def commit(self, params, state, verified, window):
    base, lookup, gate = self._split(state)
    if gate is not None:
      gate = gate.after(verified.kept, True if verified.own is None else verified.own)
    return self._join(self.base.commit(params, base, verified, window), lookup, gate)

  def insert_row(self, state, row, one, leaving=None):
    (base, lookup, gate), (one_base, one_lookup, _) = self._split(state), self._split(one)
    return self._join(self.base.insert_row(base, row, one_base, leaving),
                      self.ngram.insert_row(lookup, row, one_lookup, leaving),
                      None if gate is None else gate.insert_row(row))

  def at_full_width(self):
    return dataclasses.replace(self, base=self.base.at_full_width(),
                               ngram=self.ngram.at_full_width())
