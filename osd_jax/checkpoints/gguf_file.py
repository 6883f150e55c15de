"""Reads a llama.cpp GGUF file: dequantized weights, config and tokenizer."""

import os

import numpy as np

from osd_jax.checkpoints import layout
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
}
_GLOBAL_NAMES = {"token_embd.weight": layout.EMBED,
                 "output_norm.weight": layout.FINAL_NORM,
                 "output.weight": layout.LM_HEAD}


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's interleaved-rotary row order of a Q or K projection."""
  out_dim, in_dim = w.shape
  head_dim = out_dim // num_heads
  return (w.reshape(num_heads, head_dim // 2, 2, in_dim).swapaxes(1, 2)
          .reshape(out_dim, in_dim))


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
  if arch != "llama":
    raise layout.CheckpointError(
        f"{path}: architecture {arch!r} is not supported (Llama family only).")

  def get(key):
    if f"llama.{key}" not in meta:
      raise layout.CheckpointError(f"{path}: metadata llama.{key} is missing.")
    return meta[f"llama.{key}"]

  num_heads, num_kv_heads = get("attention.head_count"), get("attention.head_count_kv")
  hidden = get("embedding_length")
  tensors = {}
  for tensor in reader.tensors:
    w = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                   np.float32)
    name = tensor.name
    if name in _GLOBAL_NAMES:
      tensors[_GLOBAL_NAMES[name]] = w
      continue
    _, index, rest = name.split(".", 2)
    if rest == "attn_q.weight":
      w = _unpermute_rope(w, num_heads)
    elif rest == "attn_k.weight":
      w = _unpermute_rope(w, num_kv_heads)
    if rest in _LAYER_NAMES:
      tensors[f"model.layers.{index}.{_LAYER_NAMES[rest]}"] = w
  vocab = len(meta["tokenizer.ggml.tokens"])
  config = LlamaConfig(
      vocab_size=meta.get("llama.vocab_size", vocab), hidden_dim=hidden,
      num_layers=get("block_count"), num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=meta.get("llama.attention.key_length", hidden // num_heads),
      mlp_dim=get("feed_forward_length"),
      rope_theta=float(meta.get("llama.rope.freq_base", 10_000.0)),
      rms_eps=float(get("attention.layer_norm_rms_epsilon")),
      tie_embeddings=layout.LM_HEAD not in tensors,
      max_positions=get("context_length"),
      param_dtype=param_dtype, dtype=dtype,
      bos_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_id=meta.get("tokenizer.ggml.eos_token_id", 2),
      pad_id=meta.get("tokenizer.ggml.padding_token_id",
                      meta.get("tokenizer.ggml.eos_token_id", 0)))
  return config, tensors, meta
