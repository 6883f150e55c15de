"""An HF checkpoint directory -> a float32 GGUF file, the way llama.cpp's
convert_hf_to_gguf.py writes one (for the tests: no llama.cpp needed).

What the converter does and the reader must undo or read: Llama-architecture
Q and K rows (and biases) permuted to llama.cpp's interleaved rotary layout;
Llama 3's RoPE scaling as a `rope_freqs` tensor of per-frequency divisors;
Mistral written as architecture `llama`; Qwen2/Qwen3 under their own names.
"""

import json
import math
import os

import gguf
import numpy as np
import safetensors.numpy

from osd_jax.checkpoints import gguf_file, layout

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PRE = {"llama": "llama-bpe", "mistral": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's LlamaModel.permute: HF rotate-half rows -> interleaved rows."""
  return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(config: dict) -> np.ndarray:
  """convert_hf_to_gguf.py's rope_freqs for rope_type llama3."""
  rope = config.get("rope_parameters") or config["rope_scaling"]
  base = rope.get("rope_theta", config.get("rope_theta"))
  dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
  freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  factor, old = rope["factor"], rope["original_max_position_embeddings"]
  low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
  factors = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high:
      factors.append(1)
    elif wavelen > low:
      factors.append(factor)
    else:
      smooth = (old / wavelen - rope["low_freq_factor"]) / (
          rope["high_freq_factor"] - rope["low_freq_factor"])
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(factors, np.float32)


def convert(hf_dir: str, out: str, tokenizer, *, pre: str | None = None,
            add_bos: bool = False, chat_template: str | None = None,
            arch: str | None = None) -> None:
  """Writes `out` from `hf_dir`'s config.json and safetensors (`arch`
  overrides the GGUF architecture its family converts to)."""
  config = json.load(open(os.path.join(hf_dir, "config.json")))
  family = config["model_type"]
  arch = arch or _ARCH[family]
  writer = gguf.GGUFWriter(out, arch)
  heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
  head_dim = config.get("head_dim") or config["hidden_size"] // heads
  writer.add_block_count(config["num_hidden_layers"])
  writer.add_context_length(config["max_position_embeddings"])
  writer.add_embedding_length(config["hidden_size"])
  writer.add_feed_forward_length(config["intermediate_size"])
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_key_length(head_dim)
  writer.add_value_length(head_dim)
  writer.add_rope_dimension_count(head_dim)
  writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
  rope = config.get("rope_parameters") or {}
  writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
  writer.add_vocab_size(config["vocab_size"])
  if rope.get("rope_type") == "linear":
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(rope["factor"])
  _add_tokenizer(writer, tokenizer, config, pre or _PRE[family], add_bos, chat_template)
  tensors = {}
  for name in sorted(os.listdir(hf_dir)):
    if name.endswith(".safetensors"):
      tensors.update(safetensors.numpy.load_file(os.path.join(hf_dir, name)))
  if rope.get("rope_type") == "llama3":
    writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
  to_gguf = {hf: ours for ours, hf in gguf_file._LAYER_NAMES.items()}  # pylint: disable=protected-access
  globals_ = {hf: ours for ours, hf in gguf_file._GLOBAL_NAMES.items()}  # pylint: disable=protected-access
  for name, w in sorted(tensors.items()):
    w = np.asarray(w, np.float32)
    if name in globals_:
      if name == layout.LM_HEAD and config.get("tie_word_embeddings"):
        continue
      writer.add_tensor(globals_[name], w)
      continue
    _, _, index, rest = name.split(".", 3)
    if arch == "llama" and rest.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
      w = permute(w, heads if "q_proj" in rest else kv_heads)
    writer.add_tensor(f"blk.{index}.{to_gguf[rest]}", np.ascontiguousarray(w))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _add_tokenizer(writer, tokenizer, config: dict, pre: str, add_bos: bool,
                   chat_template: str | None) -> None:
  spec = json.loads(tokenizer.backend_tokenizer.to_str())
  tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda x: x[1])]
  special = {a["id"] for a in spec["added_tokens"]}
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
  merges = spec["model"]["merges"]
  writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
  if config.get("bos_token_id") is not None:
    writer.add_bos_token_id(config["bos_token_id"])
  writer.add_eos_token_id(config["eos_token_id"])
  writer.add_pad_token_id(config["pad_token_id"])
  writer.add_add_bos_token(add_bos)
  template = chat_template or tokenizer.chat_template
  if template:
    writer.add_chat_template(template)
