"""Prompt-lookup drafting: copy what followed the latest earlier match of the suffix.

HF's `prompt_lookup_num_tokens` and vLLM's `ngram` method. No parameters, no
state, static shapes: for n from max_ngram down to min_ngram, find the latest
position where the row's last n tokens occurred before, and propose the k
tokens that followed. A continuation that runs past the end of the sequence
repeats itself (the copy keeps copying). Its q is one-hot, so acceptance is
exact in sampling mode too.

With `cap_at_match` a match of n tokens proposes at most n: a short match
is weak evidence that the copy goes on. This pays when verification is
trimmed to the proposal's width; steps at full width propose k anyway
(`at_full_width`).
"""

import dataclasses

import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts.base import Context, Proposal, one_hot_logits


def latest_match(tokens_BxS: jax.Array, lengths_B: jax.Array, n: int):
  """(has match [B], start of the latest earlier match of the last n tokens [B]).

  Row b's sequence is tokens[b, :lengths[b]]. A match at j means
  tokens[j:j+n] equals the last n tokens and j + n < length, so at least one
  token follows it.
  """
  s = tokens_BxS.shape[1]
  ends = lengths_B[:, None]
  positions = jnp.arange(s)[None, :]
  is_match = (positions + n < ends) & (ends >= n)
  for i in range(n):
    suffix_i = jnp.take_along_axis(tokens_BxS, jnp.maximum(ends - n + i, 0), axis=1)
    shifted = jnp.roll(tokens_BxS, -i, axis=1)  # shifted[j] = tokens[j + i]
    is_match &= shifted == suffix_i
  start = jnp.max(jnp.where(is_match, positions, -1), axis=1)
  return start >= 0, jnp.maximum(start, 0)


def continuation(tokens_BxS: jax.Array, lengths_B: jax.Array, start_B: jax.Array,
                 n: int, k: int) -> jax.Array:
  """The k tokens after the match at `start`; past the end, the copy repeats."""
  first = start_B + n  # position of the first continued token
  period = jnp.maximum(lengths_B - first, 1)
  offsets = jnp.arange(k)[None, :] % period[:, None]
  return jnp.take_along_axis(tokens_BxS, first[:, None] + offsets, axis=1)


@dataclasses.dataclass(frozen=True)
class NGramDraft:
  """Prompt lookup over the row's prompt and output so far."""

  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1
  cap_at_match: bool = False  # propose at most n tokens after an n-gram match
  needs_hidden: bool = False
  commit_reads = False  # a class attribute, not a field

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"Need 1 <= min_ngram <= max_ngram, got"
                       f" {self.min_ngram}..{self.max_ngram}.")

  def lookup(self, ctx: Context, k: int) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, k], how many of them to propose [B], 0 without a match),
    the longest n that matches winning."""
    length = ctx.lengths + 1  # c_0..c_m
    counts = jnp.zeros(ctx.lengths.shape, jnp.int32)
    tokens = jnp.zeros(ctx.lengths.shape + (k,), jnp.int32)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      has, start = latest_match(ctx.tokens, length, n)
      take = has & (counts == 0)
      tokens = jnp.where(take[:, None],
                         continuation(ctx.tokens, length, start, n, k), tokens)
      counts = jnp.where(take, min(n, k) if self.cap_at_match else k, counts)
    return tokens, counts

  def prepare(self, params, target_params=None):
    return params

  def init_state(self, batch_size, cache_size):
    return ()

  def prefill(self, params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD=None):
    return state

  def propose(self, params, state, ctx: Context, rng_B, k, sampling, window,
              forced=None):
    """Rows without a match propose nothing: the step emits one target token."""
    tokens, counts = self.lookup(ctx, k)
    return Proposal(tokens, one_hot_logits(tokens, self.vocab_size), counts), state

  def commit(self, params, state, verified, window):
    return state

  def insert_row(self, state, row, one):
    return state

  def at_full_width(self):
    return dataclasses.replace(self, cap_at_match=False)
