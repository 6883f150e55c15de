"""The one interface every draft implements, and what it sees of the sequence.

A drafter is a frozen (hashable) dataclass: `speculate_and_verify` takes it
as static configuration and never asks which kind it holds. Its parameters
and state are pytrees passed in and returned. Per row, between steps:

- the target cache holds the committed tokens c_0..c_{m-1};
- c_m, the last emitted token, is in `Context.tokens` but not yet cached;
- `propose` drafts x_1..x_k to follow c_m, with the logits they came from;
- after verification `commit` learns which tokens were kept (and, for drafts
  that read them, the target's hidden states at positions m..m+k).
"""

import dataclasses
from typing import Any, Protocol

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding.sampling import Sampling

# A one-hot "distribution" as logits: exp(MASKED - 0) is exactly 0 in float32,
# and the value stays finite, so no log or temperature ever makes a NaN.
_OFF = -1e9


@flax.struct.dataclass
class Context:
  """The committed sequence of every row."""

  tokens: jax.Array  # [B, S] c_0..c_m in positions 0..m; later ones are stale
  lengths: jax.Array  # [B] m: tokens the target has cached
  route: jax.Array  # [B] which draft serves the row (one per category)
  # [B] the most tokens each row's proposal may hold this step (None: k),
  # chosen from past steps only (decoding/verify_policy.py). Verification
  # cuts every proposal to it; a drafter may also stop drafting there.
  limit: jax.Array | None = None

  def within_limit(self, counts: jax.Array) -> jax.Array:
    """`counts` [B] proposed tokens cut to the limit."""
    return counts if self.limit is None else jnp.minimum(counts, self.limit)

  @property
  def last_token(self) -> jax.Array:
    """c_m per row: emitted, not yet cached."""
    return jnp.take_along_axis(self.tokens, self.lengths[:, None], axis=1)[:, 0]


@flax.struct.dataclass
class Proposal:
  """k drafted tokens per row and the logits they were drawn from."""

  tokens: jax.Array  # [B, k]
  logits: jax.Array  # [B, k, V] full vocabulary; one-hot rows for fixed picks
  num_proposed: jax.Array  # [B] how many of the k count (0: no draft this step)

  @classmethod
  def empty(cls, batch_size: int, vocab_size: int) -> "Proposal":
    """No tokens at all (k = 0): a plain target step."""
    return cls(jnp.zeros((batch_size, 0), jnp.int32),
               jnp.zeros((batch_size, 0, vocab_size), jnp.float32),
               jnp.zeros((batch_size,), jnp.int32))


@flax.struct.dataclass
class Verified:
  """What one verification pass saw, per row."""

  hidden: jax.Array  # [B, k+1, D] target's final hidden states at m..m+k
  tokens: jax.Array  # [B, k+1] what the target read: c_m, x_1..x_k
  emitted: jax.Array  # [B, k+1] c_{m+1}.. : accepted drafts, then y
  kept: jax.Array  # [B] tokens appended (0 for finished rows)
  start: jax.Array  # [B] m before the step
  route: jax.Array | None = None  # [B] the draft serving the row (Context.route)
  # [B] the proposal was this drafter's own (None: every row's); a copy that
  # serves another category (MultiDraft) was fed its own draws instead.
  own: jax.Array | None = None

  def narrowed(self, width: int) -> "Verified":
    """The first `width` positions (every row keeps at most that many)."""
    return self.replace(hidden=self.hidden[:, :width], tokens=self.tokens[:, :width],
                        emitted=self.emitted[:, :width])


@flax.struct.dataclass
class Forced:
  """Tokens a wrapper (the hybrid) makes a drafter propose instead of its own."""

  tokens: jax.Array  # [B, k]
  counts: jax.Array  # [B] how many of them are proposed; 0: the drafter's own row
  # [B] rows the drafter need not serve at all (None: none): it proposes
  # nothing of its own there and is not fed their tokens, so a pass run for a
  # few rows does not first catch up on every row; a later proposal does.
  idle: jax.Array | None = None

  @property
  def is_forced(self) -> jax.Array:
    """[B] rows whose proposal is replaced."""
    return self.counts > 0

  @property
  def is_served(self) -> jax.Array:
    """[B] rows whose proposal is the drafter's own."""
    own = ~self.is_forced
    return own if self.idle is None else own & ~self.idle


