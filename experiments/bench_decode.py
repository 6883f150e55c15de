"""Target-only greedy decoding: osd-jax against transformers + torch, same weights.

  python -m experiments.bench_decode
  python -m experiments.bench_decode --batch_sizes=1 --max_new_tokens=16

Prints compile time and tokens/s at each batch size for our jitted loop (with
layers scanned, and unrolled), and for transformers' `generate` on the same
weights exported to an HF directory, all measured in this one run.
Goal: at least transformers' tokens/s at batch 1, ahead at batch 8.
"""

import functools

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_common, cli, model_flags
from osd_jax.decoding import generate
from osd_jax.decoding.sampling import GREEDY
from osd_jax.models import llama

BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 32, "Tokens per row.")
REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per measurement.")
THREADS = flags.DEFINE_integer("torch_threads", 0, "torch threads; 0 = default.")


def _ours(params, config, prompt_ids, max_new_tokens):
  """(compile seconds, tokens/s, generated ids) of our jitted loop."""
  width = max(len(p) for p in prompt_ids)
  prompts = np.full((len(prompt_ids), width), config.pad_id, np.int32)
  for row, ids in enumerate(prompt_ids):
    prompts[row, :len(ids)] = ids
  lens = jnp.asarray([len(p) for p in prompt_ids], jnp.int32)
  fn = jax.jit(functools.partial(generate.generate, config=config,
                                 sampling=GREEDY, max_new_tokens=max_new_tokens))
  run = lambda: fn(params, jnp.asarray(prompts), lens,
                   config.init_cache(len(prompt_ids), width + max_new_tokens),
                   jax.random.key(0))[0]
  first, seconds, out = bench_common.timed(run, repeats=REPEATS.value)
  tokens = int(np.asarray(out.lengths).sum())
  return first - seconds, tokens / seconds, np.asarray(out.tokens)[:, :max_new_tokens]


def main(argv):
  del argv
  target = model_flags.load_target()
  # No EOS stop, so every row decodes exactly max_new_tokens, as torch does.
  config = target.config.replace(eos_id=-1)
  variants = {"osd-jax (scan)": target.params,
              "osd-jax (unrolled)": llama.unstack_layers(target.params)}
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
    results = {}
    for name, params in variants.items():
      compile_s, tps, ids = _ours(params, config, prompt_ids, MAX_NEW_TOKENS.value)
      results[name] = tps
      rows.append((batch, name, compile_s, tps))
      print(f"batch {batch} {name}: compile {compile_s:.1f} s, {tps:.1f} tokens/s",
            flush=True)
    if torch_model is not None:
      r = torch_baseline.time_generate(torch_model, prompt_ids, MAX_NEW_TOKENS.value,
                                       target.config.pad_id, repeats=REPEATS.value)
      same = np.mean(np.asarray(r["ids"]) == ids)
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
