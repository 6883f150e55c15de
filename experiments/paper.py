"""The paper's experiments on the embedded default: each writes a table and a figure.

  python -m experiments.paper --experiment=main --output_dir=results/main
  python -m experiments.paper --experiment=shift --quick --output_dir=/tmp/shift

- main: per data set, alpha of the derived draft, of the draft distilled
  offline on the stream's queries, and of the online draft (its last window
  on the stream, and its final weights on the held-out eval prompts).
- shift: a sharp-shift stream served by the online draft and by static drafts
  distilled in advance on 0/30/50/70/100 % of each segment.
- categories: one draft per category (language or topic) versus one shared.
- speedup: the cost ratios c (draft step / target step) and v (target call on
  k+1 tokens / on 1), the speed-up they predict from each measured alpha, and
  the wall-clock speed-up measured against target-only decoding.
Sizes come from flags; --quick shrinks every size not set explicitly.
`run(name, target, draft, settings, output_dir, sources=...)` is the same
thing as a function (the tests call it on a tiny random pair).
"""

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import model_flags, plots
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.data import EVAL, TRAIN, make_stream
from osd_jax.decoding import generate as target_only
from osd_jax.decoding import speculative
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import offline
from osd_jax.distillation.update import DistillConfig
from osd_jax.models import llama
from osd_jax.serving import driver, online
from osd_jax.serving.report import Reporter, read_jsonl

EXPERIMENTS = ("main", "shift", "categories", "speedup")
# The paper's Table (LLaMA-160M draft, Vicuna-7B target): before, offline, online.
PAPER_MAIN = {"sql": ("Spider", 0.28, 0.76, 0.74), "math": ("GSM8K", 0.58, 0.75, 0.76),
              "code": ("Code-search-Python", 0.38, 0.65, 0.67),
              "finance": ("Alpaca-finance", 0.57, 0.67, 0.70)}


