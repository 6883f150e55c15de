"""Hugging Face checkpoint directories of the Llama family: read and write, no torch."""

import json
import os

import numpy as np
import safetensors.numpy

from osd_jax.checkpoints import hf_config, layout
from osd_jax.models.config import LlamaConfig


def read_config(path: str, *, param_dtype: str, dtype: str) -> LlamaConfig:
  """Our config from config.json (read with transformers' AutoConfig)."""
  import transformers  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(os.path.join(path, "config.json")):
    raise layout.CheckpointError(f"{path} has no config.json.")
  try:
    hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    raw = json.load(open(os.path.join(path, "config.json")))
  except (ValueError, OSError, KeyError) as e:  # unknown model_type, malformed JSON
    raise layout.CheckpointError(
        f"{path}: config.json is not a supported Llama-family config: {e}") from e
  return hf_config.from_hf(hf, raw, path, param_dtype=param_dtype, dtype=dtype)


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
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config.to_hf(config), f, indent=2)
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
