"""Teacher distributions: kept top-k from verification, rebuilt dense for the loss."""

import jax
import jax.numpy as jnp


def top_k(p_xV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k most likely tokens and their probabilities ([..., k] each)."""
  probs, ids = jax.lax.top_k(p_xV, k)
  return ids.astype(jnp.int32), probs


def dense(ids_xK: jax.Array, probs_xK: jax.Array, vocab_size: int,
          support: tuple[int, ...] | None = None) -> jax.Array:
  """A full distribution: the kept probabilities, the rest spread evenly.

  Spreading the missing mass keeps p > 0 everywhere, so reverse KL and JSD
  stay finite; with k of a few dozen the tail is usually under 1 %. With a
  `support` (a restricted draft head) the same distribution is built
  directly on those tokens and renormalised, as on_support(dense(...))
  would give, without the full-vocabulary array.
  """
  k = ids_xK.shape[-1]
  tail = jnp.maximum(1.0 - probs_xK.sum(-1, keepdims=True), 0.0)
  fill = tail / max(vocab_size - k, 1)
  width = vocab_size if support is None else len(support)
  if support is None:
    column = ids_xK
  else:  # where each kept id sits on the support; off-support ids are dropped
    table = jnp.full((vocab_size,), width, jnp.int32).at[
        jnp.asarray(support)].set(jnp.arange(width, dtype=jnp.int32))
    column = table[ids_xK]
  batch_shape = probs_xK.shape[:-1]
  flat_p = jnp.broadcast_to(fill, batch_shape + (width,)).reshape(-1, width)
  rows = jnp.arange(flat_p.shape[0])[:, None]
  flat_p = flat_p.at[rows, column.reshape(-1, k)].set(probs_xK.reshape(-1, k),
                                                      mode="drop")
  p = flat_p.reshape(batch_shape + (width,))
  if support is not None:
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
  return p


def on_support(p_xV: jax.Array, support_ids: tuple[int, ...] | None) -> jax.Array:
  """p restricted to the draft head's tokens and renormalised (identity if None).

  A restricted draft puts zero mass elsewhere, so matching p conditioned on
  its support is the best it can do, and keeps every divergence finite.
  """
  if support_ids is None or p_xV.shape[-1] == len(support_ids):
    return p_xV  # the full vocabulary, or already on the support (dense(support=))
  p = p_xV[..., jnp.asarray(support_ids)]
  return p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
