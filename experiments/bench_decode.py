"""Target-only decoding: the memory-bandwidth limit, step costs, and transformers.

  python -m experiments.bench_decode
  python -m experiments.bench_decode --batch_sizes=1 --max_new_tokens=16

All in one run:
- the measured read bandwidth, and the limit it sets on one decode step
  (weight bytes / bandwidth), against the measured step at batch 1 and
  against the step's weight products alone (the ceiling the backend's
  matrix-vector products set);
- one cached target forward at batch 1 on 1..9 new tokens (v(k) = cost on
  k+1 tokens / on 1: what verification costs), and at batch 8 on 1 token
  per row against batch 1;
- the trimmed verification pass of k = 4 (--trim_verify) when the step's
  longest proposal needs 1..5 positions, against the plain forward on 5;
- at batch 8, k = 4, the packed verification pass (--trim_verify over
  several slots) when the rows' proposals fill 8..40 positions in all,
  against the plain forward on 5 tokens a row (40 positions), and what
  attention alone costs there at 1 and 5 positions a row;
- the 1-token step over a 256-position window of a 512-position cache (the
  main job's), the window cut out of the cache each step or once a call;
- end-to-end greedy tokens/s of the slot engine (k = 0) and of transformers'
  `generate` on the same weights, at each batch size.
Goals: batch-1 step >= 0.85 of the bandwidth limit; v(4) <= 1.3; batch 8 <=
1.5x batch 1; at least transformers' tokens/s at batch 1, ahead at batch 8.
"""

import time

from absl import flags
import numpy as np

from experiments import bench_common, cli, model_flags
from osd_jax.decoding.engine import Engine
from osd_jax.models import llama

BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes (slots).")
cli.require_positive_ints(BATCH_SIZES)
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 32, "Tokens per row.")
REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per measurement.")
THREADS = flags.DEFINE_integer("torch_threads", 0, "torch threads; 0 = default.")
TRIM_K = 4  # the k whose trimmed and packed verification passes are timed
PACKED_POSITIONS = (8, 16, 24, 40)  # positions 8 rows' proposals fill, in all
CUT_CACHE = 512  # positions of the cache whose 256-position window is cut


def step_costs(target) -> dict:
  """Bandwidth limit and cached-forward costs (ms), measured in this process."""
  config = target.config
  # Laid out once: each timer's own layout (every kernel copied, about 1 GB
  # for SmolLM2) would not fit 24 timers in memory.
  params = llama.for_decoding(target.params, config)
  weights = bench_common.weight_bytes(params, config)
  gb_s = bench_common.bandwidth_gb_s(weights, repeats=REPEATS.value)
  timers = {(b, t): bench_common.forward_timer(params, config, b, t)
            for b, t in [(1, t) for t in range(1, 10)] + [(8, 1)]}
  timers.update({("trimmed", w): bench_common.verify_timer(params, config, 1, TRIM_K, w)
                 for w in range(1, TRIM_K + 2)})
  timers[(8, TRIM_K + 1)] = bench_common.forward_timer(params, config, 8, TRIM_K + 1)
  timers.update({("packed", n): bench_common.packed_timer(params, config, 8, TRIM_K, n)
                 for n in PACKED_POSITIONS})
  timers.update({("attention", t): bench_common.attention_timer(config, 8, t)
                 for t in (1, TRIM_K + 1)})
  timers["products"] = bench_common.products_timer(params, config)
  timers.update({("cut", b, once): bench_common.forward_timer(
      params, config, b, 1, cache_size=CUT_CACHE, cut_once=once)
                 for b in (1, 8) for once in (False, True)})
  ms = {case: 1e3 * s for case, s in
        bench_common.interleaved_seconds(timers, REPEATS.value).items()}
  return {"weight_mb": weights / 1e6, "bandwidth_gb_s": gb_s,
          "limit_ms": weights / gb_s / 1e6, "products_ms": ms["products"],
          "batch1_ms": {t: ms[(1, t)] for t in range(1, 10)},
          "batch8_ms": ms[(8, 1)],
          "trimmed_ms": {w: ms[("trimmed", w)] for w in range(1, TRIM_K + 2)},
          "batch8_full_ms": ms[(8, TRIM_K + 1)],
          "packed_ms": {n: ms[("packed", n)] for n in PACKED_POSITIONS},
          "attention_ms": {t: ms[("attention", t)] for t in (1, TRIM_K + 1)},
          "cut_ms": {(b, once): ms[("cut", b, once)] for b in (1, 8)
                     for once in (False, True)}}


def engine_tps(target, prompt_ids, max_new_tokens) -> tuple[float, float, list]:
  """(compile seconds, tokens/s, generated ids) of the slot engine, k = 0."""
  engine = Engine(target, max_new_tokens=max_new_tokens,
                  num_slots=len(prompt_ids))
  start = time.perf_counter()
  engine.generate_ids(prompt_ids)
  first = time.perf_counter() - start
  times = []
  for _ in range(REPEATS.value):
    start = time.perf_counter()
    results = engine.generate_ids(prompt_ids)
    times.append(time.perf_counter() - start)
  seconds = float(np.median(times))
  tokens = sum(len(r.token_ids) for r in results)
  return first - seconds, tokens / seconds, [r.token_ids for r in results]


