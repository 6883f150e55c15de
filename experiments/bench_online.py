"""What online learning costs: serving throughput with learning on vs off, one run.

  python -m experiments.bench_online                    # real target, CPU defaults
  python -m experiments.bench_online --num_requests=48  # shorter

Serves the same stream three times: learning off (update interval beyond the
stream), learning on with the teacher kept from verification (top-k), and
learning on with the teacher recomputed by a target forward at update time.
The first batch of each (compilation) is excluded from every timing.
Goal: learning on costs at most 10 % of serving throughput.
"""

import dataclasses

from absl import app, flags
import jax
import numpy as np

from experiments import cli, model_flags
from osd_jax.data import streams
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import driver, online

NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests per variant.")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Requests per batch.")
UPDATE_INTERVAL = flags.DEFINE_integer("update_interval", 8, "Requests per update.")
K = flags.DEFINE_integer("k", 4, "Draft tokens per step.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 32, "Tokens per request.")
PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt capacity.")
TEACHER_TOPK = flags.DEFINE_integer("teacher_topk", 32, "Top-k kept from verification.")
DOMAIN = flags.DEFINE_string("domain", "math", "Stream domain.")


def _timed_run(target, draft, queries, cfg, mesh) -> dict:
  """Serving seconds and tokens, and per-batch seconds with/without an update."""
  records = []
  driver.run_stream(target, draft, queries, cfg, batch_size=BATCH_SIZE.value,
                    mesh=mesh, categories=("math",), on_request=records.append)
  batches = {}
  for r in records:
    if not r.get("skipped"):
      batch = batches.setdefault(r["batch"], {"seconds": r["batch_seconds"],
                                              "tokens": 0, "update": False})
      batch["tokens"] += r["new_tokens"]
      batch["update"] |= r["loss"] is not None
  timed = [b for i, b in sorted(batches.items()) if i > 0]  # skip compile
  seconds = sum(b["seconds"] for b in timed)
  tokens = sum(b["tokens"] for b in timed)
  with_update = [b["seconds"] for b in timed if b["update"]]
  without = [b["seconds"] for b in timed if not b["update"]]
  return {"tokens_per_s": tokens / seconds, "seconds": seconds,
          "batch_s_with_update": float(np.mean(with_update)) if with_update else None,
          "batch_s_without": float(np.mean(without)) if without else None}


def main(argv):
  del argv
  target = model_flags.load_target()
  draft = model_flags.load_draft(target)
  mesh = online.make_mesh(1)
  queries = streams.make_stream("single", [DOMAIN.value], NUM_REQUESTS.value)
  queries = [dataclasses.replace(q, category="math") for q in queries]
  base = online.OnlineConfig(
      k=K.value, sampling=Sampling(), max_new_tokens=MAX_NEW_TOKENS.value,
      prompt_len=PROMPT_LEN.value, update_interval=UPDATE_INTERVAL.value,
      buffer_capacity=UPDATE_INTERVAL.value, teacher_k=TEACHER_TOPK.value,
      distill=DistillConfig(learning_rate=1e-3))
  variants = {
      "learning off": dataclasses.replace(base, update_interval=len(queries) + 1),
      f"on, teacher top-{TEACHER_TOPK.value} kept": base,
      "on, teacher recomputed": dataclasses.replace(base, teacher_k=0),
  }
  results = {}
  for name, cfg in variants.items():
    print(f"running: {name}", flush=True)
    results[name] = _timed_run(target, draft, queries, cfg, mesh)
  off = results["learning off"]["tokens_per_s"]
  print(f"\n{'variant':34s} {'tokens/s':>9s} {'vs off':>7s} {'batch s (upd)':>14s}"
        f" {'batch s (no upd)':>16s}")
  for name, r in results.items():
    upd = f"{r['batch_s_with_update']:.2f}" if r["batch_s_with_update"] else "-"
    print(f"{name:34s} {r['tokens_per_s']:9.2f} {r['tokens_per_s'] / off:7.3f}"
          f" {upd:>14s} {r['batch_s_without'] or float('nan'):16.2f}")
  for name, r in results.items():
    if r["batch_s_with_update"] and r["batch_s_without"]:
      print(f"one update ({name}): ~{r['batch_s_with_update'] - r['batch_s_without']:.2f} s"
            " (batch with update minus batch without)")
  buffer = online.init_state(draft.params, base, 1, 0).buffer
  per_sample = sum(x.nbytes for x in jax.tree.leaves(buffer)) / base.buffer_capacity
  print(f"buffer: {per_sample / 1024:.1f} KiB per sample (max_len {base.max_len},"
        f" top-{base.teacher_k} teacher); without the teacher:"
        f" {(base.max_len * 4 + base.max_new_tokens * 4 + 9) / 1024:.1f} KiB")
  worst = min(r["tokens_per_s"] / off for n, r in results.items() if n != "learning off")
  print(f"goal: learning costs <= 10 % of throughput -> worst ratio {worst:.3f}"
        f" ({'met' if worst >= 0.9 else 'missed'})")


if __name__ == "__main__":
  cli.run(main)
