"""What online learning costs and buys: throughput and alpha, learning on vs off, one run.

  python -m experiments.bench_online                    # real target, CPU defaults
  python -m experiments.bench_online --num_requests=48 --update_steps=1,4
  python -m experiments.bench_online --buffer_capacity=32 --minibatch=8 --update_steps=1,4

Serves the same stream with learning off, then with learning on for each
number of optimizer steps per update, once with each prompt's draft keys
and values recomputed by the update instead of kept from serving, and once
with the teacher recomputed by a target forward instead of kept from
verification, and once within a learning budget (--learning_budget: updates
take at most that share of serving time). Every program is
compiled before its stream is timed. Reports tokens/s, alpha over the first
and last window, and how fast each setting raises alpha per second of wall
clock: (alpha_last - alpha_first) / seconds.
Goal: learning on costs at most 10 % of serving throughput.
"""

import dataclasses

from absl import flags
import jax
import numpy as np

from experiments import cli, model_flags
from osd_jax.data import streams
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import driver, online

NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests per variant.")
SLOTS = flags.DEFINE_integer("slots", 8, "Decode slots.")
UPDATE_INTERVAL = flags.DEFINE_integer("update_interval", 8, "Requests per update.")
UPDATE_STEPS = flags.DEFINE_list("update_steps", ["1", "2", "4"],
                                 "Optimizer steps per update to compare.")
cli.require_positive_ints(UPDATE_STEPS)
BUFFER_CAPACITY = flags.DEFINE_integer("buffer_capacity", 16, "Samples kept.")
MINIBATCH = flags.DEFINE_integer(
    "minibatch", 0, "Samples per optimizer step, drawn from the ring each step"
    " (0: every step over the whole ring).", lower_bound=0)
K = flags.DEFINE_integer("k", 4, "Draft tokens per step.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per request.")
CACHE_SIZE = flags.DEFINE_integer("cache_size", 512, "Positions per slot.")
TEACHER_TOPK = flags.DEFINE_integer("teacher_topk", 32, "Top-k kept from verification.")
LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Draft learning rate.")
RECOMPUTED = flags.DEFINE_bool("recomputed_teacher", True,
                               "Also run with the teacher recomputed at update time.")
BUDGET = flags.DEFINE_float("learning_budget", 0.03, "Also run learning within this"
                            " share of serving time (0: not).", lower_bound=0.0,
                            upper_bound=0.99)
DOMAIN = flags.DEFINE_string("domain", "math", "Stream domain.")
WINDOW = flags.DEFINE_integer("window", 16, "Requests in the first/last window.")


def _timed_run(target, draft, queries, cfg, mesh, budget=0.0) -> dict:
  """Tokens/s of the stream, alpha first/last, updates (compiles excluded)."""
  records = []
  driver.run_stream(target, draft, queries, cfg, num_slots=SLOTS.value, mesh=mesh,
                    on_request=records.append, compile_first=True,
                    learning_budget=budget)
  records = [r for r in records if not r.get("error")]
  seconds = max(r["finished_s"] for r in records)
  by_request = sorted(records, key=lambda r: r["request"])
  window = WINDOW.value
  return {"tokens_per_s": sum(r["new_tokens"] for r in records) / seconds,
          "seconds": seconds,
          "alpha_first": float(np.mean([r["alpha"] for r in by_request[:window]])),
          "alpha_last": float(np.mean([r["alpha"] for r in by_request[-window:]])),
          "updates": sum(r.get("updates", 0) for r in records)}


def main(argv):
  del argv
  cli.refuse_unread(model_flags, model_flags.all_flags_but(model_flags.TRIMMED_ONLY_FLAGS),
                    "it verifies at full width, where these settings do not apply"
                    " (the serving entry points' --trim_verify)")
  target = model_flags.load_target()
  draft = model_flags.load_draft(target)
  mesh = online.make_mesh(1)
  queries = [driver.Query(q.prompt, "default", q.domain) for q in
             streams.make_stream("single", [DOMAIN.value], NUM_REQUESTS.value)]
  base = online.OnlineConfig(
      k=K.value, sampling=Sampling(), max_new_tokens=MAX_NEW_TOKENS.value,
      cache_size=CACHE_SIZE.value, update_interval=UPDATE_INTERVAL.value,
      buffer_capacity=BUFFER_CAPACITY.value, clear_after_update=False,
      minibatch=MINIBATCH.value, teacher_k=TEACHER_TOPK.value, loss_weighting="all",
      distill=DistillConfig(learning_rate=LEARNING_RATE.value))
  variants = {"learning off": dataclasses.replace(base, learn=False)}
  for steps in [int(s) for s in UPDATE_STEPS.value]:
    variants[f"on, {steps} step(s) per update"] = dataclasses.replace(
        base, update_steps=steps)
  variants["on, 1 step, prompts recomputed"] = dataclasses.replace(
      base, keep_prompt_cache=False)
  if RECOMPUTED.value:
    variants["on, 1 step, teacher recomputed"] = dataclasses.replace(base, teacher_k=0)
  budgets = {}  # variant -> learning budget
  if BUDGET.value:
    name = f"on, 1 step, budget {BUDGET.value:g}"
    variants[name], budgets[name] = base, BUDGET.value
  results = {}
  for name, cfg in variants.items():
    print(f"running: {name}", flush=True)
    results[name] = _timed_run(target, draft, queries, cfg, mesh, budgets.get(name, 0.0))
  off = results["learning off"]
  print(f"\n{'variant':32s} {'tokens/s':>9s} {'vs off':>7s} {'alpha first':>11s}"
        f" {'alpha last':>10s} {'updates':>7s} {'alpha gain/s':>12s}")
  for name, r in results.items():
    gain = (r["alpha_last"] - r["alpha_first"]) / r["seconds"]
    print(f"{name:32s} {r['tokens_per_s']:9.2f} {r['tokens_per_s'] / off['tokens_per_s']:7.3f}"
          f" {r['alpha_first']:11.3f} {r['alpha_last']:10.3f} {r['updates']:7d}"
          f" {gain:12.5f}")
  state = online.init_state(draft.params, draft.drafter, target.config, base,
                            num_devices=1, num_slots=1, seed=0)
  per_sample = sum(x.nbytes for x in jax.tree.leaves(state.buffer)) / base.buffer_capacity
  print(f"buffer: {per_sample / 1024:.1f} KiB per sample ({base.sample_len}"
        f" positions, top-{base.teacher_k} teacher)")
  worst = min(r["tokens_per_s"] / off["tokens_per_s"]
              for n, r in results.items() if n != "learning off")
  print(f"goal: learning costs <= 10 % of throughput -> worst ratio {worst:.3f}"
        f" ({'met' if worst >= 0.9 else 'missed'})")


if __name__ == "__main__":
  cli.run(main)
