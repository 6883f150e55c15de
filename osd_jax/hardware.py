"""What the host's matrix units make fast.

On a CPU with AMX (Intel Sapphire Rapids and later) XLA runs bfloat16
matrix products of two or more rows on the tile units: measured on a 2-core
Xeon, [5, 576] x [576, 49,152] took 3.1 ms in bfloat16 against 10.2 ms in
float32, and a whole SmolLM2 pass cost the same on 1 to 9 new tokens. A
frozen target is then best stored in bfloat16 (llama.matmul).
"""

import functools
import os

import jax

# "0" or "1" overrides the detection below; the test suite sets "0", so its
# processes (and the entry points it starts) compute as a host without AMX.
OVERRIDE = "OSD_JAX_BFLOAT16_MATMULS"


@functools.cache
def cpu_flags() -> frozenset[str]:
  """The CPU feature flags Linux reports (empty where it reports none)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


def bfloat16_matmuls_are_fast() -> bool:
  """Whether this host's default backend is a CPU with AMX bfloat16 tiles
  (or what $OSD_JAX_BFLOAT16_MATMULS says)."""
  override = os.environ.get(OVERRIDE, "")
  if override:
    if override not in ("0", "1"):
      raise ValueError(f"${OVERRIDE} must be 0 or 1, got {override!r}.")
    return override == "1"
  return jax.default_backend() == "cpu" and "amx_bf16" in cpu_flags()
