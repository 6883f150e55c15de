"""Whether compiled programs fit under Linux's vm.max_map_count.

XLA's CPU backend maps about three memory regions per compiled kernel and
keeps them while the program is cached. Linux stops a process at
vm.max_map_count mappings (65,530 by default): LLVM then reports "Cannot
allocate memory" and the process dies in the compiler, minutes into its
start. The main job (driver.serve_in_turns) and the server (live.py) check
here first.
"""

import dataclasses
import math
import os
from collections.abc import Callable, Sequence

from osd_jax.errors import UserError

# $OSD_JAX_MAX_MAP_COUNT_PATH stands in for the kernel's file (tests).
LIMIT_PATH = "/proc/sys/vm/max_map_count"
MAPS_PATH = "/proc/self/maps"
# What compiled programs may take of the limit: the rest is for the programs
# the process compiles later and does not plan (eager ops, checkpoints).
HEADROOM = 0.9
RAISE_IT = "sudo sysctl -w vm.max_map_count=262144"

# Mappings per compiled program, measured (/proc/self/maps before and after
# each compile) on an Intel Xeon with AMX, 2 cores, jax 0.10.2, k=4, 8 slots:
#                       SmolLM2-135M + 2-layer draft   tiny 3 + 1 layers
#   serve, 1 slot:          2,192                          1,731
#   serve, 4 or 8 slots:    3,876                          2,163
#   the same, learning:   +1,470 (5 update lengths)      +1,300 (4 lengths)
#   insert (a prefill):       ~195
# Decoding unrolls its layers (about 62 mappings each); the update does not,
# but compiles one branch per sample length (objectives._LENGTHS up to the
# cache size). The figures below round every measurement up: the server's
# defaults plan 10 serve programs and 9 inserts at an estimated 57,090
# mappings, and compiling them took the process from 877 to 48,837.
MAPS_PER_PROGRAM = 2050
MAPS_SAVED_AT_ONE_SLOT = 400  # one slot verifies without packing: fewer kernels
MAPS_PER_LAYER = 62
MAPS_PER_UPDATE_LENGTH = 330
MAPS_PER_INSERT = 250


class ProgramsDoNotFit(UserError):
  """The programs a configuration needs would pass vm.max_map_count."""


def memory_maps(limit_path: str | None = None,
                maps_path: str = MAPS_PATH) -> tuple[int, int] | None:
  """(memory mappings this process holds, vm.max_map_count), or None where
  the kernel does not say (not Linux)."""
  limit_path = limit_path or os.environ.get("OSD_JAX_MAX_MAP_COUNT_PATH", LIMIT_PATH)
  try:
    with open(limit_path) as f:
      limit = int(f.read())
    with open(maps_path) as f:
      return sum(1 for _ in f), limit
  except (OSError, ValueError):
    return None


def serve_program_maps(batch: int, decode_layers: int, update_lengths: int = 0) -> int:
  """Estimated mappings of one serve program over `batch` slots a device:
  `decode_layers` (target and draft) unrolled, and one update branch per
  sample length (0: no learning)."""
  return (MAPS_PER_PROGRAM - (MAPS_SAVED_AT_ONE_SLOT if batch == 1 else 0)
          + MAPS_PER_LAYER * decode_layers + MAPS_PER_UPDATE_LENGTH * update_lengths)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The serve programs a server compiles: one per (window, batch)."""

  windows: tuple[int, ...]
  batches: tuple[int, ...]
  maps: int  # estimated mappings of all its programs

  @property
  def programs(self) -> int:
    return len(self.windows) * len(self.batches)

  def window(self, needed: int) -> int:
    """The smallest planned window of at least `needed` positions."""
    return min(w for w in self.windows if w >= needed)

  def batch(self, needed: int) -> int:
    """The smallest planned batch of at least `needed` slots."""
    return min(b for b in self.batches if b >= needed)


def _fewer(windows: tuple[int, ...], batches: tuple[int, ...]):
  """Ever smaller bucket sets, all keeping the widest window and batch (a
  call may need them). Middle batches merge first (a call over 2 or 4 slots
  computes 8), then the narrowest windows (their attention is the cheapest
  part of a step), then batch 1."""
  keep_one = batches[:1] if batches[0] < batches[-1] else ()
  middle = list(batches[1:-1] if keep_one else batches[:-1])
  while middle:
    middle.pop(0)
    yield windows, keep_one + tuple(middle) + batches[-1:]
  batches = keep_one + batches[-1:]
  for cut in range(1, len(windows)):
    yield windows[cut:], batches
  yield windows[-1:], batches[-1:]


def plan(windows: Sequence[int], batches: Sequence[int], *,
         serve_maps: Callable[[int], int], inserts: int,
         maps: tuple[int, int] | None, flag_hint: str) -> Plan:
  """The most of these (window, batch) programs that fit beside the `maps`
  held (memory_maps()) with `inserts` prefill programs, a serve program over
  b slots holding serve_maps(b) mappings. ProgramsDoNotFit names what to
  change when even one window and one batch do not fit; `flag_hint` says
  which flags shrink the programs."""
  windows, batches = tuple(sorted(windows)), tuple(sorted(batches))
  cost = lambda w, b: (len(w) * sum(map(serve_maps, b))
                       + inserts * MAPS_PER_INSERT)
  full = Plan(windows, batches, cost(windows, batches))
  if maps is None:  # not Linux: no such limit
    return full
  held, limit = maps
  room = math.floor(HEADROOM * limit) - held
  for w, b in ((windows, batches), *_fewer(windows, batches)):
    if cost(w, b) <= room:
      return Plan(w, b, cost(w, b))
  least = cost(windows[-1:], batches[-1:])
  raise ProgramsDoNotFit(
      f"Even the fewest programs this configuration needs ({inserts + 1}) would"
      f" hold about {least:,} memory mappings beside the {held:,} this process"
      f" holds, over {HEADROOM:.0%} of vm.max_map_count = {limit:,}: {flag_hint},"
      f" or raise the limit ({RAISE_IT}).")


def fits_another(maps: tuple[int, int] | None, largest: int) -> bool:
  """Whether a pass of up to twice the `largest` pass's mappings fits beside
  the `maps` held, under the limit (a pass that drafts, or learns, compiles
  more kernels than the target-only pass: 2x and 4x at 8 slots)."""
  return maps is None or maps[0] + 2 * largest <= HEADROOM * maps[1]
