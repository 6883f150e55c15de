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
# each compile), jax 0.10.2, k=4, SmolLM2-135M (30 layers) and the 2-layer
# draft, the server's defaults (cache 1024: 5 update lengths):
#                        Xeon with AMX (2026-12-05)   EPYC with AVX-512 (2026-12-07)
#   serve, 1 slot:           2,192                        2,326
#   serve, 4 or 8 slots:     3,876                        4,053 (8)
#   plain, 1 / 8 slots:                                     924 / 602
#   learn (once):                                         1,665
#   insert (a prefill):       ~195
# Decoding unrolls its layers (about 62 mappings each, 17 at one slot). The
# update does not, but compiles one branch per sample length
# (objectives._LENGTHS up to the cache size); it lives in the one learn
# program (online.py), where a copy in every serve program used to add
# ~1,450 to each. The figures below round every measurement up.
MAPS_PER_PROGRAM = 2150
MAPS_PER_LAYER = 62
# One slot verifies without packing: fewer kernels, fewer of them per layer.
MAPS_PER_PROGRAM_AT_ONE_SLOT = 1800
MAPS_PER_LAYER_AT_ONE_SLOT = 17
MAPS_PER_LEARN_PROGRAM = 200
MAPS_PER_UPDATE_LENGTH = 330
# A plain program (target steps: call_choice.py) has one pass a step and no
# packing branches.
MAPS_PER_PLAIN_PROGRAM = 400
MAPS_PER_PLAIN_LAYER = 25
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


def serve_program_maps(batch: int, decode_layers: int) -> int:
  """Estimated mappings of one serve program over `batch` slots a device,
  `decode_layers` (target and draft) unrolled."""
  if batch == 1:
    return MAPS_PER_PROGRAM_AT_ONE_SLOT + MAPS_PER_LAYER_AT_ONE_SLOT * decode_layers
  return MAPS_PER_PROGRAM + MAPS_PER_LAYER * decode_layers


def learn_program_maps(update_lengths: int) -> int:
  """Estimated mappings of the learn program: one update branch per sample
  length (0: not learning, no program)."""
  if not update_lengths:
    return 0
  return MAPS_PER_LEARN_PROGRAM + MAPS_PER_UPDATE_LENGTH * update_lengths


def plain_program_maps(target_layers: int) -> int:
  """Estimated mappings of a plain (k = 0, no update) program
  (call_choice.py), at any batch."""
  return MAPS_PER_PLAIN_PROGRAM + MAPS_PER_PLAIN_LAYER * target_layers


@dataclasses.dataclass(frozen=True)
class Plan:
  """The serve programs a server compiles, each (window, batch), and the
  plain ones (call_choice.py) beside them."""

  programs: tuple[tuple[int, int], ...]
  maps: int  # estimated mappings of them all, inserts included
  plain: tuple[tuple[int, int], ...] = ()

  def program(self, window: int, batch: int) -> tuple[int, int]:
    """The planned (window, batch) a call needing this much runs: the fewest
    slots (a call's cost grows with its rows), then the narrowest window."""
    return _smallest(self.programs, window, batch)

  def plain_program(self, window: int, batch: int) -> tuple[int, int] | None:
    """As `program`, of the plain programs (None: none holds the call)."""
    return _smallest(self.plain, window, batch)

  def only(self, programs) -> "Plan":
    """This plan cut to these ((window, batch), plain) programs."""
    return dataclasses.replace(
        self, programs=tuple(sorted(s for s, plain in programs if not plain)),
        plain=tuple(sorted(s for s, plain in programs if plain)))

  def with_program(self, shape: tuple[int, int], plain: bool) -> "Plan":
    """This plan with one more (window, batch) program."""
    if plain:
      return dataclasses.replace(self, plain=tuple(sorted(self.plain + (shape,))))
    return dataclasses.replace(self, programs=tuple(sorted(self.programs + (shape,))))


