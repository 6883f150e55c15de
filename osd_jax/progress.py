"""Progress bars for long work: counts, rate and ETA on stderr."""

import sys

import tqdm


def bar(total: int | None, desc: str, unit: str = "it", **options) -> tqdm.tqdm:
  """A tqdm bar; total None counts without an ETA, total 0 shows nothing.

  It appears only after a second, so quick work stays quiet. Written to a file
  rather than a terminal, it redraws every 30 s instead of ten times a second.
  """
  defaults = dict(total=total, desc=desc, unit=f" {unit}", file=sys.stderr,
                  disable=total == 0, delay=1.0, dynamic_ncols=True,
                  mininterval=0.1 if sys.stderr.isatty() else 30.0)
  return tqdm.tqdm(**(defaults | options))
