"""Sampling rules (greedy, temperature, top-k, top-p) as small frozen dataclasses.

Speculative decoding applies the same rule to draft and target logits before
the acceptance test; otherwise the output would not follow the target's
tempered distribution.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature 0 is greedy; top_k 0 and top_p 1.0 switch those filters off."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")

  @property
  def is_greedy(self) -> bool:
    return self.temperature == 0.0

  def filtered_logits(self, logits_xV: jax.Array) -> jax.Array:
    """Tempered logits with filtered-out tokens at -inf (greedy: unchanged)."""
    logits = logits_xV.astype(jnp.float32)
    if self.is_greedy:
      return logits
    logits = logits / self.temperature
    if self.top_k:
      # top_k beyond the vocabulary keeps everything (lax.top_k would raise).
      kth = jax.lax.top_k(logits, min(self.top_k, logits.shape[-1]))[0][..., -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p < 1.0:
      sorted_desc = -jnp.sort(-logits, axis=-1)
      probs = jax.nn.softmax(sorted_desc, axis=-1)
      mass_before = jnp.cumsum(probs, axis=-1) - probs
      # The smallest logit still inside the nucleus; the top token always is.
      kept = jnp.where(mass_before < self.top_p, sorted_desc, jnp.inf)
      cutoff = jnp.min(kept, axis=-1, keepdims=True)
      logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits

  def probs(self, logits_xV: jax.Array) -> jax.Array:
    """The distribution tokens are drawn from (greedy: the plain softmax)."""
    return jax.nn.softmax(self.filtered_logits(logits_xV), axis=-1)

  def sample(self, rng: jax.Array, logits_xV: jax.Array) -> jax.Array:
    """One token per row of logits."""
    if self.is_greedy:
      return jnp.argmax(logits_xV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(
        rng, self.filtered_logits(logits_xV), axis=-1).astype(jnp.int32)


GREEDY = Sampling()
