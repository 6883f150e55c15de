"""Host API: prompts in, text, tokens and engine metrics out."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax.checkpoints import tokenizer as tokenizers
from osd_jax.checkpoints.loading import LoadedModel, check_pair
from osd_jax.decoding import generate as target_only
from osd_jax.decoding import speculative
from osd_jax.decoding.sampling import Sampling

_PROMPT_BUCKET = 32  # prompts are padded to a multiple of this: fewer recompiles


@dataclasses.dataclass
class Completion:
  """One prompt's result; metrics are empty for target-only decoding."""

  prompt: str
  text: str
  token_ids: list[int]
  prompt_ids: list[int]
  metrics: dict[str, float]


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


def acceptance_by_position(metrics: speculative.Metrics) -> list[float]:
  """P(draft token i accepted | position i was verified), i = 1..k."""
  reached = np.asarray(metrics.reached_by_position, np.float64)
  accepted = np.asarray(metrics.accepted_by_position, np.float64)
  return [float(a / r) if r else float("nan") for a, r in zip(accepted, reached)]


class Engine:
  """Target-only (k=0) or speculative decoding of batches of text prompts."""

  def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, *,
               k: int = 0, sampling: Sampling = Sampling(),
               max_new_tokens: int = 64):
    if k < 0:
      raise ValueError(f"k must be >= 0 (0 = target only), got {k}.")
    if k and draft is None:
      raise ValueError("Speculative decoding (k >= 1) needs a draft model.")
    if k:
      check_pair(target, draft)
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    self.target, self.draft, self.k = target, draft, k
    self.sampling, self.max_new_tokens = sampling, max_new_tokens
    self.last_state: speculative.SpecState | None = None

  def encode(self, prompts: list[str], chat: bool = False) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when asked."""
    return tokenizers.encode(self.target.tokenizer, prompts, chat,
                             self.target.source)

  def pad(self, prompt_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray, int]:
    """Right-padded prompts, their lengths, and the cache size they need."""
    lens = np.array([len(p) for p in prompt_ids], np.int32)
    min_len = 2 if self.k else 1
    if lens.min() < min_len:
      raise ValueError(
          f"Every prompt needs at least {min_len} token(s); got one of"
          f" {lens.min()} (speculative decoding re-reads the last two).")
    limit = self.target.config.max_positions
    # The bucket may not outgrow the context: prefill writes all `width` slots.
    width = min(-(-int(lens.max()) // _PROMPT_BUCKET) * _PROMPT_BUCKET, limit)
    cache_size = width + self.max_new_tokens + self.k
    if int(lens.max()) + self.max_new_tokens + self.k > limit:
      raise ValueError(
          f"Prompt of {lens.max()} tokens + max_new_tokens"
          f" {self.max_new_tokens} + k {self.k} exceeds the context of"
          f" {limit} positions.")
    cache_size = min(cache_size, limit)
    padded = np.full((len(prompt_ids), width), self.target.config.pad_id, np.int32)
    for row, ids in zip(padded, prompt_ids):
      row[:len(ids)] = ids
    return padded, lens, cache_size

  def generate_ids(self, prompt_ids: list[list[int]], seed: int = 0):
    """(tokens [B, N], lengths [B], metrics or None) for tokenized prompts."""
    padded, lens, cache_size = self.pad(prompt_ids)
    batch = len(prompt_ids)
    tcfg = self.target.config
    rng = jax.random.key(seed)
    if not self.k:
      output, _ = target_only.generate(
          self.target.params, jnp.asarray(padded), jnp.asarray(lens),
          tcfg.init_cache(batch, cache_size), rng, config=tcfg,
          sampling=self.sampling, max_new_tokens=self.max_new_tokens)
      return np.asarray(output.tokens), np.asarray(output.lengths), None
    dcfg = self.draft.config
    state = speculative.generate(
        self.target.params, self.draft.params, jnp.asarray(padded),
        jnp.asarray(lens), tcfg.init_cache(batch, cache_size),
        dcfg.init_cache(batch, cache_size), rng, target_config=tcfg,
        draft_config=dcfg, k=self.k, sampling=self.sampling,
        max_new_tokens=self.max_new_tokens)
    self.last_state = state
    return (np.asarray(state.output.tokens), np.asarray(state.output.lengths),
            state.metrics)

  def generate(self, prompts: list[str], *, chat: bool = False,
               seed: int = 0) -> list[Completion]:
    """Decodes a batch of prompts; text stops before EOS."""
    prompt_ids = self.encode(prompts, chat)
    tokens, lengths, metrics = self.generate_ids(prompt_ids, seed)
    eos = self.target.config.eos_id
    completions = []
    for row, prompt in enumerate(prompts):
      ids = [int(t) for t in tokens[row, :lengths[row]]]
      text_ids = ids[:-1] if ids and ids[-1] == eos else ids
      text = self.target.tokenizer.decode(text_ids, skip_special_tokens=False)
      row_metrics = {} if metrics is None else summarize(metrics, [row])
      completions.append(Completion(prompt, text, ids, prompt_ids[row],
                                    row_metrics))
    return completions
