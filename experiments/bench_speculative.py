"""Speculative decoding: measured speed-up against the one theory predicts, and batching.

  python -m experiments.bench_speculative
  python -m experiments.bench_speculative --ks=2,4 --batch_sizes=1 --draft=ngram

For each batch size this one run measures target-only tokens/s (the slot
engine with k = 0), the draft's cost c (one proposal / k target steps), v
(one target call on k+1 tokens / one on a single token), and for each k
speculative tokens/s and alpha. It prints the measured speed-up, the
predicted (1 - a^(k+1)) / ((1 - a)(k c + v)), their ratio, and the best k.
`--lockstep` also serves shift-stream requests, each to its EOS or its
budget, in lockstep batches (each batch waits for its slowest row) and with
continuous batching, same draft, once per `--lockstep_budgets` (new tokens
a request may take: the main job's 64, and 256, where answers end at
their own EOS).
Goals: measured >= 0.9 x predicted at every k; continuous >= 1.25x lockstep.
"""

import dataclasses
import functools
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_common, cli, model_flags
from osd_jax.data import streams
from osd_jax.decoding import slots, speculative
from osd_jax.decoding.batching import pad_prompts
from osd_jax.decoding.drafts import Context, ModelDraft
from osd_jax.decoding.engine import Engine
from osd_jax.decoding.sampling import GREEDY
from osd_jax.models import llama
from osd_jax.serving.driver import encode_prompts

BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes (slots).")
KS = flags.DEFINE_list("ks", [str(k) for k in range(1, 9)], "Values of k.")
cli.require_positive_ints(BATCH_SIZES, KS)
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per row.")
REPEATS = flags.DEFINE_integer("repeats", 2, "Timed calls per measurement.")
DOMAIN = flags.DEFINE_string("domain", "math", "Prompt domain.")
LOCKSTEP = flags.DEFINE_integer(
    "lockstep", 32, "Shift-stream requests to serve lockstep vs continuously at"
    " the largest batch size; 0 skips it.")
LOCKSTEP_BUDGETS = flags.DEFINE_list(
    "lockstep_budgets", ["64", "256"], "max_new_tokens of the lockstep comparison,"
    " one comparison each.")
cli.require_positive_ints(LOCKSTEP_BUDGETS)
HF_ASSISTED = flags.DEFINE_bool("hf_assisted", True,
                                "Also time transformers' assisted generation.")


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
  """(1 - a^(k+1)) / ((1 - a)(k c + v)): the paper's with the verify cost v."""
  tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
  return tokens / (k * c + v)


def engine_seconds(target, draft, k, prompt_ids, max_new_tokens):
  """(median seconds, results) of serving prompt_ids, one slot per prompt."""
  engine = Engine(target, draft if k else None, k=k, max_new_tokens=max_new_tokens,
                  num_slots=len(prompt_ids))
  engine.generate_ids(prompt_ids)  # compile
  times = []
  for _ in range(REPEATS.value):
    start = time.perf_counter()
    results = engine.generate_ids(prompt_ids)
    times.append(time.perf_counter() - start)
  return float(np.median(times)), results


def propose_seconds(target, draft, k, prompt_ids) -> float:
  """Seconds of one k-token proposal at this batch (the draft's cost)."""
  b = len(prompt_ids)
  width = max(len(p) for p in prompt_ids)
  prompts, lens, _ = pad_prompts(prompt_ids, b, width, target.config.pad_id)
  tparams = llama.for_decoding(target.params, target.config)
  dparams = draft.drafter.prepare(draft.params, tparams)
  state, _ = speculative.start(
      tparams, dparams, jnp.asarray(prompts), jnp.asarray(lens),
      jnp.full((b,), 8), speculative.row_keys(jax.random.key(0), b),
      target_config=target.config, drafter=draft.drafter, k=k, cache_size=256)

  @jax.jit
  def propose(dparams, state):
    ctx = Context(state.tokens, state.lengths, state.route)
    return draft.drafter.propose(dparams, state.draft, ctx, state.rng, k, GREEDY,
                                 256)[0]

  _, seconds, _ = bench_common.timed(propose, dparams, state, repeats=3)
  return seconds


