"""bench_serve's turns and a level's figures, apart from its flags (so tests
import them alone).

Servers measured one after another are minutes apart, and a shared host's
speed drifts by 20-40 % over hours: a gap of 10 % between two servers may be
the hour, not the server. In turns, the servers compared stay up together
and a level's requests go out in slices, each served by every one of them in
a rotating order, so a slow minute slows all of them alike.
"""

import numpy as np

# The server's counters whose differences a level reports, by field.
COUNTERS = {"updates": "osd:draft_updates_total", "update_s": "osd:update_seconds_total",
            "saved_s": "osd:speculation_saved_seconds",
            "plain_calls": "osd:plain_calls_total", "serve_calls": "osd:serve_calls_total",
            "serve_s": "osd:serve_seconds_total"}


def slices(questions: list, turns: int) -> list[list]:
  """The questions in `turns` contiguous slices of near-equal size, in order
  (every server sees the same questions in the same order overall)."""
  if turns < 1:
    raise ValueError(f"turns must be at least 1, got {turns}.")
  turns = min(turns, max(len(questions), 1))
  bounds = [i * len(questions) // turns for i in range(turns + 1)]
  return [questions[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def order(names: list[str], turn: int) -> list[str]:
  """The servers' order in a turn: rotated by one each turn, so over as many
  turns as servers each one goes first, second, ... once."""
  shift = turn % len(names)
  return names[shift:] + names[:shift]


def counter_deltas(before: dict, after: dict) -> dict:
  """The level's counters: each one's difference between two scrapes."""
  return {field: after[name] - before[name] for field, name in COUNTERS.items()}


def figures(records: list[dict], seconds: float, deltas: dict) -> dict:
  """A level's figures from its requests' records (refusals included), the
  seconds its turns took together and its counters' differences summed
  over the turns."""
  refused = sum(1 for r in records if r.get("refused"))
  records = [r for r in records if not r.get("refused")]
  pct = lambda key, q: (float(np.percentile([r[key] for r in records], q))
                        if records else float("nan"))
  share = lambda part, whole: (deltas[part] / deltas[whole] if deltas[whole]
                               else float("nan"))  # NaN: no calls
  return {"requests": len(records), "refused": refused,
          "tokens_per_s": sum(r["tokens"] for r in records) / seconds,
          "ttft_p50_ms": 1e3 * pct("ttft_s", 50), "ttft_p99_ms": 1e3 * pct("ttft_s", 99),
          "itl_p50_ms": 1e3 * pct("itl_s", 50), "itl_p99_ms": 1e3 * pct("itl_s", 99),
          "alpha": float(np.mean([r["alpha"] for r in records])) if records else float("nan"),
          "updates": deltas["updates"], "update_s": deltas["update_s"],
          "saved_s": deltas["saved_s"],
          "plain_share": share("plain_calls", "serve_calls"),
          "learning_share": share("update_s", "serve_s")}
