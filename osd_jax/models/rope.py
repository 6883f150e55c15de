"""Rotary position embedding: the frequencies (with long-context scaling) and
their application in the Hugging Face rotate-half layout."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# Scalings that change the frequencies and nothing else (their attention
# factor is 1); any other rope_type (dynamic, yarn, longrope, ...) also
# rescales attention or depends on the sequence length, and is refused.
KINDS = ("linear", "llama3", "divisors")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How the rotary frequencies are stretched for a longer context.

  `linear` divides every frequency by `factor`; `llama3` divides the low
  frequencies by `factor`, keeps the high ones and blends in between (the
  formula of transformers' `_compute_llama3_parameters`); `divisors` gives
  one divisor per frequency, as llama.cpp stores them (`rope_freqs`).
  """

  kind: str
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_positions: int = 8192
  divisors: tuple[float, ...] | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"RoPE scaling {self.kind!r} is not one of {KINDS}.")
    if (self.kind == "divisors") != (self.divisors is not None):
      raise ValueError("RoPE scaling 'divisors' (and only it) lists its divisors.")

  def to_hf(self) -> dict | None:
    """transformers' rope_parameters entries (None: not expressible there)."""
    if self.kind == "linear":
      return {"rope_type": "linear", "factor": self.factor}
    if self.kind == "llama3":
      return {"rope_type": "llama3", "factor": self.factor,
              "low_freq_factor": self.low_freq_factor,
              "high_freq_factor": self.high_freq_factor,
              "original_max_position_embeddings": self.original_max_positions}
    return None


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: RopeScaling | None = None) -> np.ndarray:
  """[head_dim / 2] float32 inverse frequencies, computed on the host as
  transformers computes them (float32 powers of theta), then scaled."""
  inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32)
                              / np.float32(head_dim))).astype(np.float32)
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
  if scaling.kind == "divisors":
    if len(scaling.divisors) != inv_freq.size:
      raise ValueError(f"RoPE has {inv_freq.size} frequencies but"
                       f" {len(scaling.divisors)} divisors.")
    return (inv_freq / np.asarray(scaling.divisors, np.float32)).astype(np.float32)
  factor = np.float32(scaling.factor)
  low, high = scaling.low_freq_factor, scaling.high_freq_factor
  old_context = scaling.original_max_positions
  wavelen = np.float32(2 * math.pi) / inv_freq
  scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
  smooth = (old_context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply(x_BxTxHxD: jax.Array, positions_BxT: jax.Array,
          inv_freq: np.ndarray) -> jax.Array:
  """Rotary embedding in the Hugging Face (rotate-half) layout."""
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  angles = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)[:, :, None]
  x32 = x_BxTxHxD.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x_BxTxHxD.dtype)
