"""A ragged batch packed into a fixed number of token slots.

Verification scores each row's last token and its proposal, and proposals
differ in length from row to row. Padded to the longest, a batch of 8 rows
with k = 2 computes 24 positions; packed, only the proposed ones. Where the
weights' matmuls are compute-bound (a CPU at batch 8) they cost per token
computed, so packing pays for what was drafted, not for the batch's longest
proposal: vLLM's flattened token batch, with a static size under jit.
"""

import math

import flax
import jax
import jax.numpy as jnp

# A packed pass runs at the smallest of these multiples of the batch that
# holds its tokens (one compiled branch each, up to k + 1).
_SIZE_FACTORS = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16)


def sizes(batch: int, width: int) -> tuple[int, ...]:
  """Token slots a packed pass over `batch` rows of `width` positions may
  take: multiples of the batch from 1 to `width`, at most batch * width."""
  full = batch * width
  return tuple(sorted({min(full, math.ceil(batch * f)) for f in _SIZE_FACTORS
                       if f <= width} | {full}))


@flax.struct.dataclass
class Packing:
  """The first counts[b] positions of each row b of a [B, T] batch, in row
  order, in N slots; slots past the last count are unused."""

  index: jax.Array  # [N] flat position b * T + t, or B * T for an unused slot
  batch: int = flax.struct.field(pytree_node=False)
  width: int = flax.struct.field(pytree_node=False)

  @classmethod
  def of_counts(cls, counts_B: jax.Array, width: int, size: int) -> "Packing":
    """Rows' counts must add up to at most `size` (the rest would be lost)."""
    batch = counts_B.shape[0]
    ends = jnp.cumsum(counts_B)
    slot = jnp.arange(size)
    row = jnp.minimum(jnp.searchsorted(ends, slot, side="right"), batch - 1)
    column = slot - (ends - counts_B)[row]
    used = slot < ends[-1]
    return cls(jnp.where(used, row * width + column, batch * width), batch, width)

  def gather(self, x_BxT: jax.Array) -> jax.Array:
    """[N, ...] from [B, T, ...]; an unused slot reads the last position."""
    flat = x_BxT.reshape((self.batch * self.width,) + x_BxT.shape[2:])
    return flat[jnp.minimum(self.index, self.batch * self.width - 1)]

  def scatter(self, x_N: jax.Array) -> jax.Array:
    """[B, T, ...] from [N, ...]: zeros where no slot was computed."""
    rest = x_N.shape[1:]
    flat = jnp.zeros((self.batch * self.width,) + rest, x_N.dtype)
    flat = flat.at[self.index].set(x_N, mode="drop")
    return flat.reshape((self.batch, self.width) + rest)
