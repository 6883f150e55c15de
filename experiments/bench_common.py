"""Timing helpers shared by the benchmark scripts (one process, ratios only)."""

import hashlib
import json
import os
import tempfile
import time

import jax
import numpy as np

from osd_jax.checkpoints import loading
from osd_jax.data import streams
from osd_jax.decoding.engine import Engine
from osd_jax.serving.driver import encode_prompts


def timed(fn, *args, repeats: int = 3):
  """(first call seconds, median seconds of `repeats` later calls, last result)."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return first, float(np.median(times)), result


def bench_prompts(model: loading.LoadedModel, batch_size: int, domain: str = "math",
                  max_tokens: int = 96) -> list[list[int]]:
  """Chat-templated real queries that fit in max_tokens, `batch_size` of them."""
  queries = streams.make_stream("single", [domain], 4 * batch_size + 16, seed=1)
  ids = [x for x in encode_prompts(model, [q.prompt for q in queries], chat=True)
         if len(x) <= max_tokens]
  if len(ids) < batch_size:
    raise ValueError(f"Only {len(ids)} {domain} prompts fit in {max_tokens} tokens.")
  return ids[:batch_size]


def every_item(parse, ok):
  """A list-flag validator: every item parses and passes `ok`."""
  def check(items):
    try:
      return all(ok(parse(item)) for item in items)
    except ValueError:
      return False
  return check


def greedy_answers(target: loading.LoadedModel, domains: list[str], num_requests: int,
                   max_new_tokens: int, cache_size: int, cache_dir: str) -> list[dict]:
  """Each request of the shift stream: its domain, prompt ids and greedy answer.

  Generated once (target only, 8 slots) and cached in `cache_dir` under a
  key of the target and the prompts; an unreadable cache is generated again.
  """
  queries = streams.make_stream("shift", domains, num_requests, seed=0)
  engine = Engine(target, k=0, max_new_tokens=max_new_tokens, num_slots=8,
                  cache_size=cache_size)
  prompts = engine.encode([q.prompt for q in queries], chat=True)
  # Weights stored narrower than float32 make another model (keys of float32
  # targets are as they were, so their caches stay valid).
  narrow = [] if target.config.param_dtype == "float32" else [target.config.param_dtype]
  key = hashlib.sha256(json.dumps([target.source, prompts, max_new_tokens] + narrow)
                       .encode()).hexdigest()[:16]
  path = os.path.join(cache_dir, f"greedy_{key}.json")
  if os.path.exists(path):
    try:
      with open(path) as f:
        return json.load(f)
    except (OSError, ValueError) as error:
      print(f"{path} is unreadable ({error}): generating the answers again")
  print(f"generating the target's greedy answers to {len(prompts)} requests")
  results = engine.generate_ids(prompts)
  answers = [{"domain": q.domain, "prompt": p, "answer": r.token_ids}
             for q, p, r in zip(queries, prompts, results)]
  os.makedirs(cache_dir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(answers, f)
  os.replace(path + ".tmp", path)
  return answers


def export_for_torch(model: loading.LoadedModel, name: str) -> str:
  """An HF directory of `model` (same weights) that transformers can load."""
  path = os.path.join(tempfile.mkdtemp(prefix="osd_bench_"), name)
  loading.save_hf(model, path)
  return path


def torch_available() -> bool:
  """True when the optional torch baseline can run."""
  try:
    import torch  # pylint: disable=import-outside-toplevel,unused-import
    return True
  except ImportError:
    print("torch is not installed: skipping the transformers baseline"
          " (pip install torch==2.13.0, an optional benchmark dependency).")
    return False


def forward_timer(params, config, batch: int, num_tokens: int, *, filled: int = 100,
                  window: int = 256, steps: int = 8, cache_size: int | None = None,
                  cut_once: bool = True):
  """A compiled, warmed-up callable returning the seconds of one cached
  forward on num_tokens new tokens per row.

  The cache holds `filled` positions and attention reads `window`, as a
  decode step of the slot engine does; the length never grows, so the same
  program runs `steps` times per call (the time returned is per step). A
  cache of `cache_size` positions (default: the window) has the window cut
  out of it once a call, as the slot engine does (slots.on_window), or, not
  `cut_once`, in every step.
  """
  from osd_jax.models import llama  # pylint: disable=import-outside-toplevel

  def forward(params, tokens, cache):
    logits, new = llama.apply(params, config, tokens, cache, window=window)
    return logits, new

  return _step_timer(forward, params, config, batch, num_tokens, filled, window, steps,
                     cache_size, cut_once)


def verify_timer(params, config, batch: int, k: int, needed: int, *,
                 filled: int = 100, window: int = 256, steps: int = 8,
                 cache_size: int | None = None, cut_once: bool = True):
  """Like forward_timer, for the trimmed verification pass of a step whose
  longest proposal needs `needed` of the k + 1 positions."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from osd_jax.decoding import speculative  # pylint: disable=import-outside-toplevel

  def verify(params, tokens, cache):
    _, logits, new = speculative.verify_pass(
        params, config, tokens, cache, window, speculative.verify_widths(k),
        jnp.int32(needed))
    return logits, new

  return _step_timer(verify, params, config, batch, k + 1, filled, window, steps,
                     cache_size, cut_once)


