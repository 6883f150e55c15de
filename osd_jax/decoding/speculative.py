"""Batched speculative decoding with static k and exact rejection sampling.

Invariant between steps, per row: the target cache holds the committed
context c_0..c_{m-1}; `last_token` c_m is emitted but not cached; `prev_token`
is c_{m-1}. The draft re-reads [c_{m-1}, c_m] from position m-1 each step, so
its cache is right whether or not it had cached c_{m-1} (it had not when all
k drafts were accepted) and rollback is only a length.
"""

import functools

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding.output import Output
from osd_jax.decoding.prefill import prefill
from osd_jax.decoding.sampling import Sampling
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache


@flax.struct.dataclass
class Metrics:
  """Running sums; every rate the engine reports is a ratio of two of these."""

  proposed: jax.Array  # [batch] drafted tokens proposed
  accepted: jax.Array  # [batch] drafted tokens accepted
  target_calls: jax.Array  # [batch] verification passes
  emitted: jax.Array  # [batch] tokens appended to the output
  alpha_sum: jax.Array  # [batch] sum over verified positions of sum_v min(p, q)
  alpha_count: jax.Array  # [batch] verified positions
  reached_by_position: jax.Array  # [k] times draft position i was verified
  accepted_by_position: jax.Array  # [k] times it was accepted

  @classmethod
  def zeros(cls, batch_size: int, k: int) -> "Metrics":
    b = jnp.zeros((batch_size,), jnp.float32)
    return cls(b, b, b, b, b, b, jnp.zeros((k,), jnp.float32),
               jnp.zeros((k,), jnp.float32))


@flax.struct.dataclass
class StepResult:
  """What one step saw, per row: enough for metrics and online distillation."""

  drafted: jax.Array  # [batch, k] proposed tokens x_1..x_k
  num_accepted: jax.Array  # [batch] n in 0..k, before EOS/length cuts
  emitted: jax.Array  # [batch, k+1] x_1..x_n then the correction/bonus y
  kept: jax.Array  # [batch] tokens appended (0 for finished rows)
  alpha: jax.Array  # [batch, k] sum_v min(p_i, q_i)
  is_verified: jax.Array  # [batch, k] position i <= n on an active row
  active: jax.Array  # [batch] row was unfinished when the step began
  start: jax.Array  # [batch] position of the first emitted token in the sequence


@flax.struct.dataclass
class SpecState:
  target_cache: KVCache
  draft_cache: KVCache
  output: Output
  prev_token: jax.Array  # [batch] c_{m-1}
  last_token: jax.Array  # [batch] c_m
  rng: jax.Array
  metrics: Metrics


def start(target_params, draft_params, prompts_BxP, prompt_lens_B,
          target_cache: KVCache, draft_cache: KVCache, rng, *,
          target_config: LlamaConfig, draft_config: LlamaConfig, k: int,
          max_new_tokens: int) -> SpecState:
  """Prefills both models on all but the last prompt token (prompts need >= 2)."""
  cached = prompt_lens_B - 1
  _, target_cache = prefill(target_params, target_config, prompts_BxP, cached,
                            target_cache)
  _, draft_cache = prefill(draft_params, draft_config, prompts_BxP, cached,
                           draft_cache)
  take = lambda i: jnp.take_along_axis(prompts_BxP, i[:, None], axis=1)[:, 0]
  batch = prompts_BxP.shape[0]
  return SpecState(target_cache, draft_cache,
                   Output.empty(batch, max_new_tokens, slack=k + 1),
                   take(jnp.maximum(cached - 1, 0)), take(cached), rng,
                   Metrics.zeros(batch, k))


def _propose(draft_params, draft_config, state: SpecState, rng, k, sampling):
  """k draft tokens and the draft logits that produced them ([B,k], [B,k,V])."""
  cache = state.draft_cache.with_lengths(state.target_cache.lengths - 1)
  pair = jnp.stack([state.prev_token, state.last_token], axis=1)
  logits, cache = llama.apply(draft_params, draft_config, pair, cache)
  rngs = jax.random.split(rng, k)
  first = sampling.sample(rngs[0], logits[:, 1])

  def step(carry, step_rng):
    token, cache = carry
    logits, cache = llama.apply(draft_params, draft_config, token[:, None], cache)
    nxt = sampling.sample(step_rng, logits[:, 0])
    return (nxt, cache), (nxt, logits[:, 0])

  (_, cache), (rest, rest_logits) = jax.lax.scan(step, (first, cache), rngs[1:])
  drafted = jnp.concatenate([first[:, None], rest.T], axis=1)
  draft_logits = jnp.concatenate(
      [logits[:, 1:], jnp.swapaxes(rest_logits, 0, 1)], axis=1)
  return drafted, draft_logits, cache


