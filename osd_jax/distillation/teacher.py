"""Teacher distributions: kept top-k from verification, rebuilt dense for the loss."""

import jax
import jax.numpy as jnp


# top_k's two stages: the vocabulary is read in blocks of this many tokens.
_BLOCK = 128


def top_k(p_xV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k most likely tokens and their probabilities ([..., k] each).

  Serving keeps the teacher's top-k at every verified position, and XLA's
  CPU top-k over a 49k vocabulary costs about as much as the softmax before
  it five times over. So it runs in two exact stages: the k largest entries
  lie in the k blocks with the largest maxima (any entry outside them has k
  block maxima at least as large), so top-k of the block maxima picks the
  blocks, and top-k over those k blocks' entries gives the answer. Equal
  values may come in another order than lax.top_k's.
  """
  v = p_xV.shape[-1]
  if v < 4 * k * _BLOCK:  # small vocabularies: one stage is cheap enough
    probs, ids = jax.lax.top_k(p_xV, k)
    return ids.astype(jnp.int32), probs
  blocks = -(-v // _BLOCK)
  padded = jnp.pad(p_xV, [(0, 0)] * (p_xV.ndim - 1) + [(0, blocks * _BLOCK - v)],
                   constant_values=-jnp.inf)
  by_block = padded.reshape(p_xV.shape[:-1] + (blocks, _BLOCK))
  _, best = jax.lax.top_k(by_block.max(axis=-1), k)
  candidates = jnp.take_along_axis(by_block, best[..., None], axis=-2)
  probs, at = jax.lax.top_k(candidates.reshape(p_xV.shape[:-1] + (k * _BLOCK,)), k)
  ids = jnp.take_along_axis(best, at // _BLOCK, axis=-1) * _BLOCK + at % _BLOCK
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