def packed_timer(params, config, batch: int, k: int, positions: int, *,
                 filled: int = 100, window: int = 256, steps: int = 8,
                 cache_size: int | None = None, cut_once: bool = True):
  """Like verify_timer, for the packed verification pass over `batch` rows
  whose last tokens and proposals fill `positions` positions in all, spread
  as evenly as they go (speculative.verify_packed)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from osd_jax.decoding import speculative  # pylint: disable=import-outside-toplevel
  counts = jnp.asarray([positions // batch + (row < positions % batch)
                        for row in range(batch)], jnp.int32)

  def verify(params, tokens, cache):
    _, logits, new = speculative.verify_packed(params, config, tokens, cache, window,
                                               counts)
    return logits, new

  return _step_timer(verify, params, config, batch, k + 1, filled, window, steps,
                     cache_size, cut_once)


def attention_timer(config, batch: int, num_tokens: int, *, filled: int = 100,
                    window: int = 256, steps: int = 8):
  """Like forward_timer, for attention alone: every layer's queries of
  num_tokens new tokens a row against its cache (llama.attend_cached, as
  verification runs it), no weights."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from osd_jax.models import llama  # pylint: disable=import-outside-toplevel
  b, t, h, kv, d = batch, num_tokens, config.num_heads, config.num_kv_heads, config.head_dim
  cache = config.init_cache(b, window).with_lengths(jnp.full((b,), filled, jnp.int32))
  # Random entries, passed in: a cache closed over would be a constant of the program.
  keys = jax.random.split(jax.random.key(0), 2)
  cache = cache.replace(k=tuple(jax.random.normal(keys[0], x.shape, x.dtype) for x in cache.k),
                        v=tuple(jax.random.normal(keys[1], x.shape, x.dtype) for x in cache.v))
  new_kv = jnp.ones((b, t, kv, d), cache.v[0].dtype)

  def run(q, cache):
    def body(_, q):
      for layer_k, layer_v in zip(cache.k, cache.v):  # each layer's own cache
        q = q + 1e-3 * llama.attend_cached(q, new_kv, new_kv, layer_k, layer_v,
                                           cache.lengths, kv).reshape(q.shape)
      return q
    return jax.lax.fori_loop(0, steps, body, q)

  return _loop_timer(run, steps, jnp.ones((b, t, h, d), cache.v[0].dtype), cache)


