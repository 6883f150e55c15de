"""What one more verified position costs on this host, per batch: measured once.

The verify policy (decoding/verify_policy.py) needs a verified position's
cost as a fraction of a plain step. It depends on the host far more than
on anything a flag could guess: one pass of SmolLM2 over 5 tokens costs
1.2x a pass over 1 on an Intel Xeon with AMX, 1.9x on an AVX2-only EPYC,
and about the same on a TPU. So it is timed: the target's pass over
[batch, 1] and [batch, k + 1] tokens at each batch the engine calls, and
the cost of a position is (t(k + 1) / t(1) - 1) / k. The table is cached
in a JSON file keyed by everything the timing depends on, so a restart
does not time again.
"""

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig

REPEATS = 7  # timed passes per shape; the median is taken


def _pass_seconds(params, config: LlamaConfig, batch: int, width: int, window: int,
                  clock: Callable[[], float]) -> float:
  """Median seconds of the target's pass over [batch, width] new tokens after
  window // 2 cached ones, attending over `window` positions."""
  cache = config.init_cache(batch, window)
  cache = cache.with_lengths(jnp.full((batch,), window // 2, jnp.int32))
  tokens = jnp.zeros((batch, width), jnp.int32)
  run = jax.jit(lambda p, t, c: llama.logits(p, config, llama.forward(
      p, config, t, c, window=window)[0]))
  jax.block_until_ready(run(params, tokens, cache))  # compile
  times = []
  for _ in range(REPEATS):
    start = clock()
    jax.block_until_ready(run(params, tokens, cache))
    times.append(clock() - start)
  return float(np.median(times))


def measure(params, config: LlamaConfig, *, k: int, batches: Sequence[int],
            window: int, clock: Callable[[], float] = time.perf_counter
            ) -> tuple[tuple[int, float], ...]:
  """((batch, cost of a verified position as a fraction of a plain step), ...).

  `params` in the decoding layout (llama.for_decoding). Both passes write
  their tokens into the cache, as verification does.
  """
  if k < 1:
    return ()
  costs = []
  for batch in sorted(set(batches)):
    one = _pass_seconds(params, config, batch, 1, window, clock)
    full = _pass_seconds(params, config, batch, k + 1, window, clock)
    costs.append((batch, round(max(full / one - 1.0, 0.0) / k, 4)))
  return tuple(costs)


def cache_key(config: LlamaConfig, params, *, k: int, batches: Sequence[int],
              window: int, host: str) -> str:
  """A digest of what the timing depends on: model shape and weight dtypes,
  k, batches, window, the device and the host (`host`: the CPU's model and
  flags and the jax version, as the compilation cache's folder)."""
  dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(params)})
  device = jax.devices()[0]
  what = json.dumps([repr(config), dtypes, k, sorted(set(batches)), window, host,
                     device.platform, getattr(device, "device_kind", "")])
  return hashlib.sha256(what.encode()).hexdigest()[:16]


def cached(folder: str | None, key: str,
           compute: Callable[[], tuple[tuple[int, float], ...]]
           ) -> tuple[tuple[tuple[int, float], ...], bool]:
  """(the table stored under `key` in `folder`, or computed and stored there;
  whether it was computed). A folder of None stores nothing; an unreadable
  file is computed again."""
  path = None if folder is None else os.path.join(folder, f"{key}.json")
  if path is not None and os.path.exists(path):
    try:
      with open(path) as f:
        return tuple((int(b), float(c)) for b, c in json.load(f)["costs"]), False
    except (OSError, ValueError, KeyError, TypeError):
      pass  # a torn or foreign file: time again
  costs = compute()
  if path is not None:
    try:
      os.makedirs(folder, exist_ok=True)
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        json.dump({"costs": costs}, f)
      os.replace(tmp, path)
    except OSError:  # a read-only or full cache: the next start times again
      pass
  return costs, True
