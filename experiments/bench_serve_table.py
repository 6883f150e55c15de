"""bench_serve's result table, apart from its flags (so tests import it alone)."""

import math


def _figure(value: float, fmt: str, unit: str = "") -> str:
  """A table cell: '-' where there is no figure (NaN: target-only has no
  rolling alpha, a run without a target-only level no ratio)."""
  return "-" if math.isnan(value) else format(value, fmt) + unit


def table(results: list[dict]) -> str:
  """A markdown row per run and level, its speed against the target-only run
  at the same level (in the same turns: the run it was `beside`, if any)."""
  base = {(r.get("beside"), r["level"]): r["tokens_per_s"] for r in results
          if r["run"] == "target"}
  head = ("| run | load | requests | tokens/s | vs target | TTFT P50 / P99 ms |"
          " ITL P50 / P99 ms | alpha (level) | rolling alpha | updates |"
          " learning s (share) | saved s | plain calls |")
  rows = [head, "|" + "---|" * 13]
  for r in results:
    at = (r.get("beside"), r["level"])
    ratio = r["tokens_per_s"] / base[at] if at in base else float("nan")
    run = (f"target (beside {r['beside']})" if r["run"] == "target" and r.get("beside")
           else r["run"])
    rows.append(f"| {run} | {r['level']} | {r['requests']} |"
                f" {r['tokens_per_s']:.1f} | {_figure(ratio, '.2f', 'x')} |"
                f" {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} |"
                f" {r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} | {r['alpha']:.3f} |"
                f" {_figure(r['rolling_alpha'], '.3f')} | {r['updates']:.0f} |"
                f" {r['update_s']:.1f} ({r['learning_share']:.0%}) |"
                f" {r['saved_s']:.1f} | {r['plain_share']:.0%} |")
  return "\n".join(rows)
