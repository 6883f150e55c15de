"""Hugging Face Llama checkpoint directories: read and write, no torch."""

import json
import os

import numpy as np
import safetensors.numpy

from osd_jax.checkpoints import layout
from osd_jax.models.config import LlamaConfig

_SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
HEAD_IDS_KEY = "osd_head_token_ids"


def read_config(path: str, *, param_dtype: str, dtype: str) -> LlamaConfig:
  """Our config from config.json (read with transformers' AutoConfig)."""
  import transformers  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(os.path.join(path, "config.json")):
    raise layout.CheckpointError(f"{path} has no config.json.")
  try:
    hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
  except (ValueError, OSError) as e:  # unknown model_type, malformed JSON
    raise layout.CheckpointError(
        f"{path}: config.json is not a supported Llama-family config: {e}") from e
  archs = set(getattr(hf, "architectures", None) or [])
  if not archs & _SUPPORTED:
    raise layout.CheckpointError(
        f"{path}: architecture {sorted(archs) or hf.model_type!r} is not"
        f" supported; expected one of {sorted(_SUPPORTED)}.")
  if getattr(hf, "attention_bias", False) or "Qwen2ForCausalLM" in archs:
    raise layout.CheckpointError(
        f"{path}: attention projections with bias are not supported yet.")
  raw = json.load(open(os.path.join(path, "config.json")))
  head_ids = raw.get(HEAD_IDS_KEY)
  rope = getattr(hf, "rope_parameters", None) or {}
  theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10_000.0))
  eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
  return LlamaConfig(
      vocab_size=hf.vocab_size, hidden_dim=hf.hidden_size,
      num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
      num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
      head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
      mlp_dim=hf.intermediate_size, rope_theta=float(theta),
      rms_eps=float(hf.rms_norm_eps),
      tie_embeddings=bool(hf.tie_word_embeddings) and head_ids is None,
      head_token_ids=tuple(head_ids) if head_ids else None,
      max_positions=hf.max_position_embeddings, param_dtype=param_dtype,
      dtype=dtype, bos_id=hf.bos_token_id, eos_id=eos if eos is not None else 2,
      pad_id=hf.pad_token_id if hf.pad_token_id is not None else (eos or 0))


def read_tensors(path: str) -> dict[str, np.ndarray]:
  """All safetensors of a directory, sharded (with index) or single-file."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    files = sorted(set(json.load(open(index))["weight_map"].values()))
  else:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise layout.CheckpointError(f"{path} has no .safetensors weights.")
  tensors = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      raise layout.CheckpointError(f"Shard {file} named in the index is missing.")
    try:
      tensors.update(safetensors.numpy.load_file(file))
    except Exception as e:  # pylint: disable=broad-except
      raise layout.CheckpointError(f"Cannot read {file}: {e}") from e
  return tensors


def write(path: str, params: dict, config: LlamaConfig, tokenizer) -> None:
  """An HF directory (config.json, model.safetensors, tokenizer) of our params."""
  os.makedirs(path, exist_ok=True)
  hf_config = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
      "intermediate_size": config.mlp_dim, "hidden_act": "silu",
      "rms_norm_eps": config.rms_eps, "rope_theta": config.rope_theta,
      "max_position_embeddings": config.max_positions,
      "tie_word_embeddings": config.tie_embeddings,
      "attention_bias": False, "mlp_bias": False,
      "bos_token_id": config.bos_id, "eos_token_id": config.eos_id,
      "pad_token_id": config.pad_id, "torch_dtype": "float32",
  }
  if config.head_token_ids is not None:
    hf_config[HEAD_IDS_KEY] = list(config.head_token_ids)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump(generation_config(config), f, indent=2)
  tensors = layout.params_to_hf(params, config)
  safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"),
                              metadata={"format": "pt"})
  if tokenizer is not None:
    tokenizer.save_pretrained(path)


def generation_config(config: LlamaConfig) -> dict:
  """generation_config.json: special ids, and the tokens a restricted head lacks.

  Plain Llama has no restricted head, so the export's lm_head has zero rows
  for those tokens, which a raw forward turns into logit 0. transformers'
  generate() (greedy, sampled, or the model as an assistant) sets the logits
  of `suppress_tokens` to -inf: probability 0, as in osd-jax.
  """
  generation = {"bos_token_id": config.bos_id, "eos_token_id": config.eos_id,
                "pad_token_id": config.pad_id}
  if config.head_token_ids is not None:
    head = set(config.head_token_ids)
    generation["suppress_tokens"] = [i for i in range(config.vocab_size)
                                     if i not in head]
  return generation
