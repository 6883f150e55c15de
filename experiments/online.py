"""The main job: serve a shifting query stream, distilling the draft online, and time it.

  python -m experiments.online --output_dir=outputs/online            # defaults
  python -m experiments.online --num_requests=48 --output_dir=/tmp/o  # a quick look

Serves the same stream four times with continuous batching: target-only,
speculatively with the draft kept static, learning online, and with n-gram
lookup alone (the zero-training baseline a user would try first). The
passes take turns, 8 requests each at one slot (--turn) and a turn ending
at every domain change, so each stretch's timings are seconds apart rather
than a whole pass apart (a shared host's speed drifts, by half within an
hour on the development machine). Reports alpha, tokens per target call, tokens/s
and the speed-up over target-only per segment and over the last window, and
plots alpha and tokens/s.
"""

import dataclasses
import json
import os

from absl import app, flags

from experiments import (cli, compilation_cache, learning_flags, model_flags,
                         multihost_flags, plots, step_flags, verify_flags)
from osd_jax.data import streams
from osd_jax.decoding.drafts import Draft, HybridDraft, NoDraft
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import samples
from osd_jax.serving import distributed, driver, online
from osd_jax.serving.checkpoint import Checkpointer
from osd_jax.serving.report import (Reporter, learning_cost, learning_lines,
                                   read_jsonl, speed_summary)

# Serving.
K = flags.DEFINE_integer("k", 4, "Draft tokens per speculative step.", lower_bound=1)
TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Serving temperature; 0 = greedy.")
TOP_P = flags.DEFINE_float("top_p", 1.0, "Serving nucleus mass.")
TOP_K = flags.DEFINE_integer("top_k", 0, "Serving top-k; 0 = off.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per request.")
CACHE_SIZE = flags.DEFINE_integer(
    "cache_size", 512, "Positions per slot: prompt + max_new_tokens + k must fit;"
    " a longer request gets an error record and the stream goes on.")
SLOTS = flags.DEFINE_integer(
    "slots", 1, "Decode slots (requests in flight), all devices. 1 is the"
    " latency regime where speculation pays on a CPU; see README for 8.")
STEPS_PER_CALL = flags.DEFINE_integer(
    "steps_per_call", 8, "Most speculative steps per compiled call between slot"
    " refills; a call ends sooner when a slot finishes and requests wait.")
DEVICES = flags.DEFINE_string("devices", "all", "'all' or how many local devices.")
CHAT = flags.DEFINE_bool("chat", True, "Wrap queries in the chat template.")
PASSES = ("target", "static", "online", "ngram")
RUNS = flags.DEFINE_list(
    "runs", list(PASSES),
    "Which passes over the stream: target (target-only), static (the draft"
    " never learns), online (the draft learns as it serves), ngram (n-gram"
    " lookup alone, --ngram_min..--ngram_max, in the request and the last"
    " --ngram_history requests of its device: no parameters). Lookup's history"
    " is on in every speculative pass.")
# Learning.
SAMPLE_SOURCE = flags.DEFINE_enum("sample_source", "served", list(samples.SOURCES),
                                  "Where training tokens come from.")
SOURCE_MIX = flags.DEFINE_float("source_mix", 0.5, "Target share for mixed sources.")
SCHEDULE = flags.DEFINE_enum("schedule", "constant",
                             ["constant", "cosine", "linear_warmup"], "LR schedule.")
NUM_DRAFTS = flags.DEFINE_enum(
    "drafts", "one", ["one", "per_category"],
    "One shared draft, or one draft per request category.")
# Stream.
STREAM = flags.DEFINE_enum("stream", "shift", list(streams.stream_names()), "Stream kind.")
DOMAINS = flags.DEFINE_list("domains", ["math", "sql", "code"], "Domains, in order.")
NUM_REQUESTS = flags.DEFINE_integer("num_requests", 240, "Requests in the stream.")
CATEGORY_KEY = flags.DEFINE_enum("category_key", "domain", ["domain", "language"],
                                 "What routes a request to a per-category draft.")
