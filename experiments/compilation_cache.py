"""The persistent XLA compilation cache of an entry point, on by default.

A restart of the server otherwise compiles every program again (minutes on a
CPU). JAX's own cache key covers the program and its compile options, but
not the host: a program compiled for another CPU's instructions (AVX-512,
AMX) loaded on this one would crash. So the cache lives in a folder named
by the jax and jaxlib versions and a digest of this CPU's model and flags.
"""

import hashlib
import os
import platform

from absl import flags
import jax
import jaxlib

DEFAULT_ROOT = os.path.join("~", ".cache", "osd_jax", "xla")
_ENV = "JAX_COMPILATION_CACHE_DIR"  # where jax itself looks (tests set it)
_MIN_SECONDS_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"

FLAG = flags.DEFINE_string(
    "compilation_cache", DEFAULT_ROOT, "Persistent XLA compilation cache, so a"
    " restart loads the programs instead of compiling them; kept in a subfolder"
    " per jax version and host CPU. '' turns it off; left at its default,"
    " $JAX_COMPILATION_CACHE_DIR wins where set.")


def cpu_digest(cpuinfo_path: str = "/proc/cpuinfo") -> str:
  """12 hex digits naming this CPU's model and instruction set extensions."""
  try:
    with open(cpuinfo_path) as f:
      lines = f.read().split("\n\n")[0].splitlines()  # the first processor
  except OSError:  # not Linux
    lines = [platform.processor()]
  wanted = [line.split(":", 1)[-1].strip() for line in lines
            if line.split(":")[0].strip() in ("vendor_id", "model name", "flags")]
  return hashlib.sha256("\n".join(wanted or lines).encode()).hexdigest()[:12]


def host_key(cpuinfo_path: str = "/proc/cpuinfo") -> str:
  """The folder name for programs this jax compiles on this host."""
  return (f"jax-{jax.__version__}-jaxlib-{jaxlib.__version__}-{platform.machine()}"
          f"-cpu-{cpu_digest(cpuinfo_path)}")


def directory(flag: str, flag_is_default: bool,
              env: dict[str, str] | None = None) -> str | None:
  """The cache folder for a --compilation_cache value: '' turns it off; left
  at its default, a JAX_COMPILATION_CACHE_DIR already set wins."""
  env = os.environ if env is None else env
  if flag_is_default and env.get(_ENV):
    return env[_ENV]
  if not flag:
    return None
  return os.path.join(os.path.expanduser(flag), host_key())


def enable(folder: str | None) -> None:
  """Points jax's persistent cache at `folder` (None: no persistent cache)."""
  if folder is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return
  jax.config.update("jax_compilation_cache_dir", folder)
  # jax keeps only programs that took a second or more to compile. A start
  # also compiles ~180 small ones (loading, eager ops, warm-up) at ~0.1-0.2 s
  # each: a third of a restart when they compile again (SmolLM2, 2-core CPU).
  if _MIN_SECONDS_ENV not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def enable_from_flag() -> None:
  """enable() with the folder --compilation_cache names."""
  enable(directory(FLAG.value, not FLAG.present))
