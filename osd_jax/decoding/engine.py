"""Host API: prompts in, text, tokens, engine metrics and latencies out.

The Engine drives the slot engine with continuous batching: a queue of
requests, a fixed number of slots, and between compiled calls the host
refills every slot that finished. Target-only decoding is the same engine
with k = 0 and no draft, so every comparison runs the same code.
"""

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax import progress
from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints import tokenizer as tokenizers
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.decoding import slots, speculative
from osd_jax.decoding.drafts import Draft, ModelDraft, NoDraft
from osd_jax.decoding.sampling import Sampling


@dataclasses.dataclass
class Result:
  """One request's generated ids (EOS included), metrics and latencies."""

  token_ids: list[int]
  metrics: dict[str, float]  # empty for target-only decoding
  latency: dict[str, float]  # seconds: queue, time to first token, per token


@dataclasses.dataclass
class Completion:
  """One prompt's result; metrics are empty for target-only decoding."""

  prompt: str
  text: str
  token_ids: list[int]
  prompt_ids: list[int]
  metrics: dict[str, float]
  latency: dict[str, float]


def summarize(metrics: speculative.Metrics, rows=slice(None)) -> dict:
  """Engine metrics from running sums (all rows, or the selected ones)."""
  m = jax.tree.map(lambda x: np.asarray(x, np.float64), metrics)
  total = lambda x: float(x[rows].sum())
  ratio = lambda a, b: a / b if b else float("nan")
  return {
      "alpha": ratio(total(m.alpha_sum), total(m.alpha_count)),
      "acceptance_rate": ratio(total(m.accepted), total(m.proposed)),
      "tokens_per_target_call": ratio(total(m.emitted), total(m.target_calls)),
      "mean_accepted_length": ratio(total(m.accepted), total(m.target_calls)),
      "target_calls": total(m.target_calls),
      "proposed": total(m.proposed),
      "accepted": total(m.accepted),
  }


def acceptance_by_position(metrics: speculative.Metrics, rows=slice(None)) -> list[float]:
  """P(draft token i accepted | position i was verified), i = 1..k."""
  reached = np.asarray(metrics.reached_by_position, np.float64)[rows].sum(0)
  accepted = np.asarray(metrics.accepted_by_position, np.float64)[rows].sum(0)
  return [float(a / r) if r else float("nan") for a, r in zip(accepted, reached)]


def as_draft(target: LoadedModel, draft) -> Draft:
  """A Draft from a LoadedModel (a model draft) or a Draft as it is."""
  if isinstance(draft, Draft):
    return draft
  draft = draft_lib.paired(target, draft)
  return Draft(ModelDraft(draft.config), draft.params, draft.source)


