"""One draft per category: every draft runs on every slot, each slot keeps its own's.

Slots of different categories share one compiled call. Each draft keeps a
state for every row and proposes for every row; a row takes the proposal
of the draft its request is routed to (`Context.route`). A step therefore
costs `num` draft steps: the price of sharing slots across categories
without a per-row gather of weights (which would read them once per row).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts.base import Context


def _select(route_B: jax.Array, trees: list):
  """Per row b, the leaf of trees[route[b]] (leaves have a leading row axis)."""
  def pick(*leaves):
    out = leaves[0]
    for d, leaf in enumerate(leaves[1:], start=1):
      mask = (route_B == d).reshape((-1,) + (1,) * (leaf.ndim - 1))
      out = jnp.where(mask, leaf, out)
    return out
  return jax.tree.map(pick, *trees)


@dataclasses.dataclass(frozen=True)
class MultiDraft:
  """`num` copies of a drafter; parameters stacked on a leading draft axis."""

  base: Any
  num: int = 1

  @property
  def needs_hidden(self) -> bool:
    return self.base.needs_hidden

  @property
  def commit_reads(self) -> bool:
    return self.base.commit_reads

  def _each(self, params) -> list:
    return [jax.tree.map(lambda x, d=d: x[d], params) for d in range(self.num)]

  def prepare(self, params, target_params=None):
    return tuple(self.base.prepare(p, target_params) for p in self._each(params))

  def init_state(self, batch_size, cache_size):
    return tuple(self.base.init_state(batch_size, cache_size)
                 for _ in range(self.num))

  def prefill(self, params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD=None):
    return tuple(self.base.prefill(p, s, prompts_BxP, prompt_lens_B, hidden_BxPxD)
                 for p, s in zip(params, state))

  def propose(self, params, state, ctx: Context, rng_B, k, sampling, window,
              forced=None):
    outs = [self.base.propose(p, s, ctx, rng_B, k, sampling, window, forced)
            for p, s in zip(params, state)]
    proposal = _select(ctx.route, [o[0] for o in outs])
    return proposal, tuple(o[1] for o in outs)

  def commit(self, params, state, verified, window):
    """Each copy commits every row; rows routed to another copy were fed
    that copy's draws, not the proposal kept."""
    route = verified.route
    return tuple(self.base.commit(p, s, verified if self.num == 1 else
                                  verified.replace(own=route == d), window)
                 for d, (p, s) in enumerate(zip(params, state)))

  def insert_row(self, state, row, one, leaving=None):
    return tuple(self.base.insert_row(s, row, o, leaving) for s, o in zip(state, one))

  def at_full_width(self):
    return dataclasses.replace(self, base=self.base.at_full_width())
