"""One frozen config for every Llama-family model; draft and target are two instances."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from osd_jax.models import kv_cache
from osd_jax.models import rope


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a Llama-family decoder (RMSNorm, RoPE, GQA, SiLU-gated MLP)."""

  vocab_size: int
  hidden_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: rope.RopeScaling | None = None
  rms_eps: float = 1e-5
  tie_embeddings: bool = True
  # The families differ only in these (Qwen2: biases on q, k and v; Qwen3 and
  # Llama with attention_bias: on the output too; Qwen3: an RMSNorm over each
  # query and key head before RoPE; Mistral: a sliding window).
  qkv_bias: bool = False
  output_bias: bool = False
  qk_norm: bool = False
  # Attention reads at most this many positions back. Not implemented as a
  # mask: a cache (or sequence) longer than the window is refused, so within
  # what runs the window never cuts anything.
  sliding_window: int | None = None
  # The Hugging Face model_type the model exports as; it changes no math.
  family: str = "llama"
  # A draft may score only a subset of the vocabulary: its head has one row per
  # id here and every other token gets probability 0. None means the full vocab.
  head_token_ids: tuple[int, ...] | None = None
  max_positions: int = 8192
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype of activations
  bos_id: int | None = 1
  eos_id: int = 2
  pad_id: int = 2

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of"
          f" num_kv_heads={self.num_kv_heads}")
    if self.head_token_ids is not None:
      if self.tie_embeddings:
        raise ValueError("A restricted head cannot be tied to the embeddings.")
      if max(self.head_token_ids) >= self.vocab_size:
        raise ValueError("head_token_ids has ids outside the vocabulary.")

  @property
  def context(self) -> int:
    """The most positions a sequence may hold: the context, or the window."""
    return min(self.max_positions, self.sliding_window or self.max_positions)

  @property
  def inv_freq(self) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2], scaling applied."""
    return rope.inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)

  def check_length(self, length: int, what: str = "cache_size") -> None:
    """Raises unless `length` positions fit the context and the sliding window."""
    if length > self.max_positions:
      raise ValueError(
          f"{what}={length} exceeds the model's context of"
          f" {self.max_positions} positions.")
    if self.sliding_window is not None and length > self.sliding_window:
      raise ValueError(
          f"{what}={length} exceeds the model's sliding attention window of"
          f" {self.sliding_window} positions (config sliding_window), which"
          f" osd-jax does not implement: use at most {self.sliding_window}.")

  @property
  def head_size(self) -> int:
    """Number of output rows of the head (the vocabulary unless restricted)."""
    if self.head_token_ids is None:
      return self.vocab_size
    return len(self.head_token_ids)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  def init_cache(self, batch_size: int, cache_size: int) -> kv_cache.KVCache:
    """An empty KV cache holding `cache_size` positions per sequence."""
    self.check_length(cache_size)
    return kv_cache.KVCache.empty(
        num_layers=self.num_layers, batch_size=batch_size,
        cache_size=cache_size, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, dtype=self.jnp_dtype)

  def num_params(self) -> int:
    """Parameter count, embeddings and head included."""
    d, f = self.hidden_dim, self.mlp_dim
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    attn += self.qkv_bias * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
    attn += self.output_bias * d + self.qk_norm * 2 * self.head_dim
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else d * self.head_size
    return self.vocab_size * d + self.num_layers * per_layer + d + head

  def decode_params(self) -> int:
    """Parameters one decoded token reads: every layer and the head. An
    untied embedding table is only gathered from (a row a token); a tied one
    is the head, read whole."""
    gathered_only = 0 if self.tie_embeddings else self.vocab_size * self.hidden_dim
    return self.num_params() - gathered_only


def tiny(vocab_size: int = 64, num_layers: int = 2, **overrides) -> LlamaConfig:
  """A small random-init config for tests and CPU smoke runs."""
  fields = dict(vocab_size=vocab_size, hidden_dim=32, num_layers=num_layers,
                num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                max_positions=512, bos_id=1, eos_id=2, pad_id=0)
  fields.update(overrides)
  return LlamaConfig(**fields)
