"""What learning keeps of each slot's request while it is served, by sequence position.

Verification already computes the teacher: the target's distribution
predicting every emitted token, and its hidden state at every verified
position. Each step writes those for the tokens it kept; when a request
finishes, its row becomes one buffer sample.
"""

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding.speculative import SpecState, StepResult
from osd_jax.distillation import teacher


@flax.struct.dataclass
class Records:
  """Per slot and sequence position; positions a request never reached are stale."""

  # Token at this position was a correction (draft rejected) or a bonus (all
  # k accepted): the positions the paper distils on.
  is_corrected: jax.Array  # [B, S] bool
  teacher_ids: jax.Array  # [B, S, teacher_k] int32: the target's top-k here
  teacher_probs: jax.Array  # [B, S, teacher_k] float32
  hidden: jax.Array  # [B, S, D] bfloat16, the target's feature; D 0: not kept

  @classmethod
  def empty(cls, batch_size: int, size: int, teacher_k: int,
            hidden_dim: int) -> "Records":
    return cls(jnp.zeros((batch_size, size), bool),
               jnp.zeros((batch_size, size, teacher_k), jnp.int32),
               jnp.zeros((batch_size, size, teacher_k), jnp.float32),
               jnp.zeros((batch_size, size, hidden_dim), jnp.bfloat16))

  @property
  def keeps_hidden(self) -> bool:
    return self.hidden.shape[-1] > 0

  def with_prompt(self, row, hidden_1xPxD: jax.Array) -> "Records":
    """A new request in `row`: its prompt's features (nothing else is read stale)."""
    if not self.keeps_hidden:
      return self
    put = hidden_1xPxD.astype(self.hidden.dtype)
    return self.replace(hidden=jax.lax.dynamic_update_slice(
        self.hidden, put, (row, 0, 0)))

  def record(self, result: StepResult, *, corrected_only: bool) -> "Records":
    """Writes what one step saw at the positions of the tokens it kept."""
    k1 = result.emitted.shape[1]
    corrected = jnp.arange(k1) == result.num_accepted[:, None]
    records = self.replace(is_corrected=_put(self.is_corrected, corrected,
                                             result.start, result.kept))
    if self.teacher_ids.shape[-1]:
      # The plain softmax, whatever the serving sampler (update.teacher_probs).
      k = self.teacher_ids.shape[-1]
      if corrected_only:  # at most one position per row goes to the buffer
        n = result.num_accepted
        logits = jnp.take_along_axis(result.target_logits, n[:, None, None], axis=1)
        ids, probs = teacher.top_k(jax.nn.softmax(logits, axis=-1), k)
        start, count = result.start + n, (n < result.kept).astype(jnp.int32)
      else:
        ids, probs = teacher.top_k(jax.nn.softmax(result.target_logits, axis=-1), k)
        start, count = result.start, result.kept
      records = records.replace(
          teacher_ids=_put(records.teacher_ids, ids, start, count),
          teacher_probs=_put(records.teacher_probs, probs, start, count))
    if self.keeps_hidden:
      # hidden[:, i] is the feature of the token at m + i = start - 1 + i.
      records = records.replace(hidden=_put(
          records.hidden, result.hidden.astype(self.hidden.dtype),
          result.start - 1, result.kept))
    return records


def _put(store_BxSx, values_BxCx, start_B, count_B):
  """store[b, start[b] + c] = values[b, c] for c < count[b]; the rest unchanged.

  Read-modify-write of a C-long window, so a start that XLA clamps near the
  end of a slot rewrites what was there.
  """
  c = values_BxCx.shape[1]

  def row(store, values, start, count):
    index = (start,) + (0,) * (store.ndim - 1)
    old = jax.lax.dynamic_slice(store, index, (c,) + store.shape[1:])
    keep = (jnp.arange(c) < count).reshape((c,) + (1,) * (store.ndim - 1))
    return jax.lax.dynamic_update_slice(
        store, jnp.where(keep, values.astype(store.dtype), old), index)

  return jax.vmap(row)(store_BxSx, values_BxCx, start_B, count_B)


def samples(records: Records, slots: SpecState, *, max_len: int, gen_len: int,
            corrected_only: bool):
  """Buffer.add's rows for every slot: (tokens, gen_start, weight, ids, probs, hidden).

  A sample is the prompt and output (`max_len` positions) with a weight and
  a teacher per generated token. Positions past a row's output weigh 0.
  """
  gen = slots.prompt_lens[:, None] + jnp.arange(gen_len)  # sequence positions
  index = jnp.minimum(gen, records.is_corrected.shape[1] - 1)
  take = lambda x: jnp.take_along_axis(
      x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)
  weight = jnp.arange(gen_len) < slots.num_generated[:, None]
  if corrected_only:
    weight &= take(records.is_corrected)
  hidden = records.hidden[:, :max_len] if records.keeps_hidden else None
  return (slots.tokens[:, :max_len], slots.prompt_lens - 1,
          weight.astype(jnp.float32), take(records.teacher_ids),
          take(records.teacher_probs), hidden)
