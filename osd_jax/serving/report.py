"""Per-request records to JSONL, TensorBoard and a progress bar; rolling alpha and speed."""

import json
import os

import numpy as np

from osd_jax import progress


def rolling_mean(values, window: int) -> np.ndarray:
  """Mean of the last `window` values at each point (fewer at the start)."""
  values = np.asarray(values, np.float64)
  if not len(values):
    return values
  sums = np.cumsum(np.insert(values, 0, 0.0))
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(ends - window, 0)
  return (sums[ends] - sums[starts]) / (ends - starts)


class Reporter:
  """Writes every record; shows a progress bar with rolling alpha and tokens/s."""

  def __init__(self, output_dir: str, name: str, *, total: int, window: int = 64,
               tensorboard: bool = True, append: bool = False):
    os.makedirs(output_dir, exist_ok=True)
    self.name, self.window = name, window
    self.jsonl = open(os.path.join(output_dir, f"{name}.jsonl"),
                      "a" if append else "w")
    self.writer = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard", name))
    self.alphas, self.tokens, self.losses = [], 0, []
    self.errors = 0
    self.serving_s = 0.0  # the latest finish on the serving clock
    self.bar = progress.bar(total, f"[{name}]", "requests", delay=0.0)

  def __call__(self, record: dict) -> None:
    self.jsonl.write(json.dumps(record) + "\n")
    self.bar.update(1)
    if record.get("error"):
      self.errors += 1
      return
    self.alphas.append(record["alpha"])
    self.tokens += record["new_tokens"]
    n = record["served"]
    if record.get("loss") is not None:
      self.losses.append(record["loss"])
    if self.writer is not None:
      for key in ("alpha", "acceptance_rate", "tokens_per_target_call"):
        self.writer.add_scalar(key, record[key], n)
      if record.get("loss") is not None:
        self.writer.add_scalar("loss", record["loss"], n)
    # On the stream's serving clock, which leaves out compiling, checkpoint
    # saves and the turns of other passes served in between (records
    # stripped of their timings leave it where it was).
    self.serving_s = record.get("finished_s", self.serving_s)
    status = dict(alpha=f"{np.mean(self.alphas[-self.window:]):.3f}")
    if self.serving_s > 0:
      status["tok_s"] = f"{self.tokens / self.serving_s:.1f}"
    if self.losses:
      status["loss"] = f"{self.losses[-1]:.3f}"
    self.bar.set_postfix(status, refresh=False)

  def close(self) -> None:
    self.bar.close()
    self.jsonl.close()
    if self.writer is not None:
      self.writer.close()


def read_jsonl(path: str) -> list[dict]:
  """Served (not refused) records of a run, in the order they finished.

  A run resumed from a checkpoint serves again the requests that finished
  after it, and appends their records: each request counts once, by its
  latest record.
  """
  latest = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        record = json.loads(line)
        latest[record["request"]] = record
  return sorted((r for r in latest.values() if not r.get("error")),
                key=lambda r: r["served"])


def tokens_per_second(records: list[dict], before: float = 0.0) -> float:
  """New tokens of `records` over the wall time from `before` to the last finish."""
  if not records:
    return float("nan")
  span = max(r["finished_s"] for r in records) - before
  return sum(r["new_tokens"] for r in records) / span if span > 0 else float("nan")


def segments(records: list[dict]) -> list[tuple[str, list[dict]]]:
  """Consecutive runs of one domain in stream order: [(domain, records)]."""
  out = []
  for r in sorted(records, key=lambda r: r["request"]):
    if not out or out[-1][0] != r["domain"]:
      out.append((r["domain"], []))
    out[-1][1].append(r)
  return out