def _accept(drafted_BxK, p_BxKp1xV, q_BxKxV, target_logits, rng, sampling):
  """Leviathan et al.'s rule: (n accepted, correction/bonus token y)."""
  b, k = drafted_BxK.shape
  if sampling.is_greedy:
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    is_accepted = drafted_BxK == choice[:, :k]
    n = jnp.cumprod(is_accepted, axis=1).sum(axis=1)
    return n, jnp.take_along_axis(choice, n[:, None], axis=1)[:, 0]
  accept_rng, residual_rng = jax.random.split(rng)
  at_draft = lambda probs: jnp.take_along_axis(
      probs[:, :k], drafted_BxK[..., None], axis=-1)[..., 0]
  p_x, q_x = at_draft(p_BxKp1xV), at_draft(q_BxKxV)
  u = jax.random.uniform(accept_rng, (b, k))
  # u < p/q without dividing; q_x > 0 because x was drawn from q.
  is_accepted = u * q_x < p_x
  n = jnp.cumprod(is_accepted, axis=1).sum(axis=1)
  q_padded = jnp.concatenate([q_BxKxV, jnp.zeros_like(q_BxKxV[:, :1])], axis=1)
  p_n = jnp.take_along_axis(p_BxKp1xV, n[:, None, None], axis=1)[:, 0]
  q_n = jnp.take_along_axis(q_padded, n[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - q_n, 0.0)
  # All-zero residual happens only when p == q numerically; p is then exact.
  residual = jnp.where(residual.sum(-1, keepdims=True) > 1e-12, residual, p_n)
  y = jax.random.categorical(residual_rng, jnp.log(residual), axis=-1)
  return n, y.astype(jnp.int32)


def speculate_and_verify(target_params, draft_params, state: SpecState, *,
                         target_config: LlamaConfig, draft_config: LlamaConfig,
                         k: int, sampling: Sampling) -> tuple[SpecState, StepResult,
                                                              jax.Array]:
  """One draft-k, verify-once step. Also returns the target logits [B, k+1, V].

  Those logits are the teacher for online distillation: no second target pass.
  """
  rng, draft_rng, accept_rng = jax.random.split(state.rng, 3)
  drafted, draft_logits, draft_cache = _propose(
      draft_params, draft_config, state, draft_rng, k, sampling)
  m = state.target_cache.lengths
  verify_tokens = jnp.concatenate([state.last_token[:, None], drafted], axis=1)
  target_logits, target_cache = llama.apply(target_params, target_config,
                                            verify_tokens, state.target_cache)
  p = sampling.probs(target_logits)
  q = sampling.probs(draft_logits)
  n, y = _accept(drafted, p, q, target_logits, accept_rng, sampling)

  positions = jnp.arange(k + 1)
  emitted = jnp.where(positions < n[:, None],
                      jnp.pad(drafted, ((0, 0), (0, 1))),
                      jnp.where(positions == n[:, None], y[:, None], 0))
  active = ~state.output.done
  out_start = state.output.lengths
  output, kept = state.output.append(emitted, n + 1, target_config.eos_id)

  take = lambda i: jnp.take_along_axis(emitted, jnp.maximum(i, 0)[:, None],
                                       axis=1)[:, 0]
  last = jnp.where(kept > 0, take(kept - 1), state.last_token)
  prev = jnp.where(kept > 1, take(kept - 2),
                   jnp.where(kept == 1, state.last_token, state.prev_token))
  target_cache = target_cache.with_lengths(m + kept)

  alpha = jnp.minimum(p[:, :k], q).sum(axis=-1)
  is_verified = (jnp.arange(k) <= n[:, None]) & active[:, None]
  is_accepted = (jnp.arange(k) < n[:, None]) & active[:, None]
  f32 = lambda x: x.astype(jnp.float32)
  mt = state.metrics
  metrics = Metrics(
      proposed=mt.proposed + f32(active) * k,
      accepted=mt.accepted + f32(jnp.where(active, n, 0)),
      target_calls=mt.target_calls + f32(active),
      emitted=mt.emitted + f32(kept),
      alpha_sum=mt.alpha_sum + (alpha * is_verified).sum(axis=1),
      alpha_count=mt.alpha_count + f32(is_verified).sum(axis=1),
      reached_by_position=mt.reached_by_position + f32(is_verified).sum(axis=0),
      accepted_by_position=mt.accepted_by_position + f32(is_accepted).sum(axis=0))
  state = SpecState(target_cache, draft_cache, output, prev, last, rng, metrics)
  result = StepResult(drafted, n, emitted, kept, alpha, is_verified, active,
                      out_start)
  return state, result, target_logits


@functools.partial(
    jax.jit,
    static_argnames=("target_config", "draft_config", "k", "sampling",
                     "max_new_tokens"),
    donate_argnames=("target_cache", "draft_cache"))
def generate(target_params, draft_params, prompts_BxP, prompt_lens_B,
             target_cache: KVCache, draft_cache: KVCache, rng, *,
             target_config: LlamaConfig, draft_config: LlamaConfig, k: int,
             sampling: Sampling, max_new_tokens: int) -> SpecState:
  """Speculative decoding until every row is done, in one compiled loop."""
  state = start(target_params, draft_params, prompts_BxP, prompt_lens_B,
                target_cache, draft_cache, rng, target_config=target_config,
                draft_config=draft_config, k=k, max_new_tokens=max_new_tokens)
  step = functools.partial(speculate_and_verify, target_params, draft_params,
                           target_config=target_config, draft_config=draft_config,
                           k=k, sampling=sampling)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.output.done),
                            lambda s: step(s)[0], state)
