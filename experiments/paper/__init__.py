"""The paper's experiments on the embedded default: each writes a table and a figure.

- main (main_table.py): per data set, alpha of the starting draft (by
  default the derived draft warm-started on chat text, as the paper's drafts
  were pretrained), of the draft distilled offline on the stream's queries,
  and of the online draft (its last window on the stream, and its final
  weights on the held-out prompts).
- shift: a sharp-shift stream served by the online draft and by static drafts
  distilled in advance on 0/30/50/70/100 % of each segment, each scored on
  every request and on the requests it did not train on (beside the online
  draft on those same requests).
- categories: one draft per category (language or topic) versus one shared.
- speedup: the cost ratios c (draft step / target step) and v (target call on
  k+1 tokens / on 1), the speed-up they predict from each measured alpha, and
  the wall-clock speed-up measured against target-only decoding.

`python -m experiments.paper` runs one from flags (see __main__.py);
`run(name, target, draft, settings, output_dir, sources=...)` is the same
thing as a function (the tests call it on a tiny random pair).
"""

import os
import time
from collections.abc import Callable, Mapping

from experiments.paper.categories import run_categories
from experiments.paper.lab import Lab
from experiments.paper.main_table import run_main
from experiments.paper.settings import (EXPERIMENTS, Settings, define_flags,
                                       settings_from_flags)
from experiments.paper.shift import run_shift
from experiments.paper.speedup import best_k, predicted_speedup, run_speedup
from osd_jax.checkpoints.loading import LoadedModel

RUNNERS = {"main": run_main, "shift": run_shift, "categories": run_categories,
           "speedup": run_speedup}

__all__ = ["EXPERIMENTS", "RUNNERS", "Settings", "best_k", "define_flags",
           "predicted_speedup", "run", "settings_from_flags"]


def run(experiment: str, target: LoadedModel, draft: LoadedModel,
        settings: Settings, output_dir: str, *, sources: Mapping | None = None,
        log: Callable[[str], None] = print) -> dict:
  """Runs one experiment; writes OUTPUT_DIR/<experiment>.{md,png,json}."""
  if experiment not in RUNNERS:
    raise ValueError(f"Unknown experiment {experiment!r}; choose from {EXPERIMENTS}.")
  os.makedirs(output_dir, exist_ok=True)
  lab = Lab(target, draft, settings, output_dir, sources, log)
  start = time.perf_counter()
  results = RUNNERS[experiment](lab)
  log(f"[{experiment}] done in {time.perf_counter() - start:.0f} s")
  return results