def speed_summary(records: list[dict], *, tail: int) -> dict:
  """Per segment and over the last `tail` requests: alpha, tokens per call, tokens/s.

  A segment's tokens/s is its tokens over the time from the previous
  segment's last finish to its own: with continuous batching, requests of
  neighbouring segments share calls, so the boundaries are approximate.
  """
  mean = lambda key, part: float(np.mean([r[key] for r in part])) if part else float("nan")
  out, before = {"segments": []}, 0.0
  for domain, part in segments(records):
    last = part[-tail:]
    out["segments"].append({
        "domain": domain, "requests": len(part),
        "alpha_first": mean("alpha", part[:tail]), "alpha_last": mean("alpha", last),
        "tokens_per_call_last": mean("tokens_per_target_call", last),
        "tokens_per_s": tokens_per_second(part, before), **learned_draft(part)})
    before = max(r["finished_s"] for r in part)
  by_finish = sorted(records, key=lambda r: r["finished_s"])
  window = by_finish[-tail:]
  start = by_finish[-tail - 1]["finished_s"] if len(by_finish) > tail else 0.0
  out["last"] = {"requests": len(window), "alpha": mean("alpha", window),
                 "tokens_per_call": mean("tokens_per_target_call", window),
                 "tokens_per_s": tokens_per_second(window, start)}
  out["last"]["acceptance_by_position"] = acceptance_by_position(window)
  out["tokens_per_s"] = tokens_per_second(records)
  out["latency"] = latency_percentiles(records)
  return out


def learned_draft(records: list[dict]) -> dict:
  """What a gated hybrid's learned draft did in `records` (lookup did the
  rest): the tokens it proposed, how many were accepted, and its share of
  all proposed tokens; {} for other drafts."""
  if not any("draft_proposed" in r for r in records):
    return {}
  proposed = sum(r.get("draft_proposed", 0) for r in records)
  accepted = sum(r.get("draft_accepted", 0) for r in records)
  everyone = sum(r["proposed"] for r in records)
  return {"draft_proposed": proposed, "draft_accepted": accepted,
          "draft_share": proposed / everyone if everyone else 0.0}


def learning_lines(summaries: list[dict]) -> str:
  """Per run: the learned draft's proposals and accepted tokens per segment,
  and learning's seconds and share of serving time."""
  lines = []
  for s in summaries:
    parts = [f"{seg['domain']} {seg['draft_proposed']} proposed,"
             f" {seg['draft_accepted']} accepted ({seg['draft_share']:.0%} of all"
             " proposed tokens)" for seg in s["segments"] if "draft_proposed" in seg]
    if parts:
      lines.append(f"{s['run']} learned draft: " + "; ".join(parts))
    if s.get("updates"):
      lines.append(f"{s['run']} learning: {s['updates']}"
                   f" update{'s' if s['updates'] != 1 else ''},"
                   f" {s['update_s']:.1f} s, {s['update_share']:.1%} of serving time;"
                   f" the learned draft saved about {s['draft_saved_s']:.1f} s")
  return "\n".join(lines)


def learning_cost(records: list[dict]) -> dict:
  """Updates, their seconds, and those seconds' share of the serving time
  (the last finish on the serving clock, updates included); what the
  learned draft's accepted tokens saved, as the learning payback prices them."""
  seconds = sum(r.get("update_s", 0.0) for r in records)
  serving = max((r.get("finished_s", 0.0) for r in records), default=0.0)
  return {"updates": sum(r.get("updates", 0) for r in records), "update_s": seconds,
          "update_share": seconds / serving if serving > 0 else 0.0,
          "draft_saved_s": sum(r.get("draft_saved_s", 0.0) for r in records)}


def acceptance_by_position(records: list[dict]) -> list[float]:
  """Per draft position i: accepted / verified, summed over `records`.

  Position i is verified only when 1..i-1 were accepted, so this is the
  acceptance of step i given that the draft got that far.
  """
  reached = np.sum([r.get("reached_by_position", []) for r in records], axis=0)
  accepted = np.sum([r.get("accepted_by_position", []) for r in records], axis=0)
  if not np.ndim(reached):
    return []
  return [float(a / r) if r else float("nan") for a, r in zip(accepted, reached)]


def latency_percentiles(records: list[dict]) -> dict:
  """P50 and P99 of queue wait, time to first token and inter-token latency (ms)."""
  out = {}
  for key in ("queue_s", "ttft_s", "itl_s"):
    values = [r[key] for r in records if r.get(key) is not None]
    if values:
      name = key[:-2]
      out[f"{name}_p50_ms"] = float(np.percentile(values, 50) * 1e3)
      out[f"{name}_p99_ms"] = float(np.percentile(values, 99) * 1e3)
  return out