def _smallest(programs, window: int, batch: int) -> tuple[int, int] | None:
  return min(((w, b) for w, b in programs if w >= window and b >= batch),
             key=lambda program: (program[1], program[0]), default=None)


def _by_use(windows: tuple[int, ...], batches: tuple[int, ...]) -> list[tuple[int, int]]:
  """Every (window, batch), the most useful first. The widest window over
  every slot serves any call; then the widest window at each batch, so no
  call computes more rows than it needs; then one slot (a lone client, the
  cheapest programs) at each narrower window; then the rest, widest first.
  A wider window costs a call little (a 1-token step over 512 positions
  took 1.22x one over 256 at batch 1, bench_decode); more rows cost up to
  their number."""
  widest, rest = windows[-1], windows[-2::-1]
  return ([(widest, batches[-1])] + [(widest, b) for b in batches[:-1]]
          + [(w, batches[0]) for w in rest]
          + [(w, b) for w in rest for b in batches[1:]])


def plan(windows: Sequence[int], batches: Sequence[int], *,
         serve_maps: Callable[[int], int], inserts: int,
         maps: tuple[int, int] | None, flag_hint: str,
         plain_maps: Callable[[int], int] | None = None, learn_maps: int = 0) -> Plan:
  """The most useful of these (window, batch) programs that fit beside the
  `maps` held (memory_maps()) with `inserts` prefill programs and the learn
  program (`learn_maps`; 0: none), a serve program over b slots holding
  serve_maps(b) mappings: all of them where they fit. ProgramsDoNotFit
  names what to change when not even the widest window over every slot
  fits; `flag_hint` says which flags shrink it.

  With `plain_maps`, plain programs (b slots: plain_maps(b) mappings) too.
  Under load most calls run plain (a verification over many rows costs
  more than its tokens on a CPU), and a plain program costs a third of a
  serve program's mappings or less: after the widest window's serve and
  plain programs, each narrower window (widest first) brings its plain
  programs and its one-slot serve program, then come the other serve
  programs."""
  windows, batches = tuple(sorted(windows)), tuple(sorted(batches))
  total = inserts * MAPS_PER_INSERT + learn_maps
  room = math.inf if maps is None else math.floor(HEADROOM * maps[1]) - maps[0]
  order = [(w, b, False) for w, b in _by_use(windows, batches)]
  if plain_maps is not None:
    widest, rest = windows[-1], windows[-2::-1]
    order = ([(widest, b, False) for b in batches[::-1]]
             + [(widest, b, True) for b in batches[::-1]]
             + [item for w in rest for item in [(w, b, True) for b in batches[::-1]]
                + [(w, batches[0], False)]]
             + [(w, b, False) for w in rest for b in batches[1:]])
  chosen, plains = [], []
  for window, batch, is_plain in order:
    cost = (plain_maps if is_plain else serve_maps)(batch)
    if total + cost <= room:
      (plains if is_plain else chosen).append((window, batch))
      total += cost
    elif not chosen:
      held, limit = maps
      raise ProgramsDoNotFit(
          f"Even the fewest programs this configuration needs"
          f" ({inserts + 1 + bool(learn_maps)}) would"
          f" hold about {total + serve_maps(batch):,} memory mappings beside the"
          f" {held:,} this process holds, over {HEADROOM:.0%} of vm.max_map_count ="
          f" {limit:,}: {flag_hint}, or raise the limit ({RAISE_IT}).")
  return Plan(tuple(sorted(chosen)), total, tuple(sorted(plains)))


def fits_another(maps: tuple[int, int] | None, largest: int) -> bool:
  """Whether a pass of up to twice the `largest` pass's mappings fits beside
  the `maps` held, under the limit (a pass that drafts, or learns, compiles
  more kernels than the target-only pass: 2x and 4x at 8 slots)."""
  return maps is None or maps[0] + 2 * largest <= HEADROOM * maps[1]
