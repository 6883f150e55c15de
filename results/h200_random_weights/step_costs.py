import sys, time  # run from the repository root
T0 = time.time()
import jax
sys.path.insert(0, ".")
from experiments import bench_common
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
print(jax.devices(), flush=True)
config = LlamaConfig(vocab_size=49152, hidden_dim=576, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, mlp_dim=1536, rope_theta=1e5,
                     param_dtype="bfloat16", dtype="bfloat16")
params = llama.init_params(config, jax.random.PRNGKey(0))
w = bench_common.weight_bytes(params)
gb = bench_common.bandwidth_gb_s(w * 8, repeats=5)
print(f"weights {w/1e6:.0f} MB, bandwidth {gb:.0f} GB/s, limit {w/gb/1e6:.3f} ms ({time.time()-T0:.0f} s)", flush=True)
timers = {}
for case in [(1, 1), (1, 5), (8, 1), (8, 5), (1, 9)]:
  timers[case] = bench_common.forward_timer(params, config, case[0], case[1], steps=32)
  print(f"compiled {case} ({time.time()-T0:.0f} s)", flush=True)
  ms = {c: 1e3 * s for c, s in bench_common.interleaved_seconds(timers, 5).items()}
  one = ms[(1, 1)]
  print("  " + ", ".join(f"b{b} t{t}: {v:.3f} ms ({v/one:.2f}x)" for (b, t), v in ms.items())
        + f"; batch-1 step at {w/gb/1e6/one:.2f} of the limit", flush=True)
