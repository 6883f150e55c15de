"""Sharp shifts: online versus drafts distilled in advance on part of each segment."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments import plots
from experiments.paper.lab import Lab, markdown, write
from osd_jax.data import TRAIN
from osd_jax.distillation import offline


def run_shift(lab: Lab) -> dict:
  """A sharp-shift stream served online and by static drafts (0-100 % seen)."""
  s = lab.settings
  n = s.segment_length
  reqs, ids, segments = [], [], []
  for domain in s.domains:  # per segment, so every segment keeps n fitting prompts
    r, i = lab.requests("single", [domain], n, TRAIN)
    segments.append((domain, list(range(len(reqs), len(reqs) + len(r)))))
    reqs += r
    ids += i
  cfg = s.offline_config()
  lab.log(f"[shift] collecting teacher data on all {len(ids)} requests")
  data = offline.collect(lab.target.params, lab.target.config, lab.draft.params,
                         lab.draft.config, ids, cfg, seed=s.seed, log=lab.log)
  curves = {"static 0% (before)": lab.alpha(lab.draft.params, ids)["alpha_per_request"]}
  for fraction in s.fractions:
    rows = np.concatenate([seg[:max(1, round(fraction * len(seg)))]
                           for _, seg in segments])
    subset = jax.tree.map(lambda x: x[jnp.asarray(rows)] if x.ndim else x, data)
    lab.log(f"[shift] static draft on {fraction:.0%} of each segment ({len(rows)} samples)")
    params, _ = offline.train(lab.draft.params, lab.target.params,
                              lab.target.config, lab.draft.config, subset, cfg,
                              seed=s.seed, log=lab.log)
    curves[f"static {fraction:.0%}"] = lab.alpha(params, ids)["alpha_per_request"]
  records, _ = lab.online("online_shift", reqs)
  by_request = {r["request"]: r["alpha"] for r in records}
  curves["online"] = [by_request[i] for i in range(len(reqs))]
  mean = lambda curve, seg: float(np.mean([curve[i] for i in seg]))
  rows = [[name] + [mean(c, seg) for _, seg in segments] + [float(np.mean(c))]
          for name, c in curves.items()]
  table = markdown(["draft"] + [f"{d} (segment mean)" for d in s.domains]
                   + ["all"], rows)
  notes = (f"{n} requests per segment, k={s.k}, {s.max_new_tokens} new tokens;"
           f" static drafts: {s.epochs} epochs on the first X % of every segment,"
           " collected before serving. Paper (GSM8K/Spider/finance/code, 2K each):"
           " online 0.706/0.642/0.644/0.595, about as good as static drafts"
           " distilled on 70-100 % of each segment.")
  write(lab, "shift", "Sharp-shift stream: online versus static drafts", table,
        notes, {"domains": list(s.domains), "curves": curves,
                "segment_means": {r[0]: r[1:] for r in rows}})
  plots.rolling_alpha(curves, os.path.join(lab.output_dir, "shift.png"),
                      window=max(2, min(s.window, n // 2)),
                      boundaries=[(seg[0], d) for d, seg in segments],
                      title=f"sharp shifts, k={s.k}")
  return {"curves": curves}
