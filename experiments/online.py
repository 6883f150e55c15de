"""The main job: serve a shifting query stream speculatively, distilling the draft online.

  python -m experiments.online --output_dir=outputs/online            # defaults
  python -m experiments.online --num_requests=64 --output_dir=/tmp/o  # a quick look

Runs the stream twice with the same seed: once with the draft kept static,
once learning online, and plots both rolling alpha curves.
"""

import dataclasses
import json
import os
import time

from absl import app, flags
import numpy as np

from experiments import cli, model_flags, multihost_flags, plots
from osd_jax.data import streams
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import losses, samples
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import distributed, driver, online
from osd_jax.serving.checkpoint import Checkpointer
from osd_jax.serving.report import Reporter, read_jsonl

# Serving.
K = flags.DEFINE_integer("k", 4, "Draft tokens per speculative step.")
TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Serving temperature; 0 = greedy.")
TOP_P = flags.DEFINE_float("top_p", 1.0, "Serving nucleus mass.")
TOP_K = flags.DEFINE_integer("top_k", 0, "Serving top-k; 0 = off.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 32, "Tokens per request.")
PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", 192, "Prompt capacity in tokens; longer prompts are skipped.")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Requests per batch, all devices.")
DEVICES = flags.DEFINE_string("devices", "all", "'all' or how many local devices.")
CHAT = flags.DEFINE_bool("chat", True, "Wrap queries in the chat template.")
# Learning.
UPDATE_INTERVAL = flags.DEFINE_integer(
    "update_interval", 8, "I: requests between draft updates (paper: 8).")
BUFFER_CAPACITY = flags.DEFINE_integer(
    "buffer_capacity", 16, "Samples kept per device (and draft).")
KEEP_BUFFER = flags.DEFINE_bool(
    "keep_buffer", True, "Keep the ring buffer after an update, so each sample"
    " is seen capacity / update_interval times (the paper clears it:"
    " --nokeep_buffer --buffer_capacity=8).")
TEACHER_TOPK = flags.DEFINE_integer(
    "teacher_topk", 32, "Keep the target's top-k from verification; 0 ="
    " recompute the teacher with a target forward at update time.")
LOSS = flags.DEFINE_enum("loss", "fkl", list(losses.NAMES), "Divergence.")
LOSS_BETA = flags.DEFINE_float("loss_beta", 0.5, "Weight of the generalised JSD.")
LOSS_TEMPERATURE = flags.DEFINE_float("loss_temperature", 1.0, "Distillation temperature.")
LOSS_WEIGHTING = flags.DEFINE_enum(
    "loss_weighting", "all", ["corrected", "all"],
    "Distil on every generated token, or on corrected/bonus tokens only (paper).")
SAMPLE_SOURCE = flags.DEFINE_enum("sample_source", "served", list(samples.SOURCES),
                                  "Where training tokens come from.")
SOURCE_MIX = flags.DEFINE_float("source_mix", 0.5, "Target share for mixed sources.")
OPTIMIZER = flags.DEFINE_enum("optimizer", "adamw", ["adamw", "adam", "sgd"], "Optimizer.")
LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 1e-3, "Draft learning rate. The paper used 1e-4; drafts cut"
    " from SmolLM2 learn far faster at 1e-3 (see README).")
SCHEDULE = flags.DEFINE_enum("schedule", "constant",
                             ["constant", "cosine", "linear_warmup"], "LR schedule.")
CLIP_NORM = flags.DEFINE_float("clip_norm", 0.0, "Global-norm clipping; 0 = off.")
WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
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
COMPARE_STATIC = flags.DEFINE_bool(
    "compare_static", True, "Also serve the stream with the draft kept static.")
WINDOW = flags.DEFINE_integer("window", 32, "Rolling-alpha window (requests).")
PROGRESS_EVERY = flags.DEFINE_integer("progress_every", 16,
                                      "Print a progress line every N requests.")