MANUAL_DIR = flags.DEFINE_string("manual_dir", None, "Folder of the paper's data sets.")
SEED = flags.DEFINE_integer("seed", 0, "Stream and sampling seed.")
# Output and checkpoints.
OUTPUT_DIR = flags.DEFINE_string("output_dir", "outputs/online", "Where results go.")
CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Orbax checkpoints (default OUTPUT_DIR/checkpoints).")
CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 64, "Requests between saves.")
RESUME = flags.DEFINE_bool("resume", False, "Continue the run in --checkpoint_dir.")
model_flags.serve_with_the_best_draft()
learning_flags.learn_with_replay()
# The loss lands where the hybrid calls on the draft, the steps lookup missed.
flags.set_default(learning_flags.LOSS_WEIGHTING, "lookup_missed")
# Each second of learning is a second of serving lost: updates may take at
# most 15 % of it, the issue's ceiling at one slot (README, "What online
# learning costs"; 0 restores an update every --update_interval requests).
flags.set_default(learning_flags.LEARNING_BUDGET, 0.15)
GATE_EXPLORE = flags.DEFINE_integer(
    "gate_explore", 4, "With a gated hybrid (static and online passes alike):"
    " a closed gate still runs the learned draft on every n-th step of a"
    " request where lookup misses, so it sees a draft that has learned; 0:"
    " only on a request's first steps.", lower_bound=0)

INTERLEAVE = flags.DEFINE_bool(
    "interleave", True, "Serve the passes in turns (a turn ends where the"
    " domain changes, after at least --window requests, and every --turn"
    " requests); off: each pass serves the whole stream before the next starts.")
TURN = flags.DEFINE_integer(
    "turn", None, "With --interleave, a turn also ends after this many"
    " requests (0: only where the domain changes). Default 8 at one slot,"
    " where a turn's end costs nothing: a shared host's speed can change by"
    " half within the hour, and short turns expose every pass to the same drift;"
    " 0 with more slots, where a turn's end drains them.", lower_bound=0)
WINDOW = flags.DEFINE_integer(
    "window", 16, "Requests in the rolling alpha and in the per-segment and"
    " last-window figures.")