@dataclasses.dataclass(frozen=True)
class Settings:
  """Sizes and knobs of every experiment; defaults fit an hour on a 2-core CPU."""

  domains: tuple[str, ...] = ("sql", "math", "code")  # main, shift, speedup
  num_train: int = 64  # main/speedup: stream length = offline training prompts
  num_eval: int = 24  # held-out prompts per data set
  segment_length: int = 32  # shift: requests per domain
  fractions: tuple[float, ...] = (0.3, 0.5, 0.7, 1.0)
  category_domains: tuple[str, ...] = ("chat",)
  category_key: str = "language"  # or "domain" (per topic)
  categories: tuple[str, ...] = ("en", "zh", "ru")
  requests_per_category: int = 64
  k: int = 4
  max_new_tokens: int = 32
  prompt_len: int = 160
  batch_size: int = 8
  update_interval: int = 8
  epochs: int = 4
  learning_rate: float = 1e-3
  loss: str = "fkl"
  sample_source: str = "served"
  teacher_topk: int = 32
  window: int = 32  # requests in the online "last window"
  speedup_max_k: int = 8  # v is measured for k = 1..this
  timing_repeats: int = 5
  seed: int = 0
  manual_dir: str = ""

  def __post_init__(self):
    DistillConfig(loss=self.loss)  # raises on an unknown loss
    online.OnlineConfig(sample_source=self.sample_source)  # and on a bad source
    if self.category_key not in ("language", "domain"):
      raise ValueError(f"category_key must be language|domain, got {self.category_key!r}.")
    if not all(0.0 < f <= 1.0 for f in self.fractions):
      raise ValueError(f"fractions must lie in (0, 1], got {self.fractions}.")

  @classmethod
  def quick(cls, **overrides) -> "Settings":
    """A few minutes on the real model: every size cut down."""
    fields = dict(domains=("sql", "math"), num_train=16, num_eval=8,
                  segment_length=16, fractions=(0.5, 1.0),
                  categories=("en", "zh"), requests_per_category=16,
                  max_new_tokens=16, epochs=3, window=8, speedup_max_k=0,
                  timing_repeats=3)
    fields.update(overrides)
    return cls(**fields)

  def online_config(self, num_drafts: int = 1) -> online.OnlineConfig:
    capacity = self.batch_size * -(-self.update_interval // self.batch_size)
    return online.OnlineConfig(
        k=self.k, sampling=Sampling(), max_new_tokens=self.max_new_tokens,
        prompt_len=self.prompt_len, update_interval=self.update_interval,
        buffer_capacity=capacity, teacher_k=self.teacher_topk,
        sample_source=self.sample_source, num_drafts=num_drafts,
        distill=self.distill_config())

  def offline_config(self) -> offline.OfflineConfig:
    return offline.OfflineConfig(
        sample_source=self.sample_source, sampling=Sampling(),
        max_new_tokens=self.max_new_tokens, prompt_len=self.prompt_len,
        teacher_k=self.teacher_topk, epochs=self.epochs,
        batch_size=self.batch_size, collect_batch_size=self.batch_size,
        distill=self.distill_config())

  def distill_config(self) -> DistillConfig:
    return DistillConfig(loss=self.loss, learning_rate=self.learning_rate)


@dataclasses.dataclass
class Lab:
  """The models, settings and data an experiment runs with."""

  target: LoadedModel
  draft: LoadedModel
  settings: Settings
  output_dir: str
  sources: Mapping | None = None  # extra/overriding data sources (tests)
  log: Callable[[str], None] = print

  def requests(self, kind: str, domains: Sequence[str], n: int, split: str,
               **stream_args) -> tuple[list, list[list[int]]]:
    """n requests whose prompts fit --prompt_len, and their token ids."""
    s = self.settings
    reqs = make_stream(kind, list(domains), 2 * n + 8, seed=s.seed, split=split,
                       sources=self.sources, manual_dir=s.manual_dir or None,
                       **stream_args)
    ids = driver.encode_prompts(self.target, [r.prompt for r in reqs], chat=True)
    kept = [(r, i) for r, i in zip(reqs, ids) if 2 <= len(i) <= s.prompt_len][:n]
    if len(kept) < n:
      self.log(f"only {len(kept)} of {n} {domains} prompts fit {s.prompt_len} tokens")
    return [r for r, _ in kept], [i for _, i in kept]

  def alpha(self, params, prompt_ids) -> dict:
    """A fixed draft served on prompts (offline.static_alpha)."""
    s = self.settings
    return offline.static_alpha(
        self.target.params, self.target.config, params, self.draft.config,
        prompt_ids, k=s.k, sampling=Sampling(), max_new_tokens=s.max_new_tokens,
        prompt_len=s.prompt_len, batch_size=s.batch_size, seed=s.seed)

  def online(self, name: str, requests, num_drafts: int = 1,
             categories: Sequence[str] = ("default",)):
    """Serves the stream learning online: (records in serving order, final state)."""
    s = self.settings
    reporter = Reporter(self.output_dir, name, window=s.window, every=32,
                        tensorboard=False)
    state = driver.run_stream(
        self.target, self.draft, requests, s.online_config(num_drafts),
        batch_size=s.batch_size, mesh=online.make_mesh(1), seed=s.seed,
        chat=True, categories=categories, on_request=reporter)
    reporter.close()
    return read_jsonl(os.path.join(self.output_dir, f"{name}.jsonl")), state


def _last_window(records, window: int) -> float:
  return float(np.mean([r["alpha"] for r in records[-window:]]))


def _markdown(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
  cell = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def _write(lab: Lab, name: str, title: str, table: str, notes: str, results):
  path = os.path.join(lab.output_dir, f"{name}.md")
  with open(path, "w") as f:
    f.write(f"# {title}\n\n{table}\n{notes}\n")
  with open(os.path.join(lab.output_dir, f"{name}.json"), "w") as f:
    json.dump(results, f, indent=2)
  lab.log(f"\n{table}\nwrote {path} and {name}.png")


def _bars(groups: Sequence[str], series: Mapping[str, Sequence[float]],
          path: str, ylabel: str, title: str, hline: float | None = None):
  fig, ax = plots.plt.subplots(figsize=(8, 4))
  width = 0.8 / max(len(series), 1)
  for i, (label, values) in enumerate(series.items()):
    ax.bar(np.arange(len(groups)) + (i - (len(series) - 1) / 2) * width,
           values, width, label=label)
  if hline is not None:
    ax.axhline(hline, color="grey", lw=1)
  ax.set_xticks(np.arange(len(groups)), groups)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plots.plt.close(fig)


def _domain_drafts(lab: Lab, domain: str):
  """Derived, offline and online drafts of one data set, and its eval prompts."""
  s = lab.settings
  _, eval_ids = lab.requests("single", [domain], s.num_eval, EVAL)
  train_reqs, train_ids = lab.requests("single", [domain], s.num_train, TRAIN)
  lab.log(f"[{domain}] offline distillation on {len(train_ids)} prompts")
  result = offline.distill(lab.target.params, lab.target.config,
                           lab.draft.params, lab.draft.config, train_ids,
                           s.offline_config(), seed=s.seed, log=lab.log)
  lab.log(f"[{domain}] online on the same {len(train_reqs)} requests")
  records, state = lab.online(f"online_{domain}", train_reqs)
  drafts = {"derived": lab.draft.params, "offline": result.params,
            "online": jax.tree.map(lambda x: x[0], state.draft_params)}
  info = {"offline_loss": [result.loss_before] + result.epoch_losses,
          "online_last_window": _last_window(records, s.window),
          "online_curve": [r["alpha"] for r in records]}
  return drafts, eval_ids, info


def run_main(lab: Lab) -> dict:
  """The paper's main table: alpha before, after offline, online."""
  s = lab.settings
  rows, results = [], {}
  for domain in s.domains:
    drafts, eval_ids, info = _domain_drafts(lab, domain)
    evals = {name: lab.alpha(params, eval_ids) for name, params in drafts.items()}
    results[domain] = dict(info, eval={n: {k: v for k, v in e.items()
                                           if k not in ("alpha_per_request", "indices")}
                                       for n, e in evals.items()})
    published = PAPER_MAIN.get(domain)
    rows.append([domain, evals["derived"]["alpha"], evals["offline"]["alpha"],
                 info["online_last_window"], evals["online"]["alpha"],
                 "/".join(f"{x:.2f}" for x in published[1:]) + f" ({published[0]})"
                 if published else "-"])
  table = _markdown(["data set", "alpha before", "offline", "online (last window)",
                     "online (final, eval)", "paper: before/offline/online"], rows)
  notes = (f"k={s.k}, greedy, {s.max_new_tokens} new tokens; offline: {s.epochs}"
           f" epochs on the {s.num_train} stream prompts; online: the same"
           f" {s.num_train} requests once, an update every {s.update_interval};"
           f" last window = last {s.window} requests; eval: {s.num_eval}"
           " held-out prompts.")
  _write(lab, "main", "Alpha per data set: derived, offline, online", table, notes,
         results)
  _bars([r[0] for r in rows], {"before": [r[1] for r in rows],
                               "offline": [r[2] for r in rows],
                               "online (last window)": [r[3] for r in rows],
                               "online (final, eval)": [r[4] for r in rows]},
        os.path.join(lab.output_dir, "main.png"), "alpha",
        f"alpha per data set (k={s.k})")
  return results


def run_shift(lab: Lab) -> dict:
  """Sharp shifts: online versus drafts distilled in advance on part of each segment."""
  s = lab.settings
  n = s.segment_length
  reqs, ids, segments = [], [], []
  for domain in s.domains:  # per segment, so every segment keeps n fitting prompts
    r, i = lab.requests("single", [domain], n, TRAIN)
    segments.append((domain, list(range(len(reqs), len(reqs) + len(r)))))
    reqs += r
    ids += i
  cfg = s.offline_config()
  lab.log(f"[shift] collecting teacher data on all {len(ids)} requests")
  data = offline.collect(lab.target.params, lab.target.config, lab.draft.params,
                         lab.draft.config, ids, cfg, seed=s.seed, log=lab.log)
  curves = {"static 0% (derived)": lab.alpha(lab.draft.params, ids)["alpha_per_request"]}
  for fraction in s.fractions:
    rows = np.concatenate([seg[:max(1, round(fraction * len(seg)))]
                           for _, seg in segments])
    subset = jax.tree.map(lambda x: x[jnp.asarray(rows)] if x.ndim else x, data)
    lab.log(f"[shift] static draft on {fraction:.0%} of each segment ({len(rows)} samples)")
    params, _ = offline.train(lab.draft.params, lab.target.params,
                              lab.target.config, lab.draft.config, subset, cfg,
                              seed=s.seed, log=lab.log)
    curves[f"static {fraction:.0%}"] = lab.alpha(params, ids)["alpha_per_request"]
  records, _ = lab.online("online_shift", reqs)
  by_request = {r["request"]: r["alpha"] for r in records}
  curves["online"] = [by_request[i] for i in range(len(reqs))]
  mean = lambda curve, seg: float(np.mean([curve[i] for i in seg]))
  rows = [[name] + [mean(c, seg) for _, seg in segments] + [float(np.mean(c))]
          for name, c in curves.items()]
  table = _markdown(["draft"] + [f"{d} (segment mean)" for d in s.domains]
                    + ["all"], rows)
  notes = (f"{n} requests per segment, k={s.k}, {s.max_new_tokens} new tokens;"
           f" static drafts: {s.epochs} epochs on the first X % of every segment,"
           " collected before serving. Paper (GSM8K/Spider/finance/code, 2K each):"
           " online 0.706/0.642/0.644/0.595, about as good as static drafts"
           " distilled on 70-100 % of each segment.")
  _write(lab, "shift", "Sharp-shift stream: online versus static drafts", table,
         notes, {"domains": list(s.domains), "curves": curves,
                 "segment_means": {r[0]: r[1:] for r in rows}})
  plots.rolling_alpha(curves, os.path.join(lab.output_dir, "shift.png"),
                      window=max(2, min(s.window, n // 2)),
                      boundaries=[(seg[0], d) for d, seg in segments],
                      title=f"sharp shifts, k={s.k}")
  return {"curves": curves}


def run_categories(lab: Lab) -> dict:
  """One draft per category versus one shared draft, on a per-category stream."""
  s = lab.settings
  cats = list(s.categories)
  reqs, ids = lab.requests("category", s.category_domains,
                           s.requests_per_category * len(cats), TRAIN,
                           category_key=s.category_key, categories=cats)
  static = lab.alpha(lab.draft.params, ids)["alpha_per_request"]
  shared, _ = lab.online("online_shared", reqs, 1, cats)
  per_cat, _ = lab.online("online_per_category", reqs, len(cats), cats)
  window = max(1, min(s.window, s.requests_per_category // 2))
  rows = []
  for cat in cats:
    of = lambda records: [r for r in records if r["category"] == cat]
    static_cat = [a for a, r in zip(static, reqs) if r.category == cat]
    rows.append([cat, len(static_cat), float(np.mean(static_cat)),
                 _last_window(of(shared), window), _last_window(of(per_cat), window)])
  rows.append(["all", len(reqs), float(np.mean(static)),
               _last_window(shared, window * len(cats)),
               _last_window(per_cat, window * len(cats))])
  table = _markdown([s.category_key, "requests", "static (derived)",
                     "one shared draft (last window)",
                     "one draft per category (last window)"], rows)
  notes = (f"{s.category_key} categories {cats} of {list(s.category_domains)},"
           f" balanced stream; last window = each category's last {window}"
           f" requests; k={s.k}. Paper (Chatbot-arena by language): +0.1 to +0.2"
           " alpha within 2K requests per language.")
  _write(lab, "categories", f"Per-{s.category_key} drafts versus one shared draft",
         table, notes, {"rows": rows})
  _bars([r[0] for r in rows], {"static": [r[2] for r in rows],
                               "shared online": [r[3] for r in rows],
                               "per-category online": [r[4] for r in rows]},
        os.path.join(lab.output_dir, "categories.png"), "alpha",
        f"per-{s.category_key} drafts (k={s.k})")
  return {"rows": rows}


def predicted_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
  """(1 - alpha^(k+1)) / ((1 - alpha)(k c + v)): expected speed-up over the target."""
  alpha = min(alpha, 1.0 - 1e-9)
  return (1.0 - alpha ** (k + 1)) / ((1.0 - alpha) * (k * c + v))


def best_k(alpha: float, c: float, v_of_k: Callable[[int], float] = lambda k: 1.0,
           max_k: int = 99) -> tuple[int, float]:
  """The k in 1..max_k with the highest predicted speed-up (the prototype's search)."""
  return max(((k, predicted_speedup(alpha, k, c, v_of_k(k)))
              for k in range(1, max_k + 1)), key=lambda kv: kv[1])


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
  jax.block_until_ready(fn())  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure_costs(lab: Lab) -> dict:
  """c = draft step / target step and v_k = target call on k+1 tokens / on 1."""
  s = lab.settings
  size = s.prompt_len + s.max_new_tokens + s.speedup_max_k + s.k
  context = s.prompt_len

  def call_seconds(model: LoadedModel, tokens: int) -> float:
    cache = model.config.init_cache(s.batch_size, size).with_lengths(
        jnp.full((s.batch_size,), context, jnp.int32))
    step = jax.jit(lambda p, t, c: llama.apply(p, model.config, t, c)[0])
    tokens_BxT = jnp.full((s.batch_size, tokens), 5, jnp.int32)
    return _median_seconds(lambda: step(model.params, tokens_BxT, cache),
                           s.timing_repeats)

  target_1 = call_seconds(lab.target, 1)
  ks = sorted({s.k} | set(range(1, s.speedup_max_k + 1)))
  v = {k: call_seconds(lab.target, k + 1) / target_1 for k in ks}
  c = call_seconds(lab.draft, 1) / target_1
  return {"c": c, "v": v, "target_step_seconds": target_1,
          "batch_size": s.batch_size, "context": context}


def _timed_decoding(lab: Lab, prompt_ids, draft_params=None) -> tuple[float, dict]:
  """Seconds to decode all prompts (compile excluded), and speculative metrics."""
  s = lab.settings
  t, d = lab.target, lab.draft
  size = s.prompt_len + s.max_new_tokens + s.k
  batches = list(offline.padded_batches(
      prompt_ids, s.batch_size, s.prompt_len, t.config.pad_id))

  def decode(prompts, lens):
    rng = jax.random.key(s.seed)
    if draft_params is None:
      return target_only.generate(
          t.params, jnp.asarray(prompts), jnp.asarray(lens),
          t.config.init_cache(s.batch_size, size), rng, config=t.config,
          sampling=Sampling(), max_new_tokens=s.max_new_tokens)[0]
    return speculative.generate(
        t.params, draft_params, jnp.asarray(prompts), jnp.asarray(lens),
        t.config.init_cache(s.batch_size, size),
        d.config.init_cache(s.batch_size, size), rng, target_config=t.config,
        draft_config=d.config, k=s.k, sampling=Sampling(),
        max_new_tokens=s.max_new_tokens)

  jax.block_until_ready(decode(*batches[0][:2]))  # compile
  seconds, sums = 0.0, {}
  for prompts, lens, is_real in batches:
    start = time.perf_counter()
    out = jax.block_until_ready(decode(prompts, lens))
    seconds += time.perf_counter() - start
    if draft_params is not None:
      for name in ("alpha_sum", "alpha_count", "emitted", "target_calls"):
        sums[name] = sums.get(name, 0.0) + float(
            np.asarray(getattr(out.metrics, name))[is_real].sum())
  return seconds, sums


def run_speedup(lab: Lab) -> dict:
  """Predicted speed-up from measured alpha and cost ratios, beside the measured one."""
  s = lab.settings
  costs = measure_costs(lab)
  c, v = costs["c"], costs["v"][s.k]
  lab.log(f"[speedup] c = {c:.3f}, v_{s.k} = {v:.2f}")
  rows, points = [], []
  for domain in s.domains:
    drafts, eval_ids, info = _domain_drafts(lab, domain)
    target_seconds, _ = _timed_decoding(lab, eval_ids)
    for name, params in drafts.items():
      seconds, m = _timed_decoding(lab, eval_ids, params)
      alpha = m["alpha_sum"] / max(m["alpha_count"], 1.0)
      k_best, best = best_k(alpha, c)
      rows.append([domain, name, alpha, m["emitted"] / max(m["target_calls"], 1.0),
                   predicted_speedup(alpha, s.k, c, v),
                   predicted_speedup(alpha, s.k, c), f"{k_best} ({best:.2f})",
                   target_seconds / seconds])
      points.append((alpha, target_seconds / seconds))
  table = _markdown(["data set", "draft", "alpha (eval)", "tokens per target call",
                     f"predicted, this CPU (k={s.k}, c, v)",
                     f"predicted, v=1 (k={s.k})", "best k, v=1 (speed-up)",
                     "measured wall-clock"], rows)
  v_text = ", ".join(f"v_{k}={x:.2f}" for k, x in costs["v"].items())
  notes = (f"Measured at batch {s.batch_size}, context {costs['context']}:"
           f" c = {c:.3f} (draft step / target step, target step"
           f" {costs['target_step_seconds'] * 1e3:.0f} ms), {v_text}. Predicted"
           " speed-up = (1 - a^(k+1)) / ((1 - a)(k c + v)); v = 1 is an"
           " accelerator at small batch. Measured: target-only over speculative"
           f" decoding time on the {s.num_eval} eval prompts (greedy, same tokens),"
           " compile excluded.")
  _write(lab, "speedup", "Speed-up from acceptance and cost ratios", table, notes,
         {"costs": costs, "rows": rows})
  fig, ax = plots.plt.subplots(figsize=(7, 4))
  grid = np.linspace(0, 0.95, 96)
  ax.plot(grid, [predicted_speedup(a, s.k, c, v) for a in grid],
          label=f"predicted, this CPU (k={s.k}, c={c:.2f}, v={v:.2f})")
  ax.plot(grid, [predicted_speedup(a, s.k, c) for a in grid], ls="--",
          label=f"predicted, v=1 (k={s.k})")
  ax.scatter(*zip(*points), color="k", zorder=3, label="measured wall-clock")
  ax.axhline(1.0, color="grey", lw=1)
  ax.set_xlabel("alpha")
  ax.set_ylabel("speed-up over target-only")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(lab.output_dir, "speedup.png"), dpi=100)
  plots.plt.close(fig)
  return {"costs": costs, "rows": rows}


RUNNERS = {"main": run_main, "shift": run_shift, "categories": run_categories,
           "speedup": run_speedup}


def run(experiment: str, target: LoadedModel, draft: LoadedModel,
        settings: Settings, output_dir: str, *, sources: Mapping | None = None,
        log: Callable[[str], None] = print) -> dict:
  """Runs one experiment; writes OUTPUT_DIR/<experiment>.{md,png,json}."""
  if experiment not in RUNNERS:
    raise ValueError(f"Unknown experiment {experiment!r}; choose from {EXPERIMENTS}.")
  os.makedirs(output_dir, exist_ok=True)
  lab = Lab(target, draft, settings, output_dir, sources, log)
  start = time.perf_counter()
  results = RUNNERS[experiment](lab)
  log(f"[{experiment}] done in {time.perf_counter() - start:.0f} s")
  return results


_HELP = {
    "domains": "Data sets (make_stream names) of main, shift and speedup.",
    "num_train": "main/speedup: online stream length = offline training prompts.",
    "num_eval": "Held-out prompts per data set.",
    "segment_length": "shift: requests per segment.",
    "fractions": "shift: parts of each segment the static drafts see in advance.",
    "category_domains": "categories: data sets the per-category stream draws from.",
    "category_key": "categories: route by 'language' or 'domain' (topic).",
    "categories": "categories: the categories, in order.",
    "requests_per_category": "categories: requests per category.",
    "k": "Draft tokens per speculative step.",
    "max_new_tokens": "Tokens generated per request.",
    "prompt_len": "Prompt capacity in tokens; longer prompts are not drawn.",
    "batch_size": "Requests per batch (and offline minibatch).",
    "update_interval": "Online: requests between draft updates.",
    "epochs": "Offline distillation epochs.",
    "learning_rate": "Draft learning rate, offline and online (paper: 1e-4).",
    "loss": "Divergence (fkl, rkl, jsd, tvd, fkl_rkl).",
    "sample_source": "Where training tokens come from (served, draft, mixed_*).",
    "teacher_topk": "Teacher top-k kept per position; 0 recomputes the teacher.",
    "window": "Requests in the online last-window alpha.",
    "speedup_max_k": "speedup: measure the target's k+1-token cost for k up to this.",
    "timing_repeats": "speedup: repeats per cost measurement.",
    "seed": "Stream and sampling seed.",
    "manual_dir": "Folder of the paper's data sets (spider, gsm8k, ...).",
}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """--experiment, --output_dir, --quick and one flag per Settings field."""
  flags.DEFINE_enum("experiment", "main", list(EXPERIMENTS), "Which experiment.",
                    flag_values=flag_values)
  flags.DEFINE_string("output_dir", "outputs/paper", "Where tables and figures go.",
                      flag_values=flag_values)
  flags.DEFINE_bool("quick", False, "A few minutes: shrink every size not set"
                    " explicitly.", flag_values=flag_values)
  flags.DEFINE_string("compilation_cache", "",
                      "Persistent XLA compilation cache directory (e.g."
                      " ~/.cache/osd_jax/xla); '' disables.", flag_values=flag_values)
  for field in dataclasses.fields(Settings):
    default, name = field.default, field.name
    if isinstance(default, tuple):
      flags.DEFINE_list(name, [str(x) for x in default], _HELP[name],
                        flag_values=flag_values)
    elif isinstance(default, bool):
      flags.DEFINE_bool(name, default, _HELP[name], flag_values=flag_values)
    elif isinstance(default, int):
      flags.DEFINE_integer(name, default, _HELP[name], flag_values=flag_values)
    elif isinstance(default, float):
      flags.DEFINE_float(name, default, _HELP[name], flag_values=flag_values)
    else:
      flags.DEFINE_string(name, default, _HELP[name], flag_values=flag_values)


def settings_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Settings:
  """Settings (quick ones with --quick), overridden by every flag given."""
  changes = {}
  for field in dataclasses.fields(Settings):
    if flag_values[field.name].present:
      value = flag_values[field.name].value
      if isinstance(field.default, tuple):
        cast = float if field.name == "fractions" else str
        value = tuple(cast(x) for x in value)
      changes[field.name] = value
  if flag_values["quick"].value:
    return Settings.quick(**changes)
  return Settings(**changes)


def main(argv):
  del argv
  settings = settings_from_flags()
  if flags.FLAGS.compilation_cache:
    jax.config.update("jax_compilation_cache_dir",
                      os.path.expanduser(flags.FLAGS.compilation_cache))
  target = model_flags.load_target()
  draft = model_flags.load_draft(target)
  print(f"target {target.source}\ndraft {draft.source}\n{settings}")
  run(flags.FLAGS.experiment, target, draft, settings, flags.FLAGS.output_dir)


if __name__ == "__main__":
  define_flags()
  app.run(main)
