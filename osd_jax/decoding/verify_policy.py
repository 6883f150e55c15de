"""How many drafted tokens each row verifies: only the positions that pay.

A verified position costs target time whether or not it is accepted, and
what it costs depends on the host and the batch: on an Intel Xeon with AMX
one more position at batch 1 costs about 0.05 of a plain step, on a 2-core
CPU at batch 8 about a third (serving/verify_costs.py measures it at
start-up). Engines answer with per-batch-size k tables (vLLM's
speculative_disable_by_batch_size); here each row chooses, each step.

Position i of a row's proposal is worth its chance of being accepted given
that a proposal reached it: the row's accepted / proposed counts at i so
far in its request, with one optimistic pseudo-count so that a new request
proposes. It pays where that exceeds its cost, `position_cost` of a plain
step, times the tokens the row emits a step (the time it takes would
otherwise yield tokens at that rate). A row verifies the leading positions
that pay, none at all where the first does not: that step is a plain
target step. Every EXPLORE_EVERY-th step of a request verifies whatever
was drafted, so a position once cut is measured again.

The limit reads only past steps, so cutting a proposal to it is choosing
its length before its draws: rejection sampling stays exact.
"""

import jax
import jax.numpy as jnp

EXPLORE_EVERY = 8


def limits(metrics, k: int, position_cost: float) -> jax.Array:
  """[B] the most drafted tokens each row verifies this step (0..k).

  `metrics` is the state's speculative.Metrics: per row, the counts of its
  request so far.
  """
  proposed = metrics.proposed_by_position[:, :k]
  accepted = metrics.accepted_by_position[:, :k]
  worth = (accepted + 1.0) / (proposed + 1.0)
  rate = (metrics.emitted + 1.0) / (metrics.target_calls + 1.0)
  pays = worth >= position_cost * rate[:, None]
  limit = jnp.cumprod(pays, axis=1).sum(axis=1).astype(jnp.int32)
  exploring = metrics.target_calls.astype(jnp.int32) % EXPLORE_EVERY == 0
  return jnp.where(exploring, k, limit)
