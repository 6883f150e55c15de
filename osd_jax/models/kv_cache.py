"""Explicit KV cache: a pytree passed in and returned; rolling back moves `lengths`."""

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer plus how many positions each row holds."""

  k: jax.Array  # [layers, batch, cache_size, kv_heads, head_dim]
  v: jax.Array  # [layers, batch, cache_size, kv_heads, head_dim]
  lengths: jax.Array  # [batch] int32: positions < lengths[b] are valid

  @classmethod
  def empty(cls, *, num_layers: int, batch_size: int, cache_size: int,
            num_kv_heads: int, head_dim: int, dtype) -> "KVCache":
    shape = (num_layers, batch_size, cache_size, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch_size,), jnp.int32))

  @property
  def size(self) -> int:
    """Positions per sequence."""
    return self.k.shape[2]

  def write(self, new_k_LxBxTxHxD: jax.Array,
            new_v_LxBxTxHxD: jax.Array) -> "KVCache":
    """Stores T new positions per row at that row's length (lengths unchanged).

    The caller must keep lengths + T <= size: dynamic_update_slice clamps an
    out-of-range start silently, which would overwrite valid positions.
    """
    def write_row(cache_LxSxHxD, new_LxTxHxD, start):
      return jax.lax.dynamic_update_slice(
          cache_LxSxHxD, new_LxTxHxD.astype(cache_LxSxHxD.dtype),
          (0, start, 0, 0))

    write_rows = jax.vmap(write_row, in_axes=(1, 1, 0), out_axes=1)
    return self.replace(k=write_rows(self.k, new_k_LxBxTxHxD, self.lengths),
                        v=write_rows(self.v, new_v_LxBxTxHxD, self.lengths))

  def with_lengths(self, lengths_B: jax.Array) -> "KVCache":
    """Same storage, new valid lengths: this is how rejected tokens roll back."""
    return self.replace(lengths=lengths_B.astype(jnp.int32))
