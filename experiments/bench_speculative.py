"""Speculative decoding: measured speed-up against the one theory predicts.

  python -m experiments.bench_speculative
  python -m experiments.bench_speculative --ks=2,4 --batch_sizes=1 --draft=/path/hf_dir

For each batch size this one run measures target-only tokens/s, the cost
ratio c (one draft step / one target step), v (one target call on k+1 tokens
/ one on a single token), and for each k speculative tokens/s and alpha. It
prints the measured speed-up, the predicted (1 - a^(k+1)) / ((1 - a)(k c + v)),
their ratio, and the best k. It also times transformers' assisted generation
(same weights, same k, greedy, batch 1).
Goals: measured >= 0.8 x predicted at every k; ours >= 2x transformers' assisted.
"""

import functools

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_common, cli, model_flags
from osd_jax.decoding import generate, speculative
from osd_jax.decoding.engine import summarize
from osd_jax.decoding.sampling import GREEDY
from osd_jax.models import llama

BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
KS = flags.DEFINE_list("ks", [str(k) for k in range(1, 9)], "Values of k.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 32, "Tokens per row.")
REPEATS = flags.DEFINE_integer("repeats", 2, "Timed calls per measurement.")
DOMAIN = flags.DEFINE_string("domain", "math", "Prompt domain.")
UNROLL = flags.DEFINE_bool("unroll_target", True,
                           "Unstacked target layers (faster on CPU, slower compile).")
HF_ASSISTED = flags.DEFINE_bool("hf_assisted", True,
                                "Also time transformers' assisted generation.")
STEPS = 8  # decode steps per cost measurement


def _pad(prompt_ids, pad_id):
  width = max(len(p) for p in prompt_ids)
  prompts = np.full((len(prompt_ids), width), pad_id, np.int32)
  for row, ids in enumerate(prompt_ids):
    prompts[row, :len(ids)] = ids
  return jnp.asarray(prompts), jnp.asarray([len(p) for p in prompt_ids], jnp.int32)


def _step_seconds(params, config, batch: int, num_tokens: int) -> float:
  """Seconds of one cached forward on num_tokens new tokens per row."""
  cache_size = 256

  @jax.jit
  def run(params, cache):
    def body(_, cache):
      tokens = jnp.ones((batch, num_tokens), jnp.int32)
      logits, new = llama.apply(params, config, tokens, cache)
      # Keep the logits live; keep the length fixed so the cache never fills.
      return new.with_lengths(cache.lengths + (logits[:, 0, 0] > 1e30))
    return jax.lax.fori_loop(0, STEPS, body, cache)

  cache = config.init_cache(batch, cache_size).with_lengths(
      jnp.full((batch,), 96, jnp.int32))
  _, seconds, _ = bench_common.timed(run, params, cache, repeats=REPEATS.value)
  return seconds / STEPS


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
  """(1 - a^(k+1)) / ((1 - a)(k c + v)): PAPER.md with the CPU's verify cost v."""
  tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
  return tokens / (k * c + v)


def main(argv):
  del argv
  target = model_flags.load_target()
  draft = model_flags.load_draft(target)
  tcfg, dcfg = target.config.replace(eos_id=-1), draft.config.replace(eos_id=-1)
  tparams = llama.unstack_layers(target.params) if UNROLL.value else target.params
  n = MAX_NEW_TOKENS.value
  ks = [int(k) for k in KS.value]
  table = []
  for batch in [int(b) for b in BATCH_SIZES.value]:
    prompts, lens = _pad(bench_common.bench_prompts(target, batch, DOMAIN.value),
                         tcfg.pad_id)
    width = prompts.shape[1]
    plain = jax.jit(functools.partial(generate.generate, config=tcfg,
                                      sampling=GREEDY, max_new_tokens=n))
    _, base_s, _ = bench_common.timed(
        lambda: plain(tparams, prompts, lens, tcfg.init_cache(batch, width + n),
                      jax.random.key(0))[0], repeats=REPEATS.value)
    base_tps = batch * n / base_s
    t1 = _step_seconds(tparams, tcfg, batch, 1)
    c = _step_seconds(draft.params, dcfg, batch, 1) / t1
    print(f"batch {batch}: target-only {base_tps:.1f} tokens/s, c = {c:.3f}", flush=True)
    for k in ks:
      v = _step_seconds(tparams, tcfg, batch, k + 1) / t1
      spec = jax.jit(functools.partial(
          speculative.generate, target_config=tcfg, draft_config=dcfg, k=k,
          sampling=GREEDY, max_new_tokens=n))
      _, spec_s, state = bench_common.timed(
          lambda: spec(tparams, draft.params, prompts, lens,
                       tcfg.init_cache(batch, width + n + k),
                       dcfg.init_cache(batch, width + n + k), jax.random.key(0)),
          repeats=REPEATS.value)
      alpha = summarize(state.metrics)["alpha"]
      measured = base_s / spec_s
      predicted = predicted_speedup(alpha, k, c, v)
      row = {"batch": batch, "k": k, "alpha": alpha, "c": c, "v": v,
             "tokens_per_s": batch * n / spec_s, "measured": measured,
             "predicted": predicted, "hf_assisted_tps": None}
      if HF_ASSISTED.value and batch == 1 and bench_common.torch_available():
        row["hf_assisted_tps"] = _hf_assisted(target, draft, prompts, lens, k, n)
      table.append(row)
      print(f"  k={k}: alpha {alpha:.3f}, v {v:.2f}, {row['tokens_per_s']:.1f} tokens/s,"
            f" speed-up {measured:.2f} (predicted {predicted:.2f})", flush=True)
  _print_table(table)


_torch_models = {}


def _hf_assisted(target, draft, prompts, lens, k, n) -> float:
  """transformers' assisted greedy generation tokens/s (same weights, batch 1)."""
  from experiments import torch_baseline  # pylint: disable=import-outside-toplevel
  if not _torch_models:
    _torch_models["target"] = torch_baseline.load_torch_model(
        bench_common.export_for_torch(target, "target"))[0]
    _torch_models["draft"] = torch_baseline.load_torch_model(
        bench_common.export_for_torch(draft, "draft"))[0]
  ids = [int(t) for t in np.asarray(prompts[0, :int(lens[0])])]
  r = torch_baseline.time_assisted_generate(
      _torch_models["target"], _torch_models["draft"], ids, n, k, repeats=1)
  return r["tokens_per_s"]


def _print_table(table):
  print(f"\n{'batch':>5s} {'k':>2s} {'alpha':>6s} {'c':>6s} {'v':>5s} {'tok/s':>7s}"
        f" {'speed-up':>8s} {'predicted':>9s} {'ratio':>6s} {'HF asst':>8s} {'ours/HF':>7s}")
  for r in table:
    hf = r["hf_assisted_tps"]
    print(f"{r['batch']:5d} {r['k']:2d} {r['alpha']:6.3f} {r['c']:6.3f} {r['v']:5.2f}"
          f" {r['tokens_per_s']:7.1f} {r['measured']:8.2f} {r['predicted']:9.2f}"
          f" {r['measured'] / r['predicted']:6.2f}"
          f" {hf if hf else float('nan'):8.1f}"
          f" {r['tokens_per_s'] / hf if hf else float('nan'):7.2f}")
  for batch in sorted({r["batch"] for r in table}):
    rows = [r for r in table if r["batch"] == batch]
    best = max(rows, key=lambda r: r["measured"])
    best_pred = max(rows, key=lambda r: r["predicted"])
    worst = min(r["measured"] / r["predicted"] for r in rows)
    print(f"batch {batch}: best k measured {best['k']} ({best['measured']:.2f}x),"
          f" predicted {best_pred['k']}; worst measured/predicted {worst:.2f}"
          f" (goal >= 0.8: {'met' if worst >= 0.8 else 'missed'})")


if __name__ == "__main__":
  cli.run(main)
