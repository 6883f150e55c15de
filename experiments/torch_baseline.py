"""transformers + torch baselines, timed in the same process as the JAX code.

Optional dependency: `pip install torch==2.13.0` (and `accelerate`, which
transformers needs to load a GGUF file). torch is imported lazily, so this
module imports without it. Thread count (`torch.set_num_threads`) is left to
the caller.

  model, tok = load_torch_model("/path/SmolLM2-135M-Instruct.Q4_1.gguf")
  r = time_generate(model, [ids] * 8, max_new_tokens=32, pad_id=2)
  a = time_assisted_generate(model, draft, ids, max_new_tokens=32, k=4)
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from typing import Any

_INSTALL_HINT = "pip install torch==2.13.0, an optional benchmark dependency"


def _torch():
  """Imports torch or raises an ImportError that says how to install it."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"torch is not installed: {_INSTALL_HINT}") from e
  return torch


def _has_tokenizer_files(path: str) -> bool:
  """True when an HF checkpoint directory ships tokenizer files."""
  names = ("tokenizer.json", "tokenizer_config.json", "vocab.json",
           "tokenizer.model")
  return any(os.path.exists(os.path.join(path, n)) for n in names)


def load_torch_model(path: str) -> tuple[Any, Any]:
  """(model, tokenizer) in float32 eval mode from a .gguf file or an HF Llama dir.

  The tokenizer is None for a directory that has no tokenizer files (for
  example a draft saved with `save_pretrained` alone).
  """
  torch = _torch()
  from transformers import AutoModelForCausalLM, AutoTokenizer  # pylint: disable=g-import-not-at-top

  path = os.path.abspath(os.path.expanduser(path))
  if path.endswith(".gguf") and os.path.isfile(path):
    try:
      import accelerate  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError as e:
      raise ImportError(
          "transformers needs accelerate to load a GGUF file: pip install"
          " accelerate") from e
    directory, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
  elif os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True)
    tokenizer = (AutoTokenizer.from_pretrained(path, local_files_only=True)
                 if _has_tokenizer_files(path) else None)
  else:
    raise ValueError(
        f"{path!r} is neither a .gguf file nor a directory with config.json")
  model.eval()
  return model, tokenizer


def _left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[Any, Any]:
  """Left-padded input ids and attention mask as torch long tensors."""
  torch = _torch()
  if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
    raise ValueError("prompt_ids must be a non-empty list of non-empty rows")
  width = max(len(p) for p in prompt_ids)
  ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
  mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
  for row, p in enumerate(prompt_ids):
    ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
    mask[row, width - len(p):] = 1
  return ids, mask


def time_generate(model: Any, prompt_ids: list[list[int]], max_new_tokens: int,
                  pad_id: int, repeats: int = 1) -> dict:
  """Times greedy `generate` on a left-padded batch; one warm-up call untimed.

  Every row produces exactly max_new_tokens tokens (min_new_tokens equals it).
  Returns tokens_per_s (batch * max_new_tokens / seconds), seconds (the median
  of `repeats` timed calls; all_seconds lists them), batch, new_tokens and ids
  (the generated ids, one list per row).
  """
  torch = _torch()
  ids, mask = _left_pad(prompt_ids, pad_id)
  kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False,
                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                pad_token_id=pad_id)
  times = []
  with torch.inference_mode():
    model.generate(**kwargs)  # warm-up
    for _ in range(max(1, repeats)):
      start = time.perf_counter()
      out = model.generate(**kwargs)
      times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  new = out[:, ids.shape[1]:]
  assert new.shape[1] == max_new_tokens, new.shape
  return {
      "tokens_per_s": new.numel() / seconds,
      "seconds": seconds,
      "all_seconds": times,
      "batch": len(prompt_ids),
      "new_tokens": max_new_tokens,
      "ids": new.tolist(),
  }


def time_assisted_generate(target: Any, draft: Any, prompt_ids: list[int],
                           max_new_tokens: int, k: int,
                           repeats: int = 1) -> dict:
  """Times transformers' assisted (speculative) greedy generation at batch 1.

  The draft proposes exactly k tokens per round (num_assistant_tokens=k,
  schedule "constant", confidence early-stop disabled); the draft's generation
  config is restored afterwards. One warm-up call is untimed. Returns
  tokens_per_s, seconds (median of `repeats` timed calls; all_seconds lists
  them), new_tokens, ids, target_calls (target forwards in one timed call, one
  per verification round) and tokens_per_target_call.
  """
  torch = _torch()
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  ids = torch.tensor([prompt_ids], dtype=torch.long)
  pad_id = target.generation_config.pad_token_id
  if pad_id is None:
    pad_id = target.generation_config.eos_token_id
  if isinstance(pad_id, (list, tuple)):
    pad_id = pad_id[0]
  kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                assistant_model=draft, do_sample=False,
                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                pad_token_id=pad_id)
  saved = copy.deepcopy(draft.generation_config)
  calls = [0]

  def count(*_):
    calls[0] += 1

  draft.generation_config.num_assistant_tokens = k
  draft.generation_config.num_assistant_tokens_schedule = "constant"
  draft.generation_config.assistant_confidence_threshold = 0.0
  try:
    with torch.inference_mode():
      target.generate(**kwargs)  # warm-up
      times = []
      for _ in range(max(1, repeats)):
        calls[0] = 0
        hook = target.register_forward_hook(count)
        try:
          start = time.perf_counter()
          out = target.generate(**kwargs)
          times.append(time.perf_counter() - start)
        finally:
          hook.remove()
  finally:
    draft.generation_config = saved
  seconds = statistics.median(times)
  new = out[0, ids.shape[1]:]
  return {
      "tokens_per_s": new.numel() / seconds,
      "seconds": seconds,
      "all_seconds": times,
      "new_tokens": int(new.numel()),
      "ids": new.tolist(),
      "k": k,
      "target_calls": calls[0],
      "tokens_per_target_call": new.numel() / max(calls[0], 1),
  }
