"""Figures shared by the experiments (matplotlib, Agg backend, PNG)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from osd_jax.serving.report import rolling_mean


def rolling_alpha(curves: dict[str, list[float]], path: str, *, window: int,
                  boundaries: list[tuple[int, str]] = (), title: str = "") -> None:
  """Rolling alpha over requests, one line per run, domain shifts marked."""
  fig, ax = plt.subplots(figsize=(8, 4))
  for label, alphas in curves.items():
    ax.plot(range(1, len(alphas) + 1), rolling_mean(alphas, window), label=label)
  for index, name in boundaries:
    ax.axvline(index, color="grey", ls=":", lw=1)
    ax.text(index, 1.0, f" {name}", va="top", fontsize=8, color="grey")
  ax.set_xlabel("requests served")
  ax.set_ylabel(f"alpha (rolling mean of {window})")
  ax.set_ylim(0, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def rolling_tokens_per_s(records: list[dict], window: int) -> list[float]:
  """Tokens/s over each run of `window` consecutive finishes."""
  by_finish = sorted(records, key=lambda r: r["finished_s"])
  out = []
  for i, r in enumerate(by_finish):
    first = max(i - window, -1)
    start = by_finish[first]["finished_s"] if first >= 0 else 0.0
    tokens = sum(x["new_tokens"] for x in by_finish[first + 1:i + 1])
    out.append(tokens / max(r["finished_s"] - start, 1e-9))
  return out


def stream_figures(records: dict[str, list[dict]], output_dir: str, *, window: int,
                   title: str) -> None:
  """alpha.png (rolling alpha of the speculative runs) and speed.png (tokens/s)."""
  import os  # pylint: disable=import-outside-toplevel
  served = next(iter(records.values()))
  ordered = sorted(served, key=lambda r: r["request"])
  boundaries = [(i + 1, r["domain"]) for i, r in enumerate(ordered)
                if i == 0 or r["domain"] != ordered[i - 1]["domain"]]
  curves = {name: [r["alpha"] for r in sorted(rs, key=lambda r: r["request"])]
            for name, rs in records.items() if name != "target"}
  if curves:
    rolling_alpha(curves, os.path.join(output_dir, "alpha.png"), window=window,
                  boundaries=boundaries, title=title)
  fig, ax = plt.subplots(figsize=(8, 4))
  for name, rs in records.items():
    speed = rolling_tokens_per_s(rs, window)
    ax.plot(range(1, len(speed) + 1), speed, label=name)
  for index, name in boundaries:
    ax.axvline(index, color="grey", ls=":", lw=1)
    ax.text(index, ax.get_ylim()[1], f" {name}", va="top", fontsize=8, color="grey")
  ax.set_xlabel("requests finished")
  ax.set_ylabel(f"tokens/s (last {window} requests)")
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  ax.set_title(title + ": wall-clock throughput")
  fig.tight_layout()
  fig.savefig(os.path.join(output_dir, "speed.png"), dpi=120)
  plt.close(fig)


def summary_table(summaries: list[dict]) -> str:
  """Per segment and last window: alpha, tokens per call, tokens/s, speed-up."""
  lines = [f"{'run':7s} {'segment':9s} {'requests':>8s} {'alpha':>6s}"
           f" {'tok/call':>8s} {'tok/s':>7s} {'speed-up':>8s}"]
  for s in summaries:
    rows = [(seg["domain"], seg["requests"], seg["alpha_last"],
             seg["tokens_per_call_last"], seg["tokens_per_s"], seg.get("speedup"))
            for seg in s["segments"]]
    last = s["last"]
    rows.append(("last", last["requests"], last["alpha"], last["tokens_per_call"],
                 last["tokens_per_s"], last.get("speedup")))
    for domain, n, alpha, per_call, tps, speedup in rows:
      up = f"{speedup:8.2f}" if speedup is not None else f"{'':8s}"
      lines.append(f"{s['run']:7s} {domain:9s} {n:8d} {alpha:6.3f} {per_call:8.2f}"
                   f" {tps:7.1f} {up}")
  lines.append("latency (ms)  " + "  ".join(
      f"{s['run']}: TTFT p50 {s['latency'].get('ttft_p50_ms', float('nan')):.0f}"
      f" p99 {s['latency'].get('ttft_p99_ms', float('nan')):.0f},"
      f" ITL p50 {s['latency'].get('itl_p50_ms', float('nan')):.1f}"
      f" p99 {s['latency'].get('itl_p99_ms', float('nan')):.1f}" for s in summaries))
  learned = [s for s in summaries if s.get("updates")]
  if learned:  # update_s: each update's call against calls of its shape without one
    lines.append("updates  " + "  ".join(
        f"{s['run']}: {s['updates']}, about {s.get('update_s', 0.0):.1f} s" for s in learned))
  return "\n".join(lines)
