"""What learning keeps of each slot's request while it is served, by sequence position.

Verification already computes the teacher: the target's distribution
predicting every emitted token, and its hidden state at every verified
position. Each step writes those for the tokens it kept; when a request
finishes, its row becomes one buffer sample.

Only requests that keep their sample write anything. Keeping costs the
target's top-k at every verified position, each step (4-5 ms of a 105 ms
call at one slot on a 2-core CPU), and buffering costs a learn program per
finished request (about 9 ms): where no update can follow, the host admits
requests that keep nothing (LearningBudget.worth_keeping), and their calls
pay for neither.
"""

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding.speculative import SpecState, StepResult
from osd_jax.distillation import teacher
from osd_jax.when import when


@flax.struct.dataclass
class Records:
  """Per slot and sequence position; positions a request never reached are stale."""

  # Token at this position was a correction (draft rejected) or a bonus (all
  # k accepted): the positions the paper distils on.
  is_corrected: jax.Array  # [B, S] bool
  teacher_ids: jax.Array  # [B, S, teacher_k] int32: the target's top-k here
  teacher_probs: jax.Array  # [B, S, teacher_k] float32
  hidden: jax.Array  # [B, S, D] bfloat16, the target's feature; D 0: not kept
  # The token was emitted at a step where the hybrid's lookup proposed
  # nothing: where the learned draft is called on (loss_weighting
  # lookup_missed). All False for other drafts.
  lookup_missed: jax.Array  # [B, S] bool
  uid: jax.Array  # [B] uint32, the slot's request (Buffer.uid)
  keeps: jax.Array  # [B] bool: the slot's request becomes a sample

  @classmethod
  def empty(cls, batch_size: int, size: int, teacher_k: int,
            hidden_dim: int) -> "Records":
    return cls(jnp.zeros((batch_size, size), bool),
               jnp.zeros((batch_size, size, teacher_k), jnp.int32),
               jnp.zeros((batch_size, size, teacher_k), jnp.float32),
               jnp.zeros((batch_size, size, hidden_dim), jnp.bfloat16),
               jnp.zeros((batch_size, size), bool),
               jnp.zeros((batch_size,), jnp.uint32), jnp.zeros((batch_size,), bool))

  @property
  def keeps_hidden(self) -> bool:
    return self.hidden.shape[-1] > 0

  def with_prompt(self, row, hidden_1xPxD: jax.Array, key: jax.Array,
                  keep: jax.Array) -> "Records":
    """A new request in `row`: its id from its sampling `key`, whether it
    `keep`s its sample, its prompt's features (nothing else is read stale)."""
    records = self.replace(uid=self.uid.at[row].set(
        jax.random.bits(key, dtype=jnp.uint32)), keeps=self.keeps.at[row].set(keep))
    if not self.keeps_hidden:
      return records
    put = hidden_1xPxD.astype(self.hidden.dtype)
    return records.replace(hidden=jax.lax.dynamic_update_slice(
        self.hidden, put, (row, 0, 0)))

  def record(self, result: StepResult, *, corrected_only: bool,
             lookup_missed: jax.Array | None = None) -> "Records":
    """Writes what one step saw at the positions of the tokens it kept;
    `lookup_missed` [B]: the hybrid's lookup proposed nothing for the row.
    A step in which no row keeps its sample writes nothing."""
    return when(self.keeps.any(), lambda records: records._write(
        result, corrected_only, lookup_missed), self)

  def _write(self, result: StepResult, corrected_only: bool,
             lookup_missed: jax.Array | None) -> "Records":
    k1 = result.emitted.shape[1]
    corrected = jnp.arange(k1) == result.num_accepted[:, None]
    records = self.replace(is_corrected=_put(self.is_corrected, corrected,
                                             result.start, result.kept))
    if lookup_missed is not None:
      missed = jnp.broadcast_to(lookup_missed[:, None], corrected.shape)
      records = records.replace(lookup_missed=_put(
          records.lookup_missed, missed, result.start, result.kept))
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


WEIGHTINGS = ("corrected", "all", "lookup_missed")


def samples(records: Records, slots: SpecState, *, max_len: int, gen_len: int,
            weighting: str):
  """Buffer.add's rows for every slot: (tokens, gen_start, weight, ids, probs, hidden).

  A sample is the prompt and output (`max_len` positions) with a weight and
  a teacher per generated token. Positions past a row's output weigh 0;
  `weighting` (WEIGHTINGS) picks which others weigh 1.
  """
  gen = slots.prompt_lens[:, None] + jnp.arange(gen_len)  # sequence positions
  index = jnp.minimum(gen, records.is_corrected.shape[1] - 1)
  take = lambda x: jnp.take_along_axis(
      x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)
  weight = jnp.arange(gen_len) < slots.num_generated[:, None]
  if weighting == "corrected":
    weight &= take(records.is_corrected)
  elif weighting == "lookup_missed":
    weight &= take(records.lookup_missed)
  hidden = records.hidden[:, :max_len] if records.keeps_hidden else None
  return (slots.tokens[:, :max_len], slots.prompt_lens - 1,
          weight.astype(jnp.float32), take(records.teacher_ids),
          take(records.teacher_probs), hidden)
