"""One draft per category (language or topic) versus one shared draft."""

import os

import numpy as np

from experiments.paper.lab import Lab, bars, last_window, markdown, write
from osd_jax.data import TRAIN


def run_categories(lab: Lab) -> dict:
  """Static, one shared online and per-category online drafts on a balanced stream."""
  s = lab.settings
  cats = list(s.categories)
  reqs, ids = lab.requests("category", s.category_domains,
                           s.requests_per_category * len(cats), TRAIN,
                           category_key=s.category_key, categories=cats)
  static = lab.alpha(lab.draft.params, ids)["alpha_per_request"]
  shared, _ = lab.online("online_shared", reqs, 1, cats)
  per_cat, _ = lab.online("online_per_category", reqs, len(cats), cats)
  window = max(1, min(s.window, s.requests_per_category // 2))
  rows = []
  for cat in cats:
    of = lambda records: [r for r in records if r["category"] == cat]
    static_cat = [a for a, r in zip(static, reqs) if r.category == cat]
    rows.append([cat, len(static_cat), float(np.mean(static_cat)),
                 last_window(of(shared), window), last_window(of(per_cat), window)])
  rows.append(["all", len(reqs), float(np.mean(static)),
               last_window(shared, window * len(cats)),
               last_window(per_cat, window * len(cats))])
  table = markdown([s.category_key, "requests", "static (before)",
                    "one shared draft (last window)",
                    "one draft per category (last window)"], rows)
  notes = (f"{s.category_key} categories {cats} of {list(s.category_domains)},"
           f" balanced stream; last window = each category's last {window}"
           f" requests; k={s.k}. Paper (Chatbot-arena by language): +0.1 to +0.2"
           " alpha within 2K requests per language.")
  write(lab, "categories", f"Per-{s.category_key} drafts versus one shared draft",
        table, notes, {"rows": rows})
  bars([r[0] for r in rows], {"static": [r[2] for r in rows],
                              "shared online": [r[3] for r in rows],
                              "per-category online": [r[4] for r in rows]},
       os.path.join(lab.output_dir, "categories.png"), "alpha",
       f"per-{s.category_key} drafts (k={s.k})")
  return {"rows": rows}
