"""Timing helpers shared by the benchmark scripts (one process, ratios only)."""

import os
import tempfile
import time

import jax
import numpy as np

from osd_jax.checkpoints import loading
from osd_jax.data import streams
from osd_jax.serving.driver import encode_prompts


def timed(fn, *args, repeats: int = 3):
  """(first call seconds, median seconds of `repeats` later calls, last result)."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return first, float(np.median(times)), result


def bench_prompts(model: loading.LoadedModel, batch_size: int, domain: str = "math",
                  max_tokens: int = 96) -> list[list[int]]:
  """Chat-templated real queries that fit in max_tokens, `batch_size` of them."""
  queries = streams.make_stream("single", [domain], 4 * batch_size + 16, seed=1)
  ids = [x for x in encode_prompts(model, [q.prompt for q in queries], chat=True)
         if len(x) <= max_tokens]
  if len(ids) < batch_size:
    raise ValueError(f"Only {len(ids)} {domain} prompts fit in {max_tokens} tokens.")
  return ids[:batch_size]


def export_for_torch(model: loading.LoadedModel, name: str) -> str:
  """An HF directory of `model` (same weights) that transformers can load."""
  path = os.path.join(tempfile.mkdtemp(prefix="osd_bench_"), name)
  loading.save_hf(model, path)
  return path


def torch_available() -> bool:
  """True when the optional torch baseline can run."""
  try:
    import torch  # pylint: disable=import-outside-toplevel,unused-import
    return True
  except ImportError:
    print("torch is not installed: skipping the transformers baseline"
          " (pip install torch==2.13.0, an optional benchmark dependency).")
    return False
