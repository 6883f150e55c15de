"""Per-sequence output buffer with EOS and length stops, shared by all decoders."""

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Output:
  """Generated tokens of a batch; finished rows stop changing."""

  tokens: jax.Array  # [batch, max_new_tokens + slack] int32
  lengths: jax.Array  # [batch] int32, tokens emitted so far (EOS included)
  done: jax.Array  # [batch] bool
  max_new_tokens: int = flax.struct.field(pytree_node=False)

  @classmethod
  def empty(cls, batch_size: int, max_new_tokens: int, slack: int) -> "Output":
    """`slack` >= the most tokens one append may write, so writes never clamp."""
    return cls(tokens=jnp.zeros((batch_size, max_new_tokens + slack), jnp.int32),
               lengths=jnp.zeros((batch_size,), jnp.int32),
               done=jnp.zeros((batch_size,), bool),
               max_new_tokens=max_new_tokens)

  def append(self, candidates_BxC: jax.Array, counts_B: jax.Array,
             eos_id: int) -> tuple["Output", jax.Array]:
    """Appends the first counts[b] candidates, cut at EOS and at the budget.

    Returns the new buffer and how many tokens each row actually kept.
    """
    c = candidates_BxC.shape[1]
    budget = self.max_new_tokens - self.lengths
    kept = jnp.where(self.done, 0, jnp.minimum(counts_B, budget))
    is_eos_BxC = (candidates_BxC == eos_id) & (jnp.arange(c) < kept[:, None])
    hit_eos = is_eos_BxC.any(axis=1)
    kept = jnp.where(hit_eos, jnp.argmax(is_eos_BxC, axis=1) + 1, kept)

    def write_row(row, new, start):
      return jax.lax.dynamic_update_slice(row, new, (start,))

    tokens = jax.vmap(write_row)(self.tokens, candidates_BxC.astype(jnp.int32),
                                 self.lengths)
    # Rows that keep nothing must not change: restore what was overwritten.
    tokens = jnp.where(kept[:, None] > 0, tokens, self.tokens)
    lengths = self.lengths + kept
    done = self.done | hit_eos | (lengths >= self.max_new_tokens)
    return self.replace(tokens=tokens, lengths=lengths, done=done), kept
