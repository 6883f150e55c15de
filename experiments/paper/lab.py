"""What the experiments share: models and data, one data set's drafts, tables, bars."""

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from experiments import plots
from experiments.paper.settings import Settings
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.data import EVAL, TRAIN, make_stream
from osd_jax.decoding.drafts import Draft, ModelDraft
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import offline
from osd_jax.serving import driver, online
from osd_jax.serving.report import Reporter, read_jsonl


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
    reporter = Reporter(self.output_dir, name, total=len(requests),
                        window=s.window, tensorboard=False)
    draft = Draft(ModelDraft(self.draft.config), self.draft.params, self.draft.source)
    queries = [driver.Query(r.prompt, r.category, r.domain) for r in requests]
    state = driver.run_stream(
        self.target, draft, queries, s.online_config(num_drafts),
        num_slots=s.batch_size, mesh=online.make_mesh(1), seed=s.seed,
        chat=True, categories=categories, on_request=reporter)
    reporter.close()
    return read_jsonl(os.path.join(self.output_dir, f"{name}.jsonl")), state


def domain_drafts(lab: Lab, domain: str):
  """The starting, offline and online drafts of one data set, and its eval prompts."""
  s = lab.settings
  _, eval_ids = lab.requests("single", [domain], s.num_eval, EVAL)
  train_reqs, train_ids = lab.requests("single", [domain], s.num_train, TRAIN)
  lab.log(f"[{domain}] offline distillation on {len(train_ids)} prompts")
  result = offline.distill(lab.target.params, lab.target.config,
                           lab.draft.params, lab.draft.config, train_ids,
                           s.offline_config(), seed=s.seed, log=lab.log)
  lab.log(f"[{domain}] online on the same {len(train_reqs)} requests")
  records, state = lab.online(f"online_{domain}", train_reqs)
  drafts = {"before": lab.draft.params, "offline": result.params,
            "online": jax.tree.map(lambda x: x[0], state.draft_params)}
  info = {"offline_loss": [result.loss_before] + result.epoch_losses,
          "online_last_window": last_window(records, s.window),
          "online_curve": [r["alpha"] for r in records]}
  return drafts, eval_ids, info


def last_window(records, window: int) -> float:
  """Mean alpha of the last `window` records."""
  return float(np.mean([r["alpha"] for r in records[-window:]]))


def markdown(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
  """A markdown table; floats to 3 decimals, None as "-"."""
  cell = lambda x: (f"{x:.3f}" if isinstance(x, float)
                    else "-" if x is None else str(x))
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def write(lab: Lab, name: str, title: str, table: str, notes: str, results):
  """OUTPUT_DIR/<name>.md (title, table, notes) and <name>.json (results)."""
  path = os.path.join(lab.output_dir, f"{name}.md")
  with open(path, "w") as f:
    f.write(f"# {title}\n\n{table}\n{notes}\n")
  with open(os.path.join(lab.output_dir, f"{name}.json"), "w") as f:
    json.dump(results, f, indent=2)
  lab.log(f"\n{table}\nwrote {path} and {name}.png")


def bars(groups: Sequence[str], series: Mapping[str, Sequence[float]],
         path: str, ylabel: str, title: str, hline: float | None = None):
  """Grouped bars, one colour per series."""
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
