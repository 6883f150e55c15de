"""Device check: step costs and speculation on a GPU, SmolLM2-135M shape, random weights.

The GGUF (98 MB) cannot travel, so the weights are random; timings depend on
shapes only. Alpha on random weights is meaningless, so the speculative rows
show tokens per target call beside tokens/s: the point is whether the speed-up
tracks tokens per call when verification costs about one step.
"""
import sys, time, traceback
import jax, jax.numpy as jnp, numpy as np
from absl import flags
sys.path.insert(0, ".")
flags.FLAGS(["gpu_costs"])
from experiments import bench_common
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.checkpoints.loading import LoadedModel

T0 = time.time()
print(jax.devices(), jax.__version__, flush=True)
DT = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
import os
LAYERS = 2 if os.environ.get("SMOKE") else 30
def smol(dtype):
  return LlamaConfig(vocab_size=49152, hidden_dim=576, num_layers=LAYERS, num_heads=9,
                     num_kv_heads=3, head_dim=64, mlp_dim=1536, rope_theta=1e5,
                     param_dtype=dtype, dtype=dtype)

def costs(dtype, window, filled, batches=(1, 8, 32), ts=range(1, 10), trim=True):
  config = smol(dtype)
  params = llama.init_params(config, jax.random.PRNGKey(0))
  weights = bench_common.weight_bytes(params)
  gb_s = bench_common.bandwidth_gb_s(weights * 8, repeats=5)
  timers = {(1, t): bench_common.forward_timer(params, config, 1, t, filled=filled, window=window, steps=32)
            for t in ts}
  for b in batches[1:]:
    timers[(b, 1)] = bench_common.forward_timer(params, config, b, 1, filled=filled, window=window, steps=32)
    timers[(b, 5)] = bench_common.forward_timer(params, config, b, 5, filled=filled, window=window, steps=32)
  for w in (range(1, 6) if trim else ()):
    timers[("trim", w)] = bench_common.verify_timer(params, config, 1, 4, w, filled=filled, window=window, steps=32)
  ms = {c: 1e3 * s for c, s in bench_common.interleaved_seconds(timers, 5).items()}
  one = ms[(1, 1)]
  print(f"[{dtype} window {window} filled {filled}] weights {weights/1e6:.0f} MB,"
        f" bandwidth {gb_s:.0f} GB/s -> limit {weights/gb_s/1e6:.3f} ms; batch-1 step {one:.3f} ms"
        f" ({weights/gb_s/1e6/one:.2f} of limit)")
  print("  batch 1 v(n): " + ", ".join(f"{t}:{ms[(1,t)]/one:.2f}" for t in ts))
  for b in batches[1:]:
    print(f"  batch {b}: 1 tok/row {ms[(b,1)]:.3f} ms = {ms[(b,1)]/one:.2f}x batch 1; 5 tok/row {ms[(b,5)]/ms[(b,1)]:.2f}x")
  if trim: print("  trimmed k=4 pass by width: " + ", ".join(f"{w}:{ms[('trim',w)]/one:.2f}" for w in range(1, 6)))
  print(f"  ({time.time()-T0:.0f} s so far)", flush=True)

def engine_runs(dtype):
  from osd_jax.decoding.engine import Engine
  from osd_jax.decoding import drafts
  config = smol(dtype)
  params = llama.init_params(config, jax.random.PRNGKey(0))
  target = LoadedModel(config, params, None, "random smollm2 shape")
  rng = np.random.default_rng(0)
  for batch in (1, 8):
    prompts = [list(rng.integers(3, 49152, 64)) for _ in range(batch)]
    # Repeat a phrase so prompt lookup has something to match.
    prompts = [p + p[:32] for p in prompts]
    rows = []
    for name, k, draft in [("target-only", 0, None),
                           ("ngram k=4", 4, drafts.Draft(drafts.NGramDraft(49152, 4, 2, False), (), "ngram")),
                           ("ngram k=4 trim", 4, drafts.Draft(drafts.NGramDraft(49152, 4, 2, False), (), "ngram"))]:
      eng = Engine(target, draft, k=k, max_new_tokens=128, num_slots=batch,
                   steps_per_call=16, trim_verify=name.endswith("trim"))
      eng.generate_ids(prompts)
      times = []
      for _ in range(3):
        s = time.perf_counter(); res = eng.generate_ids(prompts); times.append(time.perf_counter() - s)
      sec = float(np.median(times)); toks = sum(len(r.token_ids) for r in res)
      m = eng.totals
      rows.append((name, toks / sec, m))
      calls = float(np.asarray(m.target_calls).sum())
      print(f"  ({time.time()-T0:.0f} s)  [{dtype} b{batch}] {name}: {toks/sec:.0f} tok/s, {float(np.asarray(m.emitted).sum())/max(calls,1):.2f} tokens per row per target call", flush=True)

PLAN = [(costs, (DT, 256, 100)), (engine_runs, (DT,)),
        (costs, (DT, 1024, 900, (1, 8, 64), (1, 5), False)),
        (costs, ("float32", 256, 100, (1, 8), (1, 5), False))]
if os.environ.get("ONLY_ENGINE"): PLAN = PLAN[1:2]
for fn, args in PLAN:
  try:
    fn(*args)
  except Exception:
    traceback.print_exc()