def online_config(num_drafts: int) -> online.OnlineConfig:
  """The loop's static settings from flags."""
  return online.OnlineConfig(
      k=K.value, sampling=Sampling(TEMPERATURE.value, TOP_K.value, TOP_P.value),
      max_new_tokens=MAX_NEW_TOKENS.value, prompt_len=PROMPT_LEN.value,
      update_interval=UPDATE_INTERVAL.value,
      buffer_capacity=BUFFER_CAPACITY.value,
      clear_after_update=not KEEP_BUFFER.value, teacher_k=TEACHER_TOPK.value,
      loss_weighting=LOSS_WEIGHTING.value, sample_source=SAMPLE_SOURCE.value,
      source_mix=SOURCE_MIX.value, num_drafts=num_drafts,
      distill=DistillConfig(
          loss=LOSS.value, beta=LOSS_BETA.value,
          temperature=LOSS_TEMPERATURE.value, optimizer=OPTIMIZER.value,
          learning_rate=LEARNING_RATE.value, schedule=SCHEDULE.value,
          schedule_steps=max(NUM_REQUESTS.value // UPDATE_INTERVAL.value, 1),
          weight_decay=WEIGHT_DECAY.value, clip_norm=CLIP_NORM.value))


def summarize(name: str, path: str, tail: int) -> dict:
  """First/last-window alpha and engine metrics of one run's JSONL."""
  records = read_jsonl(path)
  alpha = np.array([r["alpha"] for r in records])
  mean = lambda key, part: float(np.mean([r[key] for r in part])) if part else float("nan")
  return {"run": name, "requests": len(records),
          "alpha_first": float(alpha[:tail].mean()),
          "alpha_last": float(alpha[-tail:].mean()),
          "acceptance_last": mean("acceptance_rate", records[-tail:]),
          "tokens_per_call_last": mean("tokens_per_target_call", records[-tail:]),
          "updates": sum(1 for r in records if r.get("loss") is not None)}


def main(argv):
  del argv
  multihost_flags.maybe_initialize()
  target = model_flags.load_target()
  draft = model_flags.load_draft(target)
  num_devices = None if DEVICES.value == "all" else int(DEVICES.value)
  if num_devices and multihost_flags.MULTIHOST.value:
    raise app.UsageError("--multihost runs on every device: keep --devices=all.")
  mesh = online.make_mesh(num_devices)
  queries = streams.make_stream(
      STREAM.value, DOMAINS.value, NUM_REQUESTS.value, seed=SEED.value,
      category_key=CATEGORY_KEY.value, manual_dir=MANUAL_DIR.value)
  categories = sorted({q.category for q in queries})
  num_drafts = len(categories) if NUM_DRAFTS.value == "per_category" else 1
  cfg = online_config(num_drafts)
  print(f"target {target.source}\ndraft {draft.source}\n{len(queries)} requests,"
        f" categories {categories}, {mesh.size} device(s), {num_drafts} draft(s)")
  os.makedirs(OUTPUT_DIR.value, exist_ok=True)
  # What a resumed run must share with the checkpoint it continues.
  run_config = {"online": dataclasses.asdict(cfg), "target": target.source,
                "draft": draft.source, "stream": STREAM.value,
                "domains": DOMAINS.value, "num_requests": NUM_REQUESTS.value,
                "seed": SEED.value, "batch_size": BATCH_SIZE.value,
                "devices": mesh.size, "chat": CHAT.value}
  checkpointer = Checkpointer(
      CHECKPOINT_DIR.value or os.path.join(OUTPUT_DIR.value, "checkpoints"),
      run_config, resume=RESUME.value)
  runs = [("online", cfg, checkpointer)]
  if COMPARE_STATIC.value:
    # Same draft, same stream, an update interval beyond the stream: static.
    static = dataclasses.replace(cfg, update_interval=len(queries) + 1)
    runs.insert(0, ("static", static, None))
  primary = distributed.is_primary()  # only process 0 writes results
  summaries = []
  for name, run_cfg, ckpt in runs:
    path = os.path.join(OUTPUT_DIR.value, f"{name}.jsonl")
    done_marker = os.path.join(OUTPUT_DIR.value, f"{name}.done")
    if name == "static" and RESUME.value and os.path.exists(done_marker):
      print("static run already done; not repeated on resume")
    else:
      reporter = (Reporter(OUTPUT_DIR.value, name, window=WINDOW.value,
                           every=PROGRESS_EVERY.value,
                           append=RESUME.value and ckpt is not None)
                  if primary else None)
      start = time.perf_counter()
      driver.run_stream(target, draft, queries, run_cfg,
                        batch_size=BATCH_SIZE.value, mesh=mesh, seed=SEED.value,
                        chat=CHAT.value, categories=categories,
                        checkpointer=ckpt, checkpoint_every=CHECKPOINT_EVERY.value,
                        on_request=reporter or (lambda record: None))
      if reporter is not None:
        reporter.close()
        open(done_marker, "w").close()
        print(f"[{name}] done in {time.perf_counter() - start:.0f} s,"
              f" {reporter.skipped} prompts skipped (longer than --prompt_len)")
    if primary:
      summaries.append(summarize(name, path, WINDOW.value))
  checkpointer.close()
  if not primary:
    return
  curves = {s["run"]: [r["alpha"] for r in read_jsonl(
      os.path.join(OUTPUT_DIR.value, f"{s['run']}.jsonl"))] for s in summaries}
  served = read_jsonl(os.path.join(OUTPUT_DIR.value, f"{summaries[-1]['run']}.jsonl"))
  boundaries = [(r["served"], r["domain"]) for i, r in enumerate(served)
                if i == 0 or r["domain"] != served[i - 1]["domain"]]
  plots.rolling_alpha(curves, os.path.join(OUTPUT_DIR.value, "alpha.png"),
                      window=WINDOW.value, boundaries=boundaries,
                      title=f"{STREAM.value} stream, k={K.value}")
  with open(os.path.join(OUTPUT_DIR.value, "summary.json"), "w") as f:
    json.dump(summaries, f, indent=2)
  for s in summaries:
    print(json.dumps(s))
  print(f"plot: {os.path.join(OUTPUT_DIR.value, 'alpha.png')}")


if __name__ == "__main__":
  cli.run(main)