def products_timer(params, config, *, steps: int = 8):
  """Like forward_timer, for the weight products of a 1-token step at batch
  1 alone: every kernel of the decoding layout in a step's order, each fed
  by the one before, with no attention, norms or cache. The fastest a step
  can be with this backend's one-row products."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from osd_jax.models import llama  # pylint: disable=import-outside-toplevel
  layout = llama.for_decoding(params, config)

  def run(params, x):
    def body(_, x):
      for layer in params["layers"]:
        qkv = llama.product(x, layer, "wqkv")
        x = x + llama.product(qkv[:, :config.num_heads * config.head_dim], layer, "wo")
        gate, up = jnp.split(llama.product(x, layer, "w_gate_up"), 2, axis=-1)
        x = x + llama.product(gate * up, layer, "w_down")
      # The head's products feed the next step, as its sampled token does.
      return x + 1e-9 * llama.product(x, params, "lm_head")[:, :1]
    return jax.lax.fori_loop(0, steps, body, x)

  return _loop_timer(run, steps, layout, jnp.full((1, config.hidden_dim), 1e-3,
                                                  config.jnp_dtype))


def _loop_timer(run, steps: int, *args):
  """A compiled, warmed-up callable returning the seconds per step of
  run(*args), a loop of `steps` steps."""
  run = jax.jit(run)
  jax.block_until_ready(run(*args))

  def call() -> float:
    start = time.perf_counter()
    jax.block_until_ready(run(*args))
    return (time.perf_counter() - start) / steps

  return call


def _step_timer(step, params, config, batch, num_tokens, filled, window, steps,
                cache_size=None, cut_once=True):
  """The timed callable of forward_timer, for `step(params, tokens, cache)`
  -> (logits, cache)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from osd_jax.decoding import slots  # pylint: disable=import-outside-toplevel
  from osd_jax.models import llama  # pylint: disable=import-outside-toplevel
  params = llama.for_decoding(params, config)

  def run(params, cache):
    def body(_, cache):
      tokens = jnp.ones((batch, num_tokens), jnp.int32)
      logits, new = step(params, tokens, cache)
      # Keep the logits live; keep the length fixed so the cache never fills.
      return new.with_lengths(cache.lengths + (logits[:, 0, 0] > 1e30))
    loop = lambda cache: jax.lax.fori_loop(0, steps, body, cache)
    return slots.on_window(loop, cache, window) if cut_once else loop(cache)

  run = jax.jit(run, donate_argnums=(1,))
  state = {"cache": config.init_cache(batch, cache_size or window).with_lengths(
      jnp.full((batch,), filled, jnp.int32))}

  def call() -> float:
    start = time.perf_counter()
    state["cache"] = jax.block_until_ready(run(params, state["cache"]))
    return (time.perf_counter() - start) / steps

  call()  # compile
  return call


def forward_seconds(params, config, batch: int, num_tokens: int, *,
                    repeats: int = 3, **kwargs) -> float:
  """Median seconds of one cached forward (see forward_timer)."""
  call = forward_timer(params, config, batch, num_tokens, **kwargs)
  return float(np.median([call() for _ in range(repeats)]))


def interleaved_seconds(timers: dict, repeats: int) -> dict:
  """Median seconds of each timer, timed in turn `repeats` rounds over: on a
  shared machine whose speed drifts, every case sees the same drift."""
  times = {name: [] for name in timers}
  for _ in range(repeats):
    for name, call in timers.items():
      times[name].append(call())
  return {name: float(np.median(t)) for name, t in times.items()}


def bandwidth_gb_s(num_bytes: int, repeats: int = 5) -> float:
  """Measured streaming-read bandwidth: a jitted sum over num_bytes of float32."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  total = jax.jit(lambda x: x.sum())
  _, seconds, _ = timed(total, x, repeats=repeats)
  return num_bytes / seconds / 1e9


def weight_bytes(params, config) -> int:
  """Bytes a one-token decode step reads: each kernel of the decoding layout
  once (its float32 copy where it keeps one, see llama.matmul), the
  embedding and its copy aside (the step reads one row of them)."""
  from osd_jax.models import llama  # pylint: disable=import-outside-toplevel

  def read(weights: dict) -> int:
    return sum(read(w) if isinstance(w, dict) else w.nbytes
               for name, w in weights.items()
               if name not in ("embed", "embed" + llama.WIDE)
               and name + llama.WIDE not in weights)

  layout = llama.for_decoding(params, config)
  return read(dict(layout, layers={str(i): w for i, w in enumerate(layout["layers"])}))