def lockstep_vs_continuous(target, draft, k, batch, n):
  """tokens/s of the same shift-stream requests, lockstep batches vs slots,
  each request to its EOS or n new tokens."""
  queries = streams.make_stream("shift", ["math", "sql", "code"], LOCKSTEP.value)
  ids = encode_prompts(target, [q.prompt for q in queries], chat=True)
  cache_size = slots.bucket(max(len(p) for p in ids) + n + k, target.config.max_positions)
  tparams = llama.for_decoding(target.params, target.config)
  run = functools.partial(speculative.generate, target_config=target.config,
                          drafter=draft.drafter, k=k, sampling=GREEDY,
                          max_new_tokens=n, cache_size=cache_size)

  def lockstep():
    tokens, calls, batch_calls = 0, 0, 0
    for start in range(0, len(ids), batch):
      part = ids[start:start + batch]
      width = slots.prompt_bucket(max(len(p) for p in part), cache_size)
      prompts, lens, is_real = pad_prompts(part, batch, width, target.config.pad_id)
      state = run(tparams, draft.params, jnp.asarray(prompts), jnp.asarray(lens),
                  jax.random.key(0))
      tokens += int(np.asarray(state.num_generated)[is_real].sum())
      row_calls = np.asarray(state.metrics.target_calls)[is_real]
      calls, batch_calls = calls + row_calls.sum(), batch_calls + row_calls.max()
    # A lockstep batch takes as many steps as its slowest row; slots that
    # never wait would take the rows' steps over `batch` slots.
    return tokens, batch_calls * batch / calls

  lockstep()  # compile every prompt width
  start = time.perf_counter()
  tokens, bound = lockstep()
  lock_tps = tokens / (time.perf_counter() - start)
  engine = Engine(target, draft, k=k, max_new_tokens=n, num_slots=batch,
                  cache_size=cache_size)
  engine.generate_ids(ids)  # compile every prompt bucket and window
  start = time.perf_counter()
  results = engine.generate_ids(ids)
  cont_tps = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
  return lock_tps, cont_tps, bound


def main(argv):
  del argv
  cli.refuse_unread(model_flags, model_flags.all_flags_but(model_flags.TRIMMED_ONLY_FLAGS),
                    "it verifies at full width, where these settings do not apply"
                    " (the serving entry points' --trim_verify)")
  target = model_flags.load_target()
  draft = model_flags.load_draft(target)
  served = target.config, draft.drafter  # the lockstep comparison stops at EOS
  # No EOS stop: every row decodes max_new_tokens, so rows differ only in speed.
  target.config = target.config.replace(eos_id=-1)
  if isinstance(draft.drafter, ModelDraft):
    draft.drafter = dataclasses.replace(
        draft.drafter, config=draft.drafter.config.replace(eos_id=-1))
  n = MAX_NEW_TOKENS.value
  ks = [int(k) for k in KS.value]
  table = []
  for batch in [int(b) for b in BATCH_SIZES.value]:
    prompt_ids = bench_common.bench_prompts(target, batch, DOMAIN.value)
    base_s, _ = engine_seconds(target, draft, 0, prompt_ids, n)
    t1 = bench_common.forward_seconds(target.params, target.config, batch, 1)
    print(f"batch {batch}: target-only {batch * n / base_s:.1f} tokens/s,"
          f" one target step {1e3 * t1:.1f} ms", flush=True)
    for k in ks:
      v = bench_common.forward_seconds(target.params, target.config, batch, k + 1) / t1
      c = propose_seconds(target, draft, k, prompt_ids) / (k * t1)
      spec_s, results = engine_seconds(target, draft, k, prompt_ids, n)
      proposed = sum(r.metrics["proposed"] for r in results)
      alpha = float(np.mean([r.metrics["alpha"] for r in results
                             if r.metrics["proposed"]])) if proposed else 0.0
      per_call = sum(len(r.token_ids) for r in results) / sum(
          r.metrics["target_calls"] for r in results)
      measured = base_s / spec_s
      predicted = predicted_speedup(alpha, k, c, v)
      row = {"batch": batch, "k": k, "alpha": alpha, "c": c, "v": v,
             "tokens_per_call": per_call, "tokens_per_s": batch * n / spec_s,
             "measured": measured, "predicted": predicted, "hf_assisted_tps": None}
      if (HF_ASSISTED.value and batch == 1 and isinstance(draft.drafter, ModelDraft)
          and bench_common.torch_available()):
        row["hf_assisted_tps"] = _hf_assisted(target, draft, prompt_ids, k, n)
      table.append(row)
      print(f"  k={k}: alpha {alpha:.3f}, {per_call:.2f} tokens/call, c {c:.3f},"
            f" v {v:.2f}, {row['tokens_per_s']:.1f} tokens/s, speed-up"
            f" {measured:.2f} (predicted {predicted:.2f})", flush=True)
  _print_table(table)
  if LOCKSTEP.value:
    batch, k = max(int(b) for b in BATCH_SIZES.value), 4
    target.config, draft.drafter = served
    print()
    for n in [int(b) for b in LOCKSTEP_BUDGETS.value]:
      lock, cont, bound = lockstep_vs_continuous(target, draft, k, batch, n)
      print(f"{LOCKSTEP.value} shift-stream requests, batch {batch}, k={k},"
            f" {n} new tokens at most: lockstep {lock:.1f} tokens/s, continuous"
            f" {cont:.1f} tokens/s = {cont / lock:.2f}x (goal >= 1.25:"
            f" {'met' if cont / lock >= 1.25 else 'missed'}); the lockstep batches'"
            f" steps over their rows' mean steps, the most refilling could gain"
            f" at no cost: {bound:.2f}x", flush=True)


