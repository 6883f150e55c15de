"""Every draft kind on the same shifting stream: alpha, tokens per target call, speed-up.

  python -m experiments.bench_drafts
  python -m experiments.bench_drafts --kinds=ngram,derived+ngram --per_domain=8

One run serves the stream target-only and once per draft kind (learning
online where the kind has parameters), the passes taking turns every --turn
requests so that a drift in the machine's speed slows all alike, and prints,
per segment and overall, alpha, tokens per target call, tokens/s and the
speed-up over target-only. A kind is derived, eagle or ngram; "+ngram" makes
it a hybrid. The draft flags (--ngram_min, --draft_confidence_threshold, ...)
apply to every kind. Every program is compiled before its stream is timed.
"""

import dataclasses
import json
import os

from absl import flags

from experiments import cli, model_flags
from osd_jax.data import streams
from osd_jax.decoding import drafts
from osd_jax.decoding.drafts import Draft, NoDraft
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import driver, online
from osd_jax.serving.report import speed_summary

KINDS = flags.DEFINE_list(
    "kinds", ["derived", "eagle", "ngram", "derived+ngram", "eagle+ngram"],
    "Draft kinds to compare.")
DOMAINS = flags.DEFINE_list("domains", ["math", "sql", "code"], "Segments, in order.")
PER_DOMAIN = flags.DEFINE_integer("per_domain", 24, "Requests per segment.")
SLOTS = flags.DEFINE_integer("slots", 8, "Decode slots.")
K = flags.DEFINE_integer("k", 4, "Draft tokens per step.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per request.")
CACHE_SIZE = flags.DEFINE_integer("cache_size", 512, "Positions per slot.")
UPDATE_INTERVAL = flags.DEFINE_integer("update_interval", 8, "Requests per update.")
UPDATE_STEPS = flags.DEFINE_integer("update_steps", 1, "Optimizer steps per update.")
LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Draft learning rate.")
TAIL = flags.DEFINE_integer("tail", 8, "Requests in each segment's last window.")
TURN = flags.DEFINE_integer(
    "turn", None, "Requests each pass serves before the next takes its turn;"
    " 0 serves each pass whole. A turn's end drains the slots, so with several"
    " slots keep it long. Default: 2 with one slot, a segment otherwise.")
OUTPUT = flags.DEFINE_string("output", "", "Also write the results here (JSON).")


def draft_of(kind: str, target) -> Draft:
  """The Draft that a kind name stands for (model_flags builds it)."""
  base, _, hybrid = kind.partition("+")
  if not base or hybrid not in ("", "ngram"):
    raise ValueError(f"Unknown draft kind {kind!r}.")
  return model_flags.load_draft(target, base, hybrid=bool(hybrid))


def main(argv):
  del argv
  cli.refuse_unread(
      model_flags, model_flags.all_flags_but(
          (model_flags.DRAFT.name, model_flags.HYBRID.name), model_flags.TRIMMED_ONLY_FLAGS),
      "--kinds names the drafts, and they verify at full width (the serving entry"
      " points' --trim_verify)")
  target = model_flags.load_target()
  queries = [driver.Query(r.prompt, "default", r.domain) for r in streams.make_stream(
      "shift", DOMAINS.value, PER_DOMAIN.value * len(DOMAINS.value), seed=0)]
  cfg = online.OnlineConfig(
      k=K.value, sampling=Sampling(), max_new_tokens=MAX_NEW_TOKENS.value,
      cache_size=CACHE_SIZE.value, update_interval=UPDATE_INTERVAL.value,
      update_steps=UPDATE_STEPS.value, buffer_capacity=2 * UPDATE_INTERVAL.value,
      clear_after_update=False, loss_weighting="all",
      distill=DistillConfig(learning_rate=LEARNING_RATE.value))
  mesh = online.make_mesh(1)
  runs = {"target": (Draft(NoDraft(target.config.vocab_size), (), "none"),
                     dataclasses.replace(cfg, k=0, learn=False))}
  for kind in KINDS.value:
    draft = draft_of(kind, target)
    runs[kind] = (draft, dataclasses.replace(cfg, learn=draft.params != ()))
  records = {name: [] for name in runs}
  turn = TURN.value if TURN.value is not None else (
      2 if SLOTS.value == 1 else PER_DOMAIN.value)
  if turn < 0:
    raise ValueError(f"--turn must be >= 0, got {turn}.")
  pauses = range(turn, len(queries), turn) if turn else ()
  serving = {}
  for name, (draft, run_cfg) in runs.items():
    print(f"serving: {name} ({draft.source})", flush=True)
    serving[name] = driver.serve_stream(
        target, draft, queries, run_cfg, num_slots=SLOTS.value, mesh=mesh,
        on_request=records[name].append, compile_first=True, pauses=pauses)
  driver.serve_in_turns(serving, interleave=bool(turn))
  results = {name: speed_summary([r for r in rs if not r.get("error")], tail=TAIL.value)
             for name, rs in records.items()}
  base = results["target"]
  print(f"\n{'draft':16s} {'segment':8s} {'alpha':>6s} {'tok/call':>8s} {'tok/s':>7s}"
        f" {'speed-up':>8s}")
  for name, r in results.items():
    for seg, ref in zip(r["segments"], base["segments"]):
      seg["speedup"] = seg["tokens_per_s"] / ref["tokens_per_s"]
      print(f"{name:16s} {seg['domain']:8s} {seg['alpha_last']:6.3f}"
            f" {seg['tokens_per_call_last']:8.2f} {seg['tokens_per_s']:7.1f}"
            f" {seg['speedup']:8.2f}")
    r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
    print(f"{name:16s} {'all':8s} {'':6s} {'':8s} {r['tokens_per_s']:7.1f}"
          f" {r['speedup']:8.2f}")
  print("\nacceptance by draft position over the last window (given it was reached):")
  for name, r in results.items():
    by_position = r["last"]["acceptance_by_position"]
    if by_position:
      print(f"{name:16s} " + " ".join(f"{a:.2f}" for a in by_position))
  if OUTPUT.value:
    os.makedirs(os.path.dirname(OUTPUT.value) or ".", exist_ok=True)
    with open(OUTPUT.value, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  cli.run(main)
