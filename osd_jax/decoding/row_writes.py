"""Each row's new entries written at its own position of a per-row sequence."""

import jax
import jax.numpy as jnp


def write_rows(rows_BxSx, new_BxCx, counts_B, starts_B):
  """rows[b, starts[b] + c] = new[b, c] for c < counts[b]; nothing else changes.

  Any trailing axes ride along. The rest of the written window is read back
  first, so a finished row whose start XLA clamps (near the end of its slot)
  keeps what it holds.
  """
  c = new_BxCx.shape[1]

  def put(row, new, count, start):
    old = jax.lax.dynamic_slice_in_dim(row, start, c, axis=0)
    is_new = (jnp.arange(c) < count).reshape((c,) + (1,) * (row.ndim - 1))
    new = jnp.where(is_new, new.astype(row.dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(row, new, start, axis=0)

  return jax.vmap(put)(rows_BxSx, new_BxCx, counts_B, starts_B)
