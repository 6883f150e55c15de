"""The feature draft (models/eagle.py) behind the Drafter interface.

State per row: the draft block's KV cache, holding positions 0..m-1 computed
from real (target) features, and `feature`, its prediction f^_m of the
target's feature at the last token c_m. Per step:
- propose: x_1 from head(f^_m); then k-1 single-token steps, each feeding the
  previous predicted feature and token (written at positions m..m+k-2);
- commit: verification computed the target's features at m..m+k, so the
  block re-reads the kept positions with real features (overwriting the
  speculative entries) and keeps its prediction at the last one. Rollback
  is a length, and the cache equals a fresh prefill of the accepted prefix.
"""

import dataclasses

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts.base import (Context, Forced, Proposal, apply_forced,
                                          token_picker)
from osd_jax.decoding.sampling import Sampling
from osd_jax.models import eagle
from osd_jax.models.kv_cache import KVCache


@flax.struct.dataclass
class FeatureState:
  cache: KVCache  # the draft block's, positions < lengths from real features
  feature: jax.Array  # [B, D] predicted target feature at the last token


@dataclasses.dataclass(frozen=True)
class FeatureDraft:
  """EAGLE-style drafting from the target's hidden states."""

  config: eagle.FeatureConfig
  rollout: int = 4  # draft steps trained per position (>= the k served)
  feature_weight: float = 0.1  # smooth-L1 on predicted features, beside the KL
  # Rollout level s weighs level_decay ** (s - 1) in the loss: step s only
  # counts if steps 1..s-1 were accepted, and the levels share one block.
  level_decay: float = 1.0
  needs_hidden: bool = True
  commit_reads = True  # a class attribute, not a field

  @property
  def vocab_size(self) -> int:
    return self.config.target.vocab_size

  def prepare(self, params, target_params=None):
    if target_params is None:
      raise ValueError("The feature draft reads the target's embedding and head.")
    return eagle.bind(params, target_params, self.config)

  def init_state(self, batch_size: int, cache_size: int) -> FeatureState:
    return FeatureState(self.config.init_cache(batch_size, cache_size),
                        jnp.zeros((batch_size, self.config.target.hidden_dim),
                                  jnp.float32))

  def prefill(self, params, state: FeatureState, prompts_BxP, prompt_lens_B,
              hidden_BxPxD) -> FeatureState:
    """Reads (f_j, c_{j+1}) for j < len - 1; keeps its prediction at len - 2."""
    next_tokens = jnp.pad(prompts_BxP[:, 1:], ((0, 0), (0, 1)))
    out, cache = eagle.forward(params, self.config, next_tokens, hidden_BxPxD,
                               state.cache, cache_is_empty=True)
    last = jnp.maximum(prompt_lens_B - 2, 0)
    feature = jnp.take_along_axis(out, last[:, None, None], axis=1)[:, 0]
    # A 1-token prompt has nothing to read: its first proposal is a guess.
    feature = jnp.where((prompt_lens_B >= 2)[:, None], feature, 0.0)
    return FeatureState(cache.with_lengths(jnp.maximum(prompt_lens_B - 1, 0)),
                        feature)

  def propose(self, params, state: FeatureState, ctx: Context, rng_B, k: int,
              sampling: Sampling, window, forced: Forced | None = None):
    pick = token_picker(rng_B, k, sampling, forced)
    first_logits = eagle.logits(params, self.config, state.feature)
    first = pick(0, first_logits)
    cache = state.cache.with_lengths(ctx.lengths)

    def step(carry, i):
      token, feature, cache = carry
      out, cache = eagle.forward(params, self.config, token[:, None],
                                 feature[:, None], cache, window=window)
      feature = out[:, 0]
      logits = eagle.logits(params, self.config, feature)
      nxt = pick(i, logits)
      return (nxt, feature, cache), (nxt, logits)

    (_, _, cache), (rest, rest_logits) = jax.lax.scan(
        step, (first, state.feature, cache), jnp.arange(1, k))
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    all_logits = jnp.concatenate(
        [first_logits[:, None], jnp.swapaxes(rest_logits, 0, 1)], axis=1)
    proposal = Proposal(tokens, all_logits,
                        jnp.full(ctx.lengths.shape, k, jnp.int32))
    return apply_forced(proposal, forced, self.vocab_size), state.replace(cache=cache)

  def commit(self, params, state: FeatureState, verified, window) -> FeatureState:
    """Re-reads the kept positions m..m+kept-1 with the target's real features."""
    cache = state.cache.with_lengths(verified.start)
    out, cache = eagle.forward(params, self.config, verified.emitted,
                               verified.hidden, cache, window=window)
    last = jnp.maximum(verified.kept - 1, 0)
    feature = jnp.take_along_axis(out, last[:, None, None], axis=1)[:, 0]
    moved = verified.kept > 0
    return FeatureState(
        cache.with_lengths(jnp.where(moved, verified.start + verified.kept,
                                     state.cache.lengths)),
        jnp.where(moved[:, None], feature, state.feature))

  def insert_row(self, state: FeatureState, row, one: FeatureState,
                 leaving=None) -> FeatureState:
    return FeatureState(state.cache.insert_row(row, one.cache),
                        state.feature.at[row].set(one.feature[0]))

  def at_full_width(self):
    return self
