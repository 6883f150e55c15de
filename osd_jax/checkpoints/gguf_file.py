"""Reads a llama.cpp GGUF file of the Llama family (architectures llama,
qwen2, qwen3): dequantized weights, config and tokenizer."""

import os

import numpy as np

from osd_jax.checkpoints import layout
from osd_jax.models import rope
from osd_jax.models.config import LlamaConfig

# GGUF tensor name (inside `blk.{i}.`) -> HF name (inside `model.layers.{i}.`).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": layout.EMBED,
                 "output_norm.weight": layout.FINAL_NORM,
                 "output.weight": layout.LM_HEAD}
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3: a divisor per rotary frequency
# GGUF architecture -> the HF family it converts from.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Keys under `{arch}.` that read() reads, and those that change no math here.
_READ_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "vocab_size"}
_NO_MATH_KEYS = {
    "tensor_data_layout",  # how llama.cpp's converter laid Q/K out (undone below)
    "rope.scaling.finetuned",  # a note on the training, not a parameter
    "rope.scaling.original_context_length",  # read by YaRN only, which is refused
}


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's interleaved-rotary row order of a Q or K projection
  (or its bias), which its converter applies to the `llama` architecture."""
  out_dim = w.shape[0]
  head_dim = out_dim // num_heads
  return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _field_values(reader) -> dict:
  """Metadata as plain Python values (strings, numbers, lists)."""
  values = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    try:
      values[key] = field.contents()
    except Exception:  # pylint: disable=broad-except
      continue  # a field type this reader cannot decode is not one we need
  return values


def read(path: str, *, param_dtype: str = "float32", dtype: str = "float32"):
  """Returns (config, HF-named float32 tensors, metadata) of a GGUF file."""
  import gguf  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(path):
    raise layout.CheckpointError(f"GGUF file not found: {path}")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except
    raise layout.CheckpointError(
        f"Cannot read GGUF file {path} (truncated or corrupt?): {e}") from e
  meta = _field_values(reader)
  arch = meta.get("general.architecture")
  if arch not in FAMILIES:
    raise layout.CheckpointError(
        f"{path}: architecture {arch!r} is not supported (one of"
        f" {sorted(FAMILIES)}).")
  unknown = sorted(k for k in meta if k.startswith(f"{arch}.")
                   and k[len(arch) + 1:] not in _READ_KEYS | _NO_MATH_KEYS)
  if unknown:
    raise layout.CheckpointError(
        f"{path}: metadata {unknown[0]} is not supported (it may change the"
        " computation, so the file is refused rather than run differently).")

  def get(key, default=None):
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
      raise layout.CheckpointError(f"{path}: metadata {arch}.{key} is missing.")
    return value

  num_heads, num_kv_heads = get("attention.head_count"), get("attention.head_count_kv")
  hidden = get("embedding_length")
  head_dim = get("attention.key_length", hidden // num_heads)
  if (get("attention.value_length", head_dim) != head_dim
      or get("rope.dimension_count", head_dim) != head_dim):
    raise layout.CheckpointError(
        f"{path}: value heads or RoPE narrower than the key heads are not supported.")
  tensors, divisors = {}, None
  for tensor in reader.tensors:
    w = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                   np.float32)
    name = tensor.name
    if name in _GLOBAL_NAMES:
      tensors[_GLOBAL_NAMES[name]] = w
      continue
    if name == _ROPE_FREQS:
      divisors = tuple(float(x) for x in w.reshape(-1))
      continue
    _, index, rest = name.split(".", 2) if name.startswith("blk.") else ("", "", name)
    if rest not in _LAYER_NAMES:
      raise layout.CheckpointError(f"{path}: tensor {name!r} is not supported.")
    if arch == "llama" and rest.startswith(("attn_q.", "attn_k.")):
      w = _unpermute_rope(w, num_heads if rest.startswith("attn_q.") else num_kv_heads)
    tensors[f"model.layers.{index}.{_LAYER_NAMES[rest]}"] = w
  has = lambda hf_name: f"model.layers.0.{hf_name}" in tensors
  vocab = len(meta["tokenizer.ggml.tokens"])
  config = LlamaConfig(
      vocab_size=meta.get(f"{arch}.vocab_size", vocab), hidden_dim=hidden,
      num_layers=get("block_count"), num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim,
      mlp_dim=get("feed_forward_length"),
      rope_theta=float(get("rope.freq_base", 10_000.0)),
      rope_scaling=_rope_scaling(meta, arch, divisors, path),
      rms_eps=float(get("attention.layer_norm_rms_epsilon")),
      tie_embeddings=layout.LM_HEAD not in tensors,
      qkv_bias=has("self_attn.q_proj.bias"), output_bias=has("self_attn.o_proj.bias"),
      qk_norm=has("self_attn.q_norm.weight"), family=FAMILIES[arch],
      max_positions=get("context_length"),
      param_dtype=param_dtype, dtype=dtype,
      bos_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_id=meta.get("tokenizer.ggml.eos_token_id", 2),
      pad_id=meta.get("tokenizer.ggml.padding_token_id",
                      meta.get("tokenizer.ggml.eos_token_id", 0)))
  return config, tensors, meta


def _rope_scaling(meta: dict, arch: str, divisors, path: str) -> rope.RopeScaling | None:
  """llama.cpp's rope.scaling.* keys and rope_freqs tensor as one scaling."""
  kind = meta.get(f"{arch}.rope.scaling.type", "none")
  if kind not in ("none", "linear"):
    raise layout.CheckpointError(
        f"{path}: RoPE scaling {kind!r} is not supported (only none and linear,"
        " and Llama 3's rope_freqs).")
  if kind == "linear" and divisors is not None:
    raise layout.CheckpointError(f"{path}: both linear RoPE scaling and rope_freqs.")
  if kind == "linear":
    return rope.RopeScaling("linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
  return None if divisors is None else rope.RopeScaling("divisors", divisors=divisors)
