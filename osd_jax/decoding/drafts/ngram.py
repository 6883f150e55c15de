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
(`at_full_width`), and there a vote in the history (below) proposes its
winner's whole continuation.

With `history` > 0 a row that finds no match in its own sequence looks in
the last `history` requests its device served, prompts and outputs (as
SuffixDecoding and vLLM's `suffix` method look in earlier outputs). There
each earlier request's latest match votes, as SuffixDecoding's frequency
counts do: the continuation most of them share is proposed, as far as at
least `history_min_share` of them agree. The drafter then adapts to the
traffic without training: answers to similar queries share their phrasing
(SQL clauses, the steps of a math answer), and a phrase continued alike
many times is proposed with its usual continuation.
Every row of a device keeps the same ring (History), so a slot finds what
the device's other slots served; devices stay independent.
"""

import dataclasses

import flax
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


@flax.struct.dataclass
class History:
  """A ring of the last requests a device served, kept by every row.

  Every row of a device holds the same ring: a slot then looks up what all
  the device's slots served (at 8 slots a ring per slot saw 1/8 of the
  traffic), while the drafter state stays per row, as batch buckets slice
  it. The copies cost memory (128 KB a slot at the defaults), not time: each
  row searches a ring with its own suffix anyway.
  """

  tokens: jax.Array  # [B, H, S] each request's prompt and output
  lengths: jax.Array  # [B, H] tokens held; 0: an empty entry
  age: jax.Array  # [B, H] requests served since (0: the latest)

  @classmethod
  def empty(cls, batch_size: int, size: int, cache_size: int) -> "History":
    return cls(jnp.zeros((batch_size, size, cache_size), jnp.int32),
               jnp.zeros((batch_size, size), jnp.int32),
               jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (batch_size, size)))

  def remember(self, tokens_S: jax.Array, length: jax.Array) -> "History":
    """Every row's ring with its oldest entry replaced by a finished request
    (unchanged for length 0: the slot it left served nothing)."""
    rows = jnp.arange(self.age.shape[0])
    oldest = jnp.argmax(self.age, axis=1)
    updated = self.replace(
        tokens=self.tokens.at[rows, oldest].set(tokens_S),
        lengths=self.lengths.at[rows, oldest].set(length),
        age=jnp.where(jnp.arange(self.age.shape[1]) == oldest[:, None], 0,
                      self.age + 1))
    return jax.tree.map(lambda new, old: jnp.where(length > 0, new, old), updated, self)


def history_vote(history: History, suffix_Bxn: jax.Array, k: int,
                 min_share: float = 0.0):
  """(tokens [B, k], how many of them to propose [B], 0 without a match).

  A match in an entry is a position j with entry[j:j+n] == suffix and j + n
  < the entry's length. Each entry with a match offers the k tokens after
  its latest one, and the offers vote as SuffixDecoding's suffix tree counts
  continuations: the proposal is the offer that most entries agree with on
  its first token, then on its first two, and so on (ties: the youngest),
  and it proposes its first t tokens while at least `min_share` of the
  entries with a match agree with all t. A phrase that many served requests
  continued alike is likely continued alike again; one whose continuations
  disagree is likely chance, and proposes nothing.
  """
  b, h, s = history.tokens.shape
  n = suffix_Bxn.shape[1]
  flat = history.tokens.reshape(b, h * s)
  positions = jnp.arange(s)[None, None, :]
  is_match = positions + n < history.lengths[:, :, None]  # [B, H, S]
  for i in range(n):
    shifted = jnp.roll(flat, -i, axis=1).reshape(b, h, s)  # entry[j + i]
    is_match &= shifted == suffix_Bxn[:, i, None, None]
  latest = jnp.max(jnp.where(is_match, positions, -1), axis=2)  # [B, H]
  offsets = latest[:, :, None] + n + jnp.arange(k)  # [B, H, k]
  offered = (latest >= 0)[:, :, None] & (offsets < history.lengths[:, :, None])
  tokens = jnp.take_along_axis(history.tokens, jnp.minimum(offsets, s - 1), axis=2)
  same = ((tokens[:, :, None] == tokens[:, None]) & offered[:, :, None]
          & offered[:, None])  # [B, H, H, k]: entries i and j agree at t
  agree = jnp.cumprod(same, axis=-1).sum(axis=2)  # [B, H, k] on tokens <= t
  leading = offered[:, :, 0]
  for t in range(k):  # the greedy walk down the tree of offers
    most = jnp.max(jnp.where(leading, agree[:, :, t], -1), axis=1, keepdims=True)
    leading &= agree[:, :, t] == most
  pick = jnp.argmax(jnp.where(leading, h - history.age, -1), axis=1)[:, None, None]
  tokens = jnp.take_along_axis(tokens, pick, axis=1)[:, 0]
  agreed = jnp.take_along_axis(agree, pick, axis=1)[:, 0]
  voters = jnp.sum(latest >= 0, axis=1, keepdims=True)
  sure = (agreed > 0) & (agreed >= min_share * voters)
  return tokens, jnp.sum(jnp.cumprod(sure, axis=1), axis=1)


@dataclasses.dataclass(frozen=True)
class NGramDraft:
  """Prompt lookup over the row's prompt and output so far."""

  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1
  cap_at_match: bool = False  # propose at most n tokens after an n-gram match
  history: int = 0  # earlier requests of the row's device it also looks in
  history_min_ngram: int = 2
  # The share of the history's requests with a match that must agree with a
  # proposed token (history_vote). Copying the latest match instead, 2-grams
  # were mostly chance: on the shift stream they added tokens per call but
  # cost more in verification.
  history_min_share: float = 0.5
  needs_hidden: bool = False
  commit_reads = False  # a class attribute, not a field

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"Need 1 <= min_ngram <= max_ngram, got"
                       f" {self.min_ngram}..{self.max_ngram}.")
    if self.history < 0 or self.history_min_ngram < 1:
      raise ValueError(f"Need history >= 0 and history_min_ngram >= 1, got"
                       f" {self.history} and {self.history_min_ngram}.")
    if not 0 <= self.history_min_share <= 1:
      raise ValueError(f"Need 0 <= history_min_share <= 1, got"
                       f" {self.history_min_share}.")

  def lookup(self, ctx: Context, k: int,
             history: History | tuple = ()) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, k], how many of them to propose [B], 0 without a match),
    the longest n that matches winning; the row's own sequence first, then
    (where it has none) its `history`, from n = history_min_ngram."""
    length = ctx.lengths + 1  # c_0..c_m
    counts = jnp.zeros(ctx.lengths.shape, jnp.int32)
    tokens = jnp.zeros(ctx.lengths.shape + (k,), jnp.int32)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      has, start = latest_match(ctx.tokens, length, n)
      take = has & (counts == 0)
      tokens = jnp.where(take[:, None],
                         continuation(ctx.tokens, length, start, n, k), tokens)
      counts = jnp.where(take, min(n, k) if self.cap_at_match else k, counts)
    if not self.history:
      return tokens, counts
    for n in range(self.max_ngram, self.history_min_ngram - 1, -1):
      suffix = jnp.take_along_axis(
          ctx.tokens, jnp.maximum(length[:, None] - n + jnp.arange(n), 0), axis=1)
      found, sure = history_vote(history, suffix, k, self.history_min_share)
      take = (sure > 0) & (counts == 0) & (length >= n)
      tokens = jnp.where(take[:, None], found, tokens)
      counts = jnp.where(take, jnp.minimum(sure, min(n, k) if self.cap_at_match
                                           else k), counts)
    return tokens, counts

  def prepare(self, params, target_params=None):
    return params

  def init_state(self, batch_size, cache_size):
    """The history ring (a request's entry holds up to cache_size tokens)."""
    return History.empty(batch_size, self.history, cache_size) if self.history else ()

  def prefill(self, params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD=None):
    return state

  def propose(self, params, state, ctx: Context, rng_B, k, sampling, window,
              forced=None):
    """Rows without a match propose nothing: the step emits one target token."""
    tokens, counts = self.lookup(ctx, k, state)
    return Proposal(tokens, one_hot_logits(tokens, self.vocab_size), counts), state

  def commit(self, params, state, verified, window):
    return state

  def insert_row(self, state, row, one, leaving=None):
    """Every row's ring keeps the request leaving `row` (the new request
    starts with the device's history, which is not its own state)."""
    if not self.history or leaving is None:
      return state
    return state.remember(*leaving)

  def at_full_width(self):
    """Proposing more costs nothing there: no cap, and a vote's whole offer."""
    return dataclasses.replace(self, cap_at_match=False, history_min_share=0.0)
