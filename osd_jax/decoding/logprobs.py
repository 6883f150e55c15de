"""The target's log-probabilities of the emitted tokens, kept beside `tokens`.

Verification already computes the target's logits at every position a step
emits (StepResult.target_logits: the token at position j of the step, at
sequence position m + 1 + j, was drawn from or checked against
target_logits[:, j]), so the log-probs of whatever was drafted, accepted or
corrected cost one log_softmax and one top_k over them, and no other pass.

They are vLLM's default `logprobs_mode=raw_logprobs`: log_softmax of the
target's raw logits, before temperature, top-k or top-p. A row that did not
ask (`wanted` False) is not written; a step where no row asked computes
nothing (a lax.cond). A state without a LogProbs (None) is the feature off:
no arrays, no compute, and the programs of the main job are unchanged.
"""

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding.row_writes import write_rows


@flax.struct.dataclass
class LogProbs:
  """Per slot and sequence position: the emitted token's log-prob and the
  target's top N there (only generated positions of rows that asked hold
  anything; the rest is stale or zero)."""

  wanted: jax.Array  # [B] bool: the row's request asked for log-probs
  token: jax.Array  # [B, S] float32: log p(c_j | c_<j) of the token c_j
  top_ids: jax.Array  # [B, S, N] int32: the target's N likeliest tokens at j
  top: jax.Array  # [B, S, N] float32: their log-probs, descending

  @classmethod
  def empty(cls, batch_size: int, cache_size: int, top_n: int) -> "LogProbs":
    b, s = batch_size, cache_size
    return cls(jnp.zeros((b,), bool), jnp.zeros((b, s), jnp.float32),
               jnp.zeros((b, s, top_n), jnp.int32),
               jnp.zeros((b, s, top_n), jnp.float32))

  @property
  def top_n(self) -> int:
    return self.top_ids.shape[-1]

  def with_row(self, row: jax.Array, wanted: jax.Array) -> "LogProbs":
    """A new request in `row`: whether it asks. Its positions are written as
    it emits them, so nothing older needs clearing."""
    return self.replace(wanted=self.wanted.at[row].set(wanted))

  def record(self, target_logits_BxTxV: jax.Array, emitted_BxT: jax.Array,
             kept_B: jax.Array, starts_B: jax.Array) -> "LogProbs":
    """Writes the log-probs of the first kept[b] emitted tokens of each row
    that asked at positions starts[b]..; emitted token j was judged by
    target_logits[:, j] (positions < kept are always real, even when
    verification was trimmed or packed)."""
    counts = jnp.where(self.wanted, kept_B, 0)

    def write(lp: "LogProbs") -> "LogProbs":
      logp = jax.nn.log_softmax(target_logits_BxTxV.astype(jnp.float32), axis=-1)
      token = jnp.take_along_axis(logp, emitted_BxT[..., None], axis=-1)[..., 0]
      top, top_ids = jax.lax.top_k(logp, lp.top_n)
      return lp.replace(token=write_rows(lp.token, token, counts, starts_B),
                        top_ids=write_rows(lp.top_ids, top_ids, counts, starts_B),
                        top=write_rows(lp.top, top, counts, starts_B))

    return jax.lax.cond(jnp.any(counts > 0), write, lambda lp: lp, self)
