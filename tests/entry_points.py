"""How tests run an entry point (`python -m experiments...`) as a user's CPU run."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_device_env(**extra: str) -> dict:
  """The suite's environment for a subprocess on one CPU device, as a user
  runs it: conftest's fake device count dropped, its other XLA flags (the
  unoptimised backend, which compiles a third faster) and its compilation
  cache kept. `extra` adds variables."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **extra)
  env["XLA_FLAGS"] = " ".join(
      f for f in env.get("XLA_FLAGS", "").split()
      if not f.startswith("--xla_force_host_platform_device_count"))
  return env
