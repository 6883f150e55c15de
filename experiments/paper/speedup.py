"""Speed-up: the cost ratios c and v, the speed-up they predict, and the measured one."""

import os
import time
from collections.abc import Callable

import numpy as np

from experiments import bench_common, plots
from experiments.paper.lab import Lab, domain_drafts, markdown, write
from osd_jax.decoding.drafts import Draft, ModelDraft
from osd_jax.decoding.engine import Engine
from osd_jax.decoding.sampling import Sampling


def predicted_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
  """(1 - alpha^(k+1)) / ((1 - alpha)(k c + v)): expected speed-up over the target."""
  alpha = min(alpha, 1.0 - 1e-9)
  return (1.0 - alpha ** (k + 1)) / ((1.0 - alpha) * (k * c + v))


def best_k(alpha: float, c: float, v_of_k: Callable[[int], float] = lambda k: 1.0,
           max_k: int = 99) -> tuple[int, float]:
  """The k in 1..max_k with the highest predicted speed-up (the prototype's search)."""
  return max(((k, predicted_speedup(alpha, k, c, v_of_k(k)))
              for k in range(1, max_k + 1)), key=lambda kv: kv[1])


def measure_costs(lab: Lab) -> dict:
  """c = draft step / target step and v_k = target call on k+1 tokens / on 1."""
  s = lab.settings
  seconds = lambda model, tokens: bench_common.forward_seconds(
      model.params, model.config, s.batch_size, tokens, filled=s.prompt_len // 2,
      window=s.cache_size, repeats=s.timing_repeats)
  target_1 = seconds(lab.target, 1)
  ks = sorted({s.k} | set(range(1, s.speedup_max_k + 1)))
  v = {k: seconds(lab.target, k + 1) / target_1 for k in ks}
  c = seconds(lab.draft, 1) / target_1
  return {"c": c, "v": v, "target_step_seconds": target_1,
          "batch_size": s.batch_size, "context": s.prompt_len // 2}


def _timed_decoding(lab: Lab, prompt_ids, draft_params=None) -> tuple[float, dict]:
  """Seconds to decode all prompts (compile excluded), and speculative metrics."""
  s = lab.settings
  draft = (None if draft_params is None else
           Draft(ModelDraft(lab.draft.config), draft_params, "draft"))
  engine = Engine(lab.target, draft, k=s.k if draft else 0, sampling=Sampling(),
                  max_new_tokens=s.max_new_tokens, num_slots=s.batch_size,
                  cache_size=s.cache_size)
  # Compile every prompt bucket and attention window the timed run meets.
  engine.generate_ids(prompt_ids, s.seed)
  start = time.perf_counter()
  results = engine.generate_ids(prompt_ids, s.seed)
  seconds = time.perf_counter() - start
  sums = {}
  if draft is not None:
    sums = {"alpha_sum": sum(r.metrics["alpha"] for r in results),
            "alpha_count": float(len(results)),
            "emitted": float(sum(len(r.token_ids) for r in results)),
            "target_calls": sum(r.metrics["target_calls"] for r in results)}
  return seconds, sums


def run_speedup(lab: Lab) -> dict:
  """Predicted speed-up from measured alpha and cost ratios, beside the measured one."""
  s = lab.settings
  costs = measure_costs(lab)
  c, v = costs["c"], costs["v"][s.k]
  lab.log(f"[speedup] c = {c:.3f}, v_{s.k} = {v:.2f}")
  rows, points = [], []
  for domain in s.domains:
    drafts, eval_ids, _ = domain_drafts(lab, domain)
    target_seconds, _ = _timed_decoding(lab, eval_ids)
    for name, params in drafts.items():
      seconds, m = _timed_decoding(lab, eval_ids, params)
      alpha = m["alpha_sum"] / max(m["alpha_count"], 1.0)
      k_best, best = best_k(alpha, c)
      rows.append([domain, name, alpha, m["emitted"] / max(m["target_calls"], 1.0),
                   predicted_speedup(alpha, s.k, c, v),
                   predicted_speedup(alpha, s.k, c), f"{k_best} ({best:.2f})",
                   target_seconds / seconds])
      points.append((alpha, target_seconds / seconds))
  table = markdown(["data set", "draft", "alpha (eval)", "tokens per target call",
                    f"predicted, this CPU (k={s.k}, c, v)",
                    f"predicted, v=1 (k={s.k})", "best k, v=1 (speed-up)",
                    "measured wall-clock"], rows)
  v_text = ", ".join(f"v_{k}={x:.2f}" for k, x in costs["v"].items())
  notes = (f"Measured at batch {s.batch_size}, context {costs['context']}:"
           f" c = {c:.3f} (draft step / target step, target step"
           f" {costs['target_step_seconds'] * 1e3:.0f} ms), {v_text}. Predicted"
           " speed-up = (1 - a^(k+1)) / ((1 - a)(k c + v)); v = 1 is an"
           " accelerator at small batch. Measured: target-only over speculative"
           f" decoding time on the {s.num_eval} eval prompts (greedy, same tokens),"
           " compile excluded.")
  write(lab, "speedup", "Speed-up from acceptance and cost ratios", table, notes,
        {"costs": costs, "rows": rows})
  _plot(lab, points, c, v)
  return {"costs": costs, "rows": rows}


def _plot(lab: Lab, points, c: float, v: float) -> None:
  """Predicted speed-up curves over alpha, and the measured points."""
  k = lab.settings.k
  fig, ax = plots.plt.subplots(figsize=(7, 4))
  grid = np.linspace(0, 0.95, 96)
  ax.plot(grid, [predicted_speedup(a, k, c, v) for a in grid],
          label=f"predicted, this CPU (k={k}, c={c:.2f}, v={v:.2f})")
  ax.plot(grid, [predicted_speedup(a, k, c) for a in grid], ls="--",
          label=f"predicted, v=1 (k={k})")
  ax.scatter(*zip(*points), color="k", zorder=3, label="measured wall-clock")
  ax.axhline(1.0, color="grey", lw=1)
  ax.set_xlabel("alpha")
  ax.set_ylabel("speed-up over target-only")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(lab.output_dir, "speedup.png"), dpi=100)
  plots.plt.close(fig)
