"""Explicit KV cache: a pytree passed in and returned; rolling back moves `lengths`.

Each layer owns one array laid out [batch * kv_heads, cache_size, head_dim].
On CPU this is what makes decoding fast: a separate buffer per layer is
updated in place (one stacked array is sliced and copied per layer), and the
flat leading axis has no size-1 dimension at batch 1 for XLA to squeeze away,
which would also turn the in-place write into a copy of the cache.
"""

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer plus how many positions each row holds."""

  k: tuple[jax.Array, ...]  # per layer [batch * kv_heads, cache_size, head_dim]
  v: tuple[jax.Array, ...]  # per layer [batch * kv_heads, cache_size, head_dim]
  lengths: jax.Array  # [batch] int32: positions < lengths[b] are valid

  @classmethod
  def empty(cls, *, num_layers: int, batch_size: int, cache_size: int,
            num_kv_heads: int, head_dim: int, dtype) -> "KVCache":
    shape = (batch_size * num_kv_heads, cache_size, head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return cls(k=zeros(), v=zeros(), lengths=jnp.zeros((batch_size,), jnp.int32))

  @property
  def size(self) -> int:
    """Positions per sequence."""
    return self.k[0].shape[1]

  @property
  def batch_size(self) -> int:
    return self.lengths.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k[0].shape[0] // self.batch_size

  def with_lengths(self, lengths_B: jax.Array) -> "KVCache":
    """Same storage, new valid lengths: this is how rejected tokens roll back."""
    return self.replace(lengths=lengths_B.astype(jnp.int32))

  def insert_row(self, row: jax.Array, one: "KVCache") -> "KVCache":
    """Row `row` takes the contents of a one-row cache (the slot engine's insert).

    `one` may hold fewer positions (a prompt bucket); the rest of the row is
    zeroed. Attention gives those positions weight 0, but 0 times a stale
    NaN (a previous request's) would still be NaN.
    """
    heads = self.num_kv_heads
    pad = lambda small: jnp.pad(small, ((0, 0), (0, self.size - small.shape[1]),
                                        (0, 0)))
    put = lambda big, small: jax.lax.dynamic_update_slice(
        big, pad(small.astype(big.dtype)), (row * heads, 0, 0))
    return self.replace(
        k=tuple(map(put, self.k, one.k)), v=tuple(map(put, self.v, one.v)),
        lengths=self.lengths.at[row].set(one.lengths[0]))

  def first_rows(self, n: int) -> "KVCache":
    """Rows 0..n-1 (static n): what a call over the first n slots computes on."""
    rows = n * self.num_kv_heads
    return KVCache(k=tuple(x[:rows] for x in self.k), v=tuple(x[:rows] for x in self.v),
                   lengths=self.lengths[:n])

  def with_first_rows(self, part: "KVCache") -> "KVCache":
    """This cache with rows 0..n-1 replaced by `part` (in place when donated)."""
    put = lambda big, small: jax.lax.dynamic_update_slice(big, small, (0, 0, 0))
    return KVCache(k=tuple(map(put, self.k, part.k)), v=tuple(map(put, self.v, part.v)),
                   lengths=self.lengths.at[:part.batch_size].set(part.lengths))


# Up to this many rows, one dynamic_update_slice each (fastest on CPU, measured
# at batch 8); beyond, a single scatter.
_MAX_UNROLLED_ROWS = 32


def write(store_NxSxD: jax.Array, new_BxTxHxD: jax.Array,
          starts_B: jax.Array | None) -> jax.Array:
  """One layer's store with row b's T new positions written from starts[b].

  A dynamic_update_slice per row: O(new tokens), in place when the cache is
  donated. XLA clamps an out-of-range start, so callers keep start + T <= size.
  `starts_B` None means every row starts at 0 (a prefill): one write for all.
  """
  b, t, heads, d = new_BxTxHxD.shape
  new = new_BxTxHxD.astype(store_NxSxD.dtype).transpose(0, 2, 1, 3)
  if starts_B is None:
    flat = new.reshape(b * heads, t, d)
    if t == store_NxSxD.shape[1]:
      return flat
    return jax.lax.dynamic_update_slice(store_NxSxD, flat, (0, 0, 0))
  if b > _MAX_UNROLLED_ROWS:  # one scatter: a loop this long compiles slowly
    rows = jnp.arange(b * heads)[:, None]
    positions = jnp.repeat(starts_B, heads)[:, None] + jnp.arange(t)[None, :]
    return store_NxSxD.at[rows, positions].set(new.reshape(b * heads, t, d),
                                               mode="drop")
  for row in range(b):
    store_NxSxD = jax.lax.dynamic_update_slice(
        store_NxSxD, new[row], (row * heads, starts_B[row], 0))
  return store_NxSxD
