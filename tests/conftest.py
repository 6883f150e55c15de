"""Shared pytest set-up: absl flags parsed, fake CPU devices, the real model once."""

import os

# Eight fake CPU devices for the multi-device tests; must precede backend start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the suite's processes (both test
# workers and the entry points they start): each module drops its compiled
# programs (below), and many modules and processes build the same ones, which
# then load from disk instead of compiling again. tests/compiles.py counts
# such loads as compiles. Set before jax reads its configuration.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache",
    "test_programs"))
# Every program, however quick to compile: most are the tiny models' and
# compile in under a second, and module after module compiled them again.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The suite compiles far more than it computes: XLA's CPU backend without
# LLVM's optimisation passes compiled a tiny-model module a third faster and
# ran the real-model tests as fast (matrix products are library calls).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()
# Compute as a host without AMX does (osd_jax/hardware.py): many tests compare
# two equivalent computations to float32 tolerances, and the CI host may have
# AMX or not. tests/test_narrow_weights.py asks for the AMX paths itself.
os.environ.setdefault("OSD_JAX_BFLOAT16_MATMULS", "0")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

from absl import flags  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

flags.FLAGS.mark_as_parsed()


# The slowest files (a cold run, 2026-12-03), started first: the two test
# processes take files in collection order, so a slow file collected last
# ran alone for its last five minutes.
SLOW_FIRST = ("test_online_main.py", "test_online.py", "test_server.py", "test_cli.py",
              "test_online_samples.py", "test_speculative.py")


def pytest_collection_modifyitems(items):
  """Slow files first; a file's own tests keep their order (a stable sort)."""
  rank = {name: i for i, name in enumerate(SLOW_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "real_model: loads the real SmolLM2 target (slow; run in CI)")


@pytest.fixture(scope="session")
def smollm2():
  """The embedded default target, loaded once per test session."""
  from osd_jax.checkpoints import loading  # pylint: disable=g-import-not-at-top
  return loading.load()


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
  """Drops every compiled program after each test module.

  Each XLA CPU executable keeps several memory mappings, and one process
  running the whole suite compiles thousands: the full suite then crashed
  inside XLA's compiler (a segfault in backend_compile_and_load, no OOM),
  always late in the run. A module that needs a program again recompiles it.
  """
  yield
  import jax  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
