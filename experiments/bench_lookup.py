"""Replays n-gram lookup over the target's greedy answers: tuning it without serving.

  python -m experiments.bench_lookup
  python -m experiments.bench_lookup --history_mins=2,3 --min_shares=0,0.5

The main job takes half an hour to serve its stream four times. Under greedy
decoding lookup's proposals depend only on the text, so this replays them
over the target's greedy answers instead (osd_jax/decoding/lookup_replay.py;
its target calls equal the engine's). The answers are generated once
(target only, 8 slots) and cached in --output_dir.

Prints, per segment over its last --tail requests and over the whole stream,
for lookup without a history and for each --history_mins x --min_shares:
tokens per target call, the share of proposed tokens accepted, and the
speed-up over target-only these predict at one slot with trimmed
verification (the target's verification pass on 1..k+1 positions, timed in
this process). A predicted speed-up leaves out everything but the target's
passes; the main job measures the rest (README, "The main job").
"""

from absl import flags

from experiments import bench_common, cli, model_flags
from osd_jax.decoding import drafts, lookup_replay

DOMAINS = flags.DEFINE_list("domains", ["math", "sql", "code"], "Segments, in order.")
NUM_REQUESTS = flags.DEFINE_integer("num_requests", 240, "Requests in the stream.")
K = flags.DEFINE_integer("k", 4, "Draft tokens per step.", lower_bound=1)
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per request.")
CACHE_SIZE = flags.DEFINE_integer("cache_size", 512, "Positions per request.")
TAIL = flags.DEFINE_integer("tail", 16, "Requests in each segment's last window.")
HISTORY_MINS = flags.DEFINE_list("history_mins", ["2", "3"],
                                 "--ngram_history_min values to replay.")
MIN_SHARES = flags.DEFINE_list("min_shares", ["0", "0.3", "0.5", "0.7"],
                               "--ngram_history_min_share values to replay.")
OUTPUT_DIR = flags.DEFINE_string("output_dir", "outputs/bench_lookup",
                                 "Where the greedy answers are cached.")
REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds of each verification width.")


cli.require_positive_ints(HISTORY_MINS)
flags.register_validator(MIN_SHARES, bench_common.every_item(float, lambda x: 0 <= x <= 1),
                         "--min_shares takes numbers in [0, 1].")


def summarize(rows: list[dict], step_ms: list[float]) -> dict:
  """Tokens per call, accepted share and predicted speed-up over `rows`."""
  tokens = sum(r["tokens"] for r in rows)
  calls = sum(r["calls"] for r in rows)
  spent = sum(n * step_ms[w] for r in rows for w, n in enumerate(r["widths"]))
  return {"tokens_per_call": tokens / calls,
          "accepted": sum(r["accepted"] for r in rows) / max(1, sum(r["proposed"] for r in rows)),
          "speedup": tokens * step_ms[0] / spent}


def main(argv):
  del argv
  cli.refuse_unread(model_flags, model_flags.TARGET_FLAGS + (
      model_flags.NGRAM_MAX.name, model_flags.NGRAM_MIN.name, model_flags.NGRAM_CAP.name,
      model_flags.NGRAM_HISTORY.name), "bench_lookup replays lookup alone; --history_mins"
                    " and --min_shares set the history's settings")
  if model_flags.NGRAM_HISTORY.value < 1:
    raise ValueError("bench_lookup compares lookups in a history of served requests:"
                     " --ngram_history must be at least 1.")
  target = model_flags.load_target()
  answers = bench_common.greedy_answers(
      target, DOMAINS.value, NUM_REQUESTS.value, MAX_NEW_TOKENS.value,
      CACHE_SIZE.value, OUTPUT_DIR.value)
  k = K.value
  timers = {w: bench_common.verify_timer(target.params, target.config, 1, k, w)
            for w in range(1, k + 2)}
  seconds = bench_common.interleaved_seconds(timers, REPEATS.value)
  step_ms = [1e3 * seconds[w + 1] for w in range(k + 1)]  # by tokens proposed
  print("trimmed verification at one slot, ms by positions 1.." + str(k + 1) + ": "
        + " / ".join(f"{ms:.1f}" for ms in step_ms))
  base = dict(vocab_size=target.config.vocab_size, max_ngram=model_flags.NGRAM_MAX.value,
              min_ngram=model_flags.NGRAM_MIN.value,
              cap_at_match=model_flags.NGRAM_CAP.value)
  variants = {"no history": drafts.NGramDraft(**base)}
  for least in HISTORY_MINS.value:
    for share in MIN_SHARES.value:
      variants[f"history from {least}-grams, share {share}"] = drafts.NGramDraft(
          **base, history=model_flags.NGRAM_HISTORY.value,
          history_min_ngram=int(least), history_min_share=float(share))
  segments = list(dict.fromkeys(a["domain"] for a in answers))
  print(f"{len(answers)} requests; tokens per target call / accepted share /"
        f" predicted speed-up, over each segment's last {TAIL.value} and the whole stream")
  print(f"{'':34s}" + "  ".join(f"{name:20s}" for name in segments + ["whole"]))
  for name, lookup in variants.items():
    rows = lookup_replay.replay(lookup, answers, k, CACHE_SIZE.value)
    cells = []
    for segment in segments:
      tail = [r for r in rows if r["domain"] == segment][-TAIL.value:]
      cells.append(summarize(tail, step_ms))
    cells.append(summarize(rows, step_ms))
    print(f"{name:34s}" + "  ".join(
        f"{c['tokens_per_call']:.2f} / {c['accepted']:.2f} / {c['speedup']:.2f}x"
        for c in cells), flush=True)


if __name__ == "__main__":
  model_flags.serve_with_the_best_draft()
  cli.run(main)