class Engine:
  """Target-only (k=0) or speculative decoding of text prompts, slot by slot."""

  def __init__(self, target: LoadedModel, draft: LoadedModel | Draft | None = None,
               *, k: int = 0, sampling: Sampling = Sampling(),
               max_new_tokens: int = 64, num_slots: int = 8,
               steps_per_call: int = 8, cache_size: int | None = None,
               trim_verify: bool = False, position_cost: float = 0.0):
    if k < 0:
      raise ValueError(f"k must be >= 0 (0 = target only), got {k}.")
    if k and draft is None:
      raise ValueError("Speculative decoding (k >= 1) needs a draft model.")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if num_slots < 1 or steps_per_call < 1:
      raise ValueError("num_slots and steps_per_call must be >= 1.")
    self.target, self.k = target, k
    self.draft = (as_draft(target, draft) if k else
                  Draft(NoDraft(target.config.vocab_size), (), "none"))
    self.sampling, self.max_new_tokens = sampling, max_new_tokens
    self.num_slots, self.steps_per_call = num_slots, steps_per_call
    self.cache_size = cache_size
    self.trim_verify = trim_verify  # see slots.SlotConfig
    self.position_cost = position_cost  # see slots.SlotConfig
    self._prepared = None  # the models' decoding layout, made on first use
    # Metrics of every request of the last generate call, summed on the host.
    self.totals: speculative.Metrics | None = None

  @property
  def context(self) -> int:
    return self.target.config.context

  def encode(self, prompts: list[str], chat: bool = False) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when asked."""
    return tokenizers.encode(self.target.tokenizer, prompts, chat,
                             self.target.source)

  def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Raises ValueError unless the request can be served."""
    if not prompt_ids:
      raise ValueError("Every prompt needs at least 1 token; got an empty one.")
    need = len(prompt_ids) + max_new_tokens + self.k
    if need > self.context:
      raise ValueError(
          f"Prompt of {len(prompt_ids)} tokens + max_new_tokens"
          f" {max_new_tokens} + k {self.k} exceeds the context of"
          f" {self.context} positions"
          + (" (the model's sliding attention window)"
             if self.context == self.target.config.sliding_window else "") + ".")
    if self.cache_size and need > self.cache_size:
      raise ValueError(f"Prompt of {len(prompt_ids)} tokens + max_new_tokens"
                       f" {max_new_tokens} + k {self.k} exceeds the engine's"
                       f" {self.cache_size}-position slots.")

  def slot_config(self, cache_size: int) -> slots.SlotConfig:
    return slots.SlotConfig(self.target.config, self.draft.drafter, self.k,
                            self.sampling, self.num_slots, cache_size,
                            self.trim_verify, self.position_cost)

  def _params(self):
    if self._prepared is None:
      cfg = self.slot_config(self.cache_size or self.context)
      self._prepared = slots.prepare(self.target.params, self.draft.params, cfg)
    return self._prepared

  def generate_ids(self, prompt_ids: list[list[int]], seed: int = 0,
                   max_new_tokens: int | None = None,
                   progress_desc: str | None = None) -> list[Result]:
    """Serves every prompt (in order of the list) with continuous batching;
    with `progress_desc`, under a progress bar of that name."""
    budget = max_new_tokens or self.max_new_tokens
    for ids in prompt_ids:
      self.check(ids, budget)
    longest = max(len(ids) for ids in prompt_ids)
    cache_size = self.cache_size or slots.bucket(longest + budget + self.k,
                                                 self.context)
    cfg = self.slot_config(cache_size)
    target_params, draft_params = self._params()
    state = slots.init(cfg)
    queue = collections.deque(enumerate(prompt_ids))
    keys = speculative.row_keys(jax.random.key(seed), len(prompt_ids))
    owner = [None] * self.num_slots  # request index in each slot
    timing = [{"arrival": time.perf_counter()} for _ in prompt_ids]
    results: list[Result | None] = [None] * len(prompt_ids)
    self.totals = None
    bar = progress.bar(len(prompt_ids) if progress_desc else 0, progress_desc or "",
                       "requests")
    while queue or any(o is not None for o in owner):
      for slot in range(self.num_slots):
        if owner[slot] is None and queue:
          index, ids = queue.popleft()
          width = slots.prompt_bucket(len(ids), cache_size)
          prompt = np.full((1, width), self.target.config.pad_id, np.int32)
          prompt[0, :len(ids)] = ids
          timing[index]["admitted"] = time.perf_counter()
          state = slots.insert(target_params, draft_params, state,
                               jnp.asarray(prompt), jnp.int32(len(ids)),
                               jnp.int32(budget), jnp.int32(slot), keys[index],
                               cfg=cfg)
          owner[slot] = index
      lengths = np.asarray(state.lengths)
      active = [s for s in range(self.num_slots) if owner[s] is not None]
      window = cfg.window(int(lengths[active].max()), self.steps_per_call)
      state = slots.generate(target_params, draft_params, state, bool(queue), cfg=cfg,
                             steps=self.steps_per_call, window=window)
      done, generated = np.asarray(state.done), np.asarray(state.num_generated)
      now = time.perf_counter()
      for slot in active:
        index = owner[slot]
        if generated[slot] > 0:
          timing[index].setdefault("first_token", now)
        if done[slot]:
          results[index] = self._result(state, slot, timing[index], now)
          owner[slot] = None
          bar.update(1)
    bar.close()
    return results

  def _result(self, state, slot: int, timing: dict, now: float) -> Result:
    ids = speculative.output_of(state, slot)
    row = jax.tree.map(lambda x: np.asarray(x[slot], np.float64),
                       jax.device_get(state.metrics))
    self.totals = row if self.totals is None else jax.tree.map(np.add, self.totals, row)
    metrics = {} if not self.k else summarize(
        jax.tree.map(lambda x: x[None], row))
    first = timing.get("first_token", now)
    latency = {"queue_s": timing["admitted"] - timing["arrival"],
               "ttft_s": first - timing["arrival"],
               "itl_s": (now - first) / max(len(ids) - 1, 1),
               "total_s": now - timing["arrival"]}
    return Result(ids, metrics, latency)

  def generate(self, prompts: list[str], *, chat: bool = False,
               seed: int = 0) -> list[Completion]:
    """Decodes prompts; text stops before EOS."""
    prompt_ids = self.encode(prompts, chat)
    eos = self.target.config.eos_id
    completions = []
    for prompt, ids, result in zip(prompts, prompt_ids,
                                   self.generate_ids(prompt_ids, seed)):
      text_ids = result.token_ids
      if text_ids and text_ids[-1] == eos:
        text_ids = text_ids[:-1]
      text = self.target.tokenizer.decode(text_ids, skip_special_tokens=False)
      completions.append(Completion(prompt, text, result.token_ids, ids,
                                    result.metrics, result.latency))
    return completions