def online_config(num_drafts: int, k: int, learn: bool) -> online.OnlineConfig:
  """The loop's static settings from flags."""
  return online.OnlineConfig(
      k=k, sampling=Sampling(TEMPERATURE.value, TOP_K.value, TOP_P.value),
      max_new_tokens=MAX_NEW_TOKENS.value, cache_size=CACHE_SIZE.value,
      steps_per_call=STEPS_PER_CALL.value, learn=learn,
      sample_source=SAMPLE_SOURCE.value, source_mix=SOURCE_MIX.value,
      num_drafts=num_drafts, batch_k=step_flags.batch_k(),
      trim_verify=verify_flags.TRIM_VERIFY.value,
      **learning_flags.online_fields(
          schedule=SCHEDULE.value, schedule_steps=max(
              NUM_REQUESTS.value // learning_flags.UPDATE_INTERVAL.value, 1)))


def _is_gated(draft: Draft) -> bool:
  return isinstance(draft.drafter, HybridDraft) and bool(draft.drafter.draft_cost)


def with_gate_explore(draft: Draft) -> Draft:
  """The draft with --gate_explore, which only a gated hybrid reads."""
  if _is_gated(draft):
    return dataclasses.replace(draft, drafter=dataclasses.replace(
        draft.drafter, explore_every=GATE_EXPLORE.value))
  if not flags.FLAGS["gate_explore"].using_default_value:
    raise app.UsageError("--gate_explore has no effect here: the draft is not"
                         " a gated hybrid (--hybrid with a draft cost).")
  return draft


def turn_ends(queries: list[driver.Query], min_requests: int,
              every: int = 0) -> list[int]:
  """Where one pass's turn ends: each domain change at least `min_requests`
  on, and (`every` > 0) `every` requests after the previous end."""
  ends = [0]
  for i in range(1, len(queries)):
    changed = queries[i].domain != queries[i - 1].domain
    if ((changed and i - ends[-1] >= min_requests)
        or (every and i - ends[-1] >= every)):
      ends.append(i)
  return ends[1:]


def summarize(name: str, path: str, tail: int) -> dict:
  """Alpha, tokens per call and tokens/s per segment and last window of one
  run, and what learning cost: seconds and their share of serving time."""
  records = read_jsonl(path)
  return {"run": name, "requests": len(records), **learning_cost(records),
          **speed_summary(records, tail=tail)}


def with_speedups(summaries: list[dict]) -> list[dict]:
  """Each run's tokens/s over target-only's, per segment and over the last window."""
  base = next((s for s in summaries if s["run"] == "target"), None)
  if base is None:
    return summaries
  for s in summaries:
    for seg, ref in zip(s["segments"], base["segments"]):
      seg["speedup"] = seg["tokens_per_s"] / ref["tokens_per_s"]
    s["last"]["speedup"] = s["last"]["tokens_per_s"] / base["last"]["tokens_per_s"]
    s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"]
  return summaries


def _done_marker(name: str) -> str:
  return os.path.join(OUTPUT_DIR.value, f"{name}.done")


def _finish(name: str, reporter: Reporter | None, ckpt: Checkpointer | None) -> None:
  """Closes a pass that has served its whole stream."""
  if reporter is None:
    return
  reporter.close()
  open(_done_marker(name), "w").close()
  saving = (f"; {ckpt.saves} checkpoint saves took {ckpt.seconds:.0f} s, not"
            " counted" if ckpt is not None and ckpt.saves else "")
  print(f"[{name}] {reporter.serving_s:.0f} s of serving,"
        f" {reporter.errors} requests refused (too long for a slot){saving}")


def main(argv):
  del argv
  compilation_cache.enable_from_flag()
  multihost_flags.maybe_initialize()
  unknown = set(RUNS.value) - set(PASSES)
  if unknown:
    raise app.UsageError(f"--runs has unknown passes {sorted(unknown)}.")
  num_devices = cli.device_count(DEVICES.value)
  if num_devices and multihost_flags.MULTIHOST.value:
    raise app.UsageError("--multihost runs on every device: keep --devices=all.")
  mesh = online.make_mesh(num_devices)
  queries = [driver.Query(r.prompt, r.category, r.domain) for r in streams.make_stream(
      STREAM.value, DOMAINS.value, NUM_REQUESTS.value, seed=SEED.value,
      category_key=CATEGORY_KEY.value, manual_dir=MANUAL_DIR.value)]
  categories = sorted({q.category for q in queries})
  num_drafts = len(categories) if NUM_DRAFTS.value == "per_category" else 1
  # Settings are checked before the draft loads: a first run builds its warm
  # start there, which takes minutes.
  cfg = online_config(num_drafts, K.value, learn=True)
  target = model_flags.load_target()
  draft = with_gate_explore(model_flags.load_draft(target))
  if not _is_gated(draft) and cfg.loss_weighting == "lookup_missed":
    if not flags.FLAGS["loss_weighting"].using_default_value:
      raise app.UsageError("--loss_weighting=lookup_missed needs a gated hybrid"
                           " draft (--hybrid with a draft cost).")
    cfg = dataclasses.replace(cfg, loss_weighting="all")  # nothing else to weigh by
  cfg = step_flags.with_position_costs(cfg, target, SLOTS.value // mesh.size)
  if "online" in RUNS.value and draft.params == ():
    raise app.UsageError(f"--draft={model_flags.DRAFT.value} has nothing to learn:"
                         " pass --runs=target,static.")
  print(f"target {target.source}\ndraft {draft.source}\n{len(queries)} requests,"
        f" categories {categories}, {mesh.size} device(s), {SLOTS.value} slots,"
        f" {num_drafts} draft(s)")
  os.makedirs(OUTPUT_DIR.value, exist_ok=True)
  # What a resumed run must share with the checkpoint it continues.
  run_config = {"online": {k: v for k, v in dataclasses.asdict(cfg).items()
                           if k != "position_costs"},  # the host's, measured
                "target": target.source,
                "draft": draft.source, "stream": STREAM.value,
                "domains": DOMAINS.value, "num_requests": NUM_REQUESTS.value,
                "seed": SEED.value, "slots": SLOTS.value,
                "devices": mesh.size, "chat": CHAT.value}
  checkpointer = None
  if "online" in RUNS.value:
    checkpointer = Checkpointer(
        CHECKPOINT_DIR.value or os.path.join(OUTPUT_DIR.value, "checkpoints"),
        run_config, resume=RESUME.value)
  passes = {
      "target": (Draft(NoDraft(target.config.vocab_size), (), "none"),
                 online_config(1, 0, learn=False), None),
      "static": (draft, dataclasses.replace(cfg, learn=False), None),
      "online": (draft, cfg, checkpointer),
      "ngram": (model_flags.load_draft(target, "ngram", hybrid=False),
                dataclasses.replace(online_config(1, K.value, learn=False),
                                    position_costs=cfg.position_costs), None)}
  primary = distributed.is_primary()  # only process 0 writes results
  turn = TURN.value if TURN.value is not None else (8 if SLOTS.value == 1 else 0)
  pauses = turn_ends(queries, WINDOW.value, turn) if INTERLEAVE.value else []
  names = [r for r in PASSES if r in RUNS.value]
  serving, reporters = {}, {}
  for name in names:
    run_draft, run_cfg, ckpt = passes[name]
    if ckpt is None and RESUME.value and os.path.exists(_done_marker(name)):
      print(f"[{name}] already done; not repeated on resume")
      continue
    reporters[name] = (Reporter(OUTPUT_DIR.value, name, total=len(queries),
                                window=WINDOW.value,
                                append=RESUME.value and ckpt is not None)
                       if primary else None)
    serving[name] = driver.serve_stream(
        target, run_draft, queries, run_cfg, num_slots=SLOTS.value, mesh=mesh,
        seed=SEED.value, chat=CHAT.value, categories=categories,
        checkpointer=ckpt, checkpoint_every=CHECKPOINT_EVERY.value,
        on_request=reporters[name] or (lambda record: None), compile_first=True,
        pauses=pauses, learning_budget=learning_flags.LEARNING_BUDGET.value,
        learning_payback=learning_flags.LEARNING_PAYBACK.value)
  driver.serve_in_turns(serving, INTERLEAVE.value,
                        lambda name: _finish(name, reporters[name], passes[name][2]))
  if checkpointer is not None:
    checkpointer.close()
  if not primary:
    return
  summaries = with_speedups([
      summarize(name, os.path.join(OUTPUT_DIR.value, f"{name}.jsonl"), WINDOW.value)
      for name in names])
  records = {s["run"]: read_jsonl(os.path.join(OUTPUT_DIR.value, f"{s['run']}.jsonl"))
             for s in summaries}
  plots.stream_figures(records, OUTPUT_DIR.value, window=WINDOW.value,
                       title=f"{STREAM.value} stream, k={K.value}")
  with open(os.path.join(OUTPUT_DIR.value, "summary.json"), "w") as f:
    json.dump(summaries, f, indent=2)
  print(plots.summary_table(summaries))
  print(learning_lines(summaries))
  print(f"plots: {os.path.join(OUTPUT_DIR.value, 'alpha.png')},"
        f" {os.path.join(OUTPUT_DIR.value, 'speed.png')}")


if __name__ == "__main__":
  cli.run(main)