class Drafter(Protocol):
  """What speculate_and_verify needs from a draft of any kind."""

  needs_hidden: bool  # reads the target's hidden states (buffers keep them)
  commit_reads: bool  # commit runs the draft on the kept tokens (a pass to trim)

  def prepare(self, params, target_params=None):
    """Parameters in the layout decoding runs fastest in, bound to any target
    weights the draft shares (once per compiled program, outside loops).
    Every other method takes the prepared parameters."""

  def init_state(self, batch_size: int, cache_size: int) -> Any:
    """Empty per-row state (e.g. a KV cache) for `batch_size` rows."""

  def prefill(self, params, state, prompts_BxP: jax.Array, prompt_lens_B: jax.Array,
              hidden_BxPxD: jax.Array | None) -> Any:
    """State after the prompts; `hidden` is the target's at positions < len - 1."""

  def propose(self, params, state, ctx: Context, rng_B: jax.Array, k: int,
              sampling: Sampling, window: int | None,
              forced: Forced | None = None) -> tuple[Proposal, Any]:
    """k tokens to follow each row's last token, drawn with per-row keys."""

  def commit(self, params, state, verified: Verified,
             window: int | None) -> Any:
    """State after verification kept `verified.kept` tokens per row. Also
    called after a plain target step (k = 0) that `propose` did not run
    for: the state must stay one the next proposal can start from."""

  def insert_row(self, state, row: jax.Array, one, leaving=None) -> Any:
    """`state` with row `row` replaced by a one-row state (a new request).

    `leaving` is the request the row served before, (tokens [S], length []),
    length 0 if none: a drafter that learns from served traffic keeps it."""

  def at_full_width(self) -> "Drafter":
    """The drafter for steps that verify all k + 1 positions: options that
    shorten proposals (they pay only when verification is trimmed to the
    proposal) off, since there a longer proposal costs no target time."""


@dataclasses.dataclass
class Draft:
  """A drafter with its parameters and where they came from (host side)."""

  drafter: Drafter
  params: Any
  source: str


def one_hot_logits(tokens_BxK: jax.Array, vocab_size: int) -> jax.Array:
  """Logits whose softmax, at any temperature or filter, is one-hot at the token."""
  hot = jax.nn.one_hot(tokens_BxK, vocab_size, dtype=jnp.bool_)
  return jnp.where(hot, 0.0, _OFF).astype(jnp.float32)


def token_picker(rng_B: jax.Array, k: int, sampling, forced: Forced | None):
  """pick(i, logits [B, V]) -> the i-th drafted token of each row.

  Row b draws with its own key for step i, unless a wrapper forces its pick
  (an autoregressive draft must be fed what will really be proposed).
  """
  keys = jax.vmap(lambda key: jax.random.split(key, k))(rng_B)  # [B, k]

  def pick(i, logits_BxV):
    token = sampling.sample(keys[:, i], logits_BxV)
    if forced is not None:
      token = jnp.where(forced.is_forced, forced.tokens[:, i], token)
    return token

  return pick


def apply_forced(proposal: Proposal, forced: Forced | None,
                 vocab_size: int) -> Proposal:
  """The proposal with forced rows replaced by their one-hot picks."""
  if forced is None:
    return proposal
  row = forced.is_forced[:, None]
  own = jnp.where(forced.is_served, proposal.num_proposed, 0)
  return proposal.replace(
      num_proposed=jnp.where(forced.is_forced, forced.counts, own),
      tokens=jnp.where(row, forced.tokens, proposal.tokens),
      logits=jnp.where(row[..., None], one_hot_logits(forced.tokens, vocab_size),
                       proposal.logits))


@dataclasses.dataclass(frozen=True)
class NoDraft:
  """k = 0: every step is one target call on the last token (target-only decoding)."""

  vocab_size: int
  needs_hidden: bool = False
  commit_reads = False  # a class attribute, not a field

  def prepare(self, params, target_params=None):
    return params

  def init_state(self, batch_size, cache_size):
    return ()

  def prefill(self, params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD):
    return state

  def propose(self, params, state, ctx, rng_B, k, sampling, window, forced=None):
    if k:
      raise ValueError("NoDraft proposes nothing: use k = 0.")
    return Proposal.empty(ctx.lengths.shape[0], self.vocab_size), state

  def commit(self, params, state, verified, window):
    return state

  def insert_row(self, state, row, one, leaving=None):
    return state

  def at_full_width(self):
    return self
