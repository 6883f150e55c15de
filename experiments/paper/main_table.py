"""The paper's main table: alpha before, after offline and after online distillation."""

import os

from experiments.paper.lab import Lab, bars, domain_drafts, markdown, write

# The paper's Table (LLaMA-160M draft, Vicuna-7B target): before, offline, online.
PAPER_MAIN = {"sql": ("Spider", 0.28, 0.76, 0.74), "math": ("GSM8K", 0.58, 0.75, 0.76),
              "code": ("Code-search-Python", 0.38, 0.65, 0.67),
              "finance": ("Alpaca-finance", 0.57, 0.67, 0.70)}


def run_main(lab: Lab) -> dict:
  """Per data set: the starting, offline and online drafts' alpha."""
  s = lab.settings
  rows, results = [], {}
  for domain in s.domains:
    drafts, eval_ids, info = domain_drafts(lab, domain)
    evals = {name: lab.alpha(params, eval_ids) for name, params in drafts.items()}
    results[domain] = dict(info, eval={n: {k: v for k, v in e.items()
                                           if k not in ("alpha_per_request", "indices")}
                                       for n, e in evals.items()})
    published = PAPER_MAIN.get(domain)
    rows.append([domain, evals["before"]["alpha"], evals["offline"]["alpha"],
                 info["online_last_window"], evals["online"]["alpha"],
                 "/".join(f"{x:.2f}" for x in published[1:]) + f" ({published[0]})"
                 if published else "-"])
  table = markdown(["data set", "alpha before", "offline", "online (last window)",
                    "online (final, eval)", "paper: before/offline/online"], rows)
  notes = (f"k={s.k}, greedy, {s.max_new_tokens} new tokens; offline: {s.epochs}"
           f" epochs on the {s.num_train} stream prompts; online: the same"
           f" {s.num_train} requests once, an update every {s.update_interval}"
           f" ({s.update_steps} steps of {s.minibatch or 'all'} samples from the"
           f" last {s.buffer_capacity} served);"
           f" last window = last {s.window} requests; eval: {s.num_eval}"
           " held-out prompts.")
  write(lab, "main", "Alpha per data set: before, offline, online", table, notes,
        results)
  bars([r[0] for r in rows], {"before": [r[1] for r in rows],
                              "offline": [r[2] for r in rows],
                              "online (last window)": [r[3] for r in rows],
                              "online (final, eval)": [r[4] for r in rows]},
       os.path.join(lab.output_dir, "main.png"), "alpha",
       f"alpha per data set (k={s.k})")
  return results
