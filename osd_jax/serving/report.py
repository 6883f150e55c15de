"""Per-request records to JSONL, TensorBoard and a progress line; rolling alpha."""

import json
import os
import time

import numpy as np


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
  """Writes every record; prints progress every `every` requests."""

  def __init__(self, output_dir: str, name: str, *, window: int = 64,
               every: int = 16, tensorboard: bool = True, append: bool = False):
    os.makedirs(output_dir, exist_ok=True)
    self.name, self.window, self.every = name, window, every
    self.jsonl = open(os.path.join(output_dir, f"{name}.jsonl"),
                      "a" if append else "w")
    self.writer = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard", name))
    self.alphas, self.tokens, self.losses = [], 0, []
    self.skipped = 0
    self.start = time.perf_counter()

  def __call__(self, record: dict) -> None:
    self.jsonl.write(json.dumps(record) + "\n")
    if record.get("skipped"):
      self.skipped += 1
      return
    self.alphas.append(record["alpha"])
    self.tokens += record["new_tokens"]
    n = record["served"]
    if record.get("loss") is not None:
      self.losses.append(record["loss"])
    if self.writer is not None:
      self.writer.add_scalar("alpha", record["alpha"], n)
      self.writer.add_scalar("acceptance_rate", record["acceptance_rate"], n)
      self.writer.add_scalar("tokens_per_target_call",
                             record["tokens_per_target_call"], n)
      if record.get("loss") is not None:
        self.writer.add_scalar("loss", record["loss"], n)
    if n % self.every == 0:
      seconds = time.perf_counter() - self.start
      rolling = np.mean(self.alphas[-self.window:])
      loss = f", loss {self.losses[-1]:.3f}" if self.losses else ""
      print(f"[{self.name}] {n} requests, rolling alpha {rolling:.3f},"
            f" {self.tokens / seconds:.1f} tokens/s{loss}", flush=True)

  def close(self) -> None:
    self.jsonl.close()
    if self.writer is not None:
      self.writer.close()


def read_jsonl(path: str) -> list[dict]:
  """Served (not skipped) records of a run, in serving order."""
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return sorted((r for r in records if not r.get("skipped")),
                key=lambda r: r["served"])
