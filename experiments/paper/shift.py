"""Sharp shifts: online versus drafts distilled in advance on part of each segment.

A static draft distilled on the first X % of every segment is scored twice:
on every request (the published column, which flatters it: it trained on up
to X % of them) and on the requests it did not train on, beside the online
draft's alpha on those same requests.
"""

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import plots
from experiments.paper.lab import Lab, bars, markdown, write
from osd_jax.data import TRAIN
from osd_jax.distillation import offline


def split(segments: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]],
          fraction: float) -> tuple[list[int], list[list[int]]]:
  """(trained requests, held-out requests per segment) of the draft distilled on `fraction`.

  The first round(fraction * length) requests of each segment (at least one)
  train it. Held out are the requests whose prompt none of those carried: a
  segment longer than its data set's pool draws some prompts twice, and a
  repeat of a trained prompt is not unseen.
  """
  trained = [i for seg in segments for i in seg[:max(1, round(fraction * len(seg)))]]
  seen = {tuple(prompt_ids[i]) for i in trained}
  held = [[i for i in seg if tuple(prompt_ids[i]) not in seen] for seg in segments]
  return trained, held


def _mean(curve: Sequence[float], rows: Sequence[int]) -> float | None:
  # None, not nan, where nothing is held out (the 100 % draft): JSON has no nan.
  return float(np.mean([curve[i] for i in rows])) if rows else None


def _stream(lab: Lab):
  """Requests, prompt ids and (domain, request indices) of each segment."""
  s = lab.settings
  reqs, ids, segments = [], [], []
  for domain in s.domains:  # per segment, so every segment keeps n fitting prompts
    r, i = lab.requests("single", [domain], s.segment_length, TRAIN)
    if len(r) < s.segment_length:
      raise ValueError(f"shift: only {len(r)} {domain} prompts fit --prompt_len="
                       f"{s.prompt_len}, not --segment_length={s.segment_length}.")
    segments.append((domain, list(range(len(reqs), len(reqs) + len(r)))))
    reqs += r
    ids += i
  return reqs, ids, segments


def run_shift(lab: Lab) -> dict:
  """A sharp-shift stream served online and by static drafts (0-100 % seen)."""
  s = lab.settings
  reqs, ids, segments = _stream(lab)
  cfg = s.offline_config()
  lab.log(f"[shift] collecting teacher data on all {len(ids)} requests")
  # One row per request, in stream order: _stream kept only fitting prompts.
  data = offline.collect(lab.target.params, lab.target.config, lab.draft.params,
                         lab.draft.config, ids, cfg, seed=s.seed, log=lab.log)
  curves = {"static 0% (before)": lab.alpha(lab.draft.params, ids)["alpha_per_request"]}
  splits = {}
  for fraction in s.fractions:
    name = f"static {fraction:.0%}"
    trained, held = split([seg for _, seg in segments], ids, fraction)
    subset = jax.tree.map(lambda x: x[jnp.asarray(trained)] if x.ndim else x, data)
    lab.log(f"[shift] static draft on {fraction:.0%} of each segment ({len(trained)} samples)")
    params, _ = offline.train(lab.draft.params, lab.target.params,
                              lab.target.config, lab.draft.config, subset, cfg,
                              seed=s.seed, log=lab.log)
    curves[name] = lab.alpha(params, ids)["alpha_per_request"]
    splits[name] = {"trained": trained, "held_out": held}
  records, _ = lab.online("online_shift", reqs)
  by_request = {r["request"]: r["alpha"] for r in records}
  curves["online"] = [by_request[i] for i in range(len(reqs))]

  rows = [[name] + [_mean(c, seg) for _, seg in segments] + [float(np.mean(c))]
          for name, c in curves.items()]
  held_rows = []
  for name, sp in splits.items():
    groups = sp["held_out"] + [[i for seg in sp["held_out"] for i in seg]]
    sp["static"] = [_mean(curves[name], g) for g in groups]
    sp["online"] = [_mean(curves["online"], g) for g in groups]
    held_rows.append([name, len(groups[-1])]
                     + [x for pair in zip(sp["static"], sp["online"]) for x in pair])
  table = (markdown(["draft"] + [f"{d} (segment mean)" for d in s.domains]
                    + ["all"], rows)
           + "\nOn the requests each static draft did not train on (held out),"
             " beside the online draft on the same requests:\n\n"
           + markdown(["draft", "held-out requests"]
                      + [f"{d}: {who}" for d in list(s.domains) + ["all"]
                         for who in ("static", "online")], held_rows))
  notes = (f"{s.segment_length} requests per segment, k={s.k}, {s.max_new_tokens}"
           f" new tokens; static drafts: {s.epochs} epochs on the first X % of"
           " every segment, collected before serving. The first table scores"
           " them on every request, including those they trained on; the second"
           " only on the rest ('-': none left). The online draft serves each"
           f" request before it learns from it: an update every"
           f" {s.update_interval} requests, {s.update_steps} steps of"
           f" {s.minibatch or 'all'} samples from the last {s.buffer_capacity}"
           " served. Paper (GSM8K/Spider/finance/code,"
           " 2K each): online 0.706/0.642/0.644/0.595, about as good as static"
           " drafts distilled on 70-100 % of each segment.")
  write(lab, "shift", "Sharp-shift stream: online versus static drafts", table,
        notes, {"domains": list(s.domains), "curves": curves,
                "segments": [seg for _, seg in segments],
                "segment_means": {r[0]: r[1:] for r in rows},
                "held_out": splits})
  plots.rolling_alpha(curves, os.path.join(lab.output_dir, "shift.png"),
                      window=max(2, min(s.window, s.segment_length // 2)),
                      boundaries=[(seg[0], d) for d, seg in segments],
                      title=f"sharp shifts, k={s.k}")
  nan = lambda x: float("nan") if x is None else x  # a missing bar
  bars(list(splits), {
      "static, all requests": [float(np.mean(curves[n])) for n in splits],
      "static, held out": [nan(sp["static"][-1]) for sp in splits.values()],
      "online, same requests": [nan(sp["online"][-1]) for sp in splits.values()]},
       os.path.join(lab.output_dir, "shift_held_out.png"), "alpha",
       f"static drafts on requests they did not train on (k={s.k})")
  return {"curves": curves, "segments": [seg for _, seg in segments],
          "held_out": splits}