def main(argv):
  del argv
  cli.refuse_unread(model_flags, model_flags.TARGET_FLAGS, "bench_decode times the target alone")
  target = model_flags.load_target()
  costs = step_costs(target)
  one = costs["batch1_ms"]
  print(f"weights {costs['weight_mb']:.0f} MB, read bandwidth"
        f" {costs['bandwidth_gb_s']:.1f} GB/s -> limit {costs['limit_ms']:.1f} ms"
        f" per step; measured batch 1: {one[1]:.1f} ms"
        f" ({costs['limit_ms'] / one[1]:.2f} of the limit; goal >= 0.85)")
  print(f"its weight products alone (each kernel once, in order, fed by the one"
        f" before; no attention, norms or cache): {costs['products_ms']:.1f} ms"
        f" ({costs['limit_ms'] / costs['products_ms']:.2f} of the limit): the"
        " most this backend's one-row products allow")
  print("one target call at batch 1, new tokens: "
        + ", ".join(f"{t}: {v:.1f} ms (v {v / one[1]:.2f})" for t, v in one.items()))
  print(f"v(k=4) = {one[5] / one[1]:.2f} (goal <= 1.3); batch 8, 1 token per row:"
        f" {costs['batch8_ms']:.1f} ms = {costs['batch8_ms'] / one[1]:.2f}x batch 1"
        " (goal <= 1.5)")
  print(f"trimmed verification, k={TRIM_K}, batch 1, positions the longest proposal"
        " needs: " + ", ".join(
            f"{w}: {v:.1f} ms ({v / one[w]:.2f}x the forward on {w}, {v / one[1]:.2f}x on 1)"
            for w, v in costs["trimmed_ms"].items()), flush=True)
  full = costs["batch8_full_ms"]
  print(f"packed verification, k={TRIM_K}, batch 8, positions the rows' proposals fill"
        f" (full width {8 * (TRIM_K + 1)}: {full:.1f} ms): " + ", ".join(
            f"{n}: {v:.1f} ms ({v / full:.2f}x full width, {v / costs['batch8_ms']:.2f}x"
            " one token a row)" for n, v in costs["packed_ms"].items()), flush=True)
  attn = costs["attention_ms"]
  print(f"of which attention (every layer, batch 8, no weights): {attn[1]:.1f} ms at 1"
        f" position a row, {attn[TRIM_K + 1]:.1f} ms at {TRIM_K + 1}: a packed pass"
        f" still attends from all {TRIM_K + 1} positions of every row", flush=True)
  cut = costs["cut_ms"]
  print(f"the 256-position window of a {CUT_CACHE}-position cache, 1 token a row,"
        " cut out each step / once a call (the slot engine) / not at all (cache ="
        " window): " + ", ".join(
            f"batch {b}: {cut[b, False]:.1f} / {cut[b, True]:.1f} /"
            f" {costs['batch1_ms'][1] if b == 1 else costs['batch8_ms']:.1f} ms"
            f" ({cut[b, False] / cut[b, True]:.2f}x faster once)" for b in (1, 8)),
        flush=True)
  # No EOS stop, so every row decodes exactly max_new_tokens, as torch does.
  target.config = target.config.replace(eos_id=-1)
  torch_model = None
  if bench_common.torch_available():
    import torch  # pylint: disable=import-outside-toplevel
    from experiments import torch_baseline  # pylint: disable=import-outside-toplevel
    if THREADS.value:
      torch.set_num_threads(THREADS.value)
    torch_model, _ = torch_baseline.load_torch_model(
        bench_common.export_for_torch(target, "target"))
  rows = []
  for batch in [int(b) for b in BATCH_SIZES.value]:
    prompt_ids = bench_common.bench_prompts(target, batch)
    compile_s, tps, ids = engine_tps(target, prompt_ids, MAX_NEW_TOKENS.value)
    rows.append((batch, "osd-jax slot engine", compile_s, tps))
    print(f"batch {batch} osd-jax: compile {compile_s:.1f} s, {tps:.1f} tokens/s",
          flush=True)
    if torch_model is not None:
      r = torch_baseline.time_generate(torch_model, prompt_ids, MAX_NEW_TOKENS.value,
                                       target.config.pad_id, repeats=REPEATS.value)
      same = np.mean(np.asarray(r["ids"]) == np.asarray(ids))
      rows.append((batch, "transformers+torch", float("nan"), r["tokens_per_s"]))
      print(f"batch {batch} transformers: {r['tokens_per_s']:.1f} tokens/s"
            f" (greedy tokens equal to ours: {same:.0%})", flush=True)
  print(f"\n{'batch':>5s} {'implementation':22s} {'compile s':>9s} {'tokens/s':>9s}"
        f" {'vs transformers':>15s}")
  torch_tps = {b: t for b, n, _, t in rows if n == "transformers+torch"}
  for batch, name, compile_s, tps in rows:
    ratio = tps / torch_tps[batch] if batch in torch_tps else float("nan")
    print(f"{batch:5d} {name:22s} {compile_s:9.1f} {tps:9.1f} {ratio:15.2f}")


if __name__ == "__main__":
  cli.run(main)