_torch_models = {}


def _hf_assisted(target, draft, prompt_ids, k, n) -> float:
  """transformers' assisted greedy generation tokens/s (same weights, batch 1)."""
  from experiments import torch_baseline  # pylint: disable=import-outside-toplevel
  from osd_jax.checkpoints.loading import LoadedModel  # pylint: disable=import-outside-toplevel
  if not _torch_models:
    model = LoadedModel(draft.drafter.config, draft.params, target.tokenizer, "draft")
    _torch_models["target"] = torch_baseline.load_torch_model(
        bench_common.export_for_torch(target, "target"))[0]
    _torch_models["draft"] = torch_baseline.load_torch_model(
        bench_common.export_for_torch(model, "draft"))[0]
  r = torch_baseline.time_assisted_generate(
      _torch_models["target"], _torch_models["draft"], prompt_ids[0], n, k, repeats=1)
  return r["tokens_per_s"]


def _print_table(table):
  print(f"\n{'batch':>5s} {'k':>2s} {'alpha':>6s} {'c':>6s} {'v':>5s} {'tok/call':>8s}"
        f" {'tok/s':>7s} {'speed-up':>8s} {'predicted':>9s} {'ratio':>6s}"
        f" {'ours/HF':>7s}")
  for r in table:
    hf = r["hf_assisted_tps"]
    print(f"{r['batch']:5d} {r['k']:2d} {r['alpha']:6.3f} {r['c']:6.3f} {r['v']:5.2f}"
          f" {r['tokens_per_call']:8.2f} {r['tokens_per_s']:7.1f} {r['measured']:8.2f}"
          f" {r['predicted']:9.2f} {r['measured'] / r['predicted']:6.2f}"
          f" {r['tokens_per_s'] / hf if hf else float('nan'):7.2f}")
  for batch in sorted({r["batch"] for r in table}):
    rows = [r for r in table if r["batch"] == batch]
    best = max(rows, key=lambda r: r["measured"])
    best_pred = max(rows, key=lambda r: r["predicted"])
    worst = min(r["measured"] / r["predicted"] for r in rows)
    print(f"batch {batch}: best k measured {best['k']} ({best['measured']:.2f}x),"
          f" predicted {best_pred['k']}; worst measured/predicted {worst:.2f}"
          f" (goal >= 0.9: {'met' if worst >= 0.9 else 'missed'})")


if __name__ == "__main__":
  cli.run(main)
