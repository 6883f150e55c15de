"""Speculative decoding: lossless greedy output, rollback, alpha and per-row stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.decoding import speculative
from osd_jax.decoding.engine import Engine, acceptance_by_position, summarize
from osd_jax.decoding.prefill import prefill
from osd_jax.decoding.sampling import Sampling
from osd_jax.models import llama
from tests.test_generation import (MAX_NEW, PROMPTS, REAL_PROMPTS, tiny_model,
                                   with_eos)

apply = jax.jit(llama.apply, static_argnames="config")
prefill_jit = jax.jit(prefill, static_argnames="config")
start = jax.jit(speculative.start, static_argnames=(
    "target_config", "draft_config", "k", "max_new_tokens"))
step = jax.jit(speculative.speculate_and_verify, static_argnames=(
    "target_config", "draft_config", "k", "sampling"))


def run(target, draft, k, sampling=Sampling(), max_new_tokens=MAX_NEW):
  """Engine output: (ids per row cut at its length, metrics or None)."""
  engine = Engine(target, draft, k=k, sampling=sampling,
                  max_new_tokens=max_new_tokens)
  tokens, lengths, metrics = engine.generate_ids(PROMPTS)
  return [row[:n].tolist() for row, n in zip(tokens, lengths)], metrics


@pytest.fixture(scope="module")
def target():
  """The tiny target, with an EOS it emits so rows stop at different times."""
  model = tiny_model()
  greedy, _ = run(model, None, k=0)
  return with_eos(model, greedy[0][4])


@pytest.fixture(scope="module")
def target_greedy(target):
  rows, _ = run(target, None, k=0)
  assert len({len(r) for r in rows}) > 1 and min(len(r) for r in rows) < MAX_NEW
  return rows


def drafts(target):
  head = tuple(range(0, 64, 2)) + (2, 3)  # misses half the target's vocabulary
  return {
      "derived": draft_lib.derive(target, [0, 1, 2]),
      "independent": with_eos(tiny_model(seed=7, num_layers=2), target.config.eos_id),
      "restricted": draft_lib.derive(target, [0, 1], head),
  }


@pytest.mark.parametrize("draft_name, k", [
    ("derived", 1), ("derived", 2), ("derived", 4), ("derived", 5),
    ("independent", 3), ("restricted", 3)])
def test_greedy_speculative_equals_greedy_target(target, target_greedy,
                                                 draft_name, k):
  rows, metrics = run(target, drafts(target)[draft_name], k)
  assert rows == target_greedy
  m = summarize(metrics)
  if draft_name == "derived":  # both the accept and the reject paths ran
    assert 0 < m["acceptance_rate"] < 1


def test_identical_draft_accepts_everything_greedy(target, target_greedy):
  rows, metrics = run(target, target, k=3)
  assert rows == target_greedy
  m = summarize(metrics)
  assert m["accepted"] == m["proposed"] > 0
  assert acceptance_by_position(metrics) == [1.0, 1.0, 1.0]
  assert m["alpha"] == pytest.approx(1.0, abs=1e-5)


def test_identical_draft_accepts_everything_sampled(target):
  _, metrics = run(target, target, k=3, sampling=Sampling(temperature=1.0))
  m = summarize(metrics)
  assert m["accepted"] == m["proposed"] > 0
  assert m["tokens_per_target_call"] > 1


# --- one step at a time -------------------------------------------------------

K = 3
SAMPLED = Sampling(temperature=1.2, top_k=30)


def pad(rows, width):
  out = np.zeros((len(rows), width), np.int32)
  for o, r in zip(out, rows):
    o[:len(r)] = r
  return jnp.asarray(out)


@pytest.fixture(scope="module")
def trajectory(target):
  """States and step results of sampled speculative decoding until all rows stop."""
  draft = drafts(target)["derived"]
  lens = np.array([len(p) for p in PROMPTS])
  cache_size = 32 + MAX_NEW + K
  state = start(target.params, draft.params, pad(PROMPTS, 32), jnp.asarray(lens),
                target.config.init_cache(3, cache_size),
                draft.config.init_cache(3, cache_size), jax.random.key(0),
                target_config=target.config, draft_config=draft.config, k=K,
                max_new_tokens=MAX_NEW)
  states, results, target_probs = [state], [], []
  while not np.all(state.output.done):
    state, result, target_logits = step(target.params, draft.params, state,
                                        target_config=target.config,
                                        draft_config=draft.config, k=K,
                                        sampling=SAMPLED)
    states.append(state)
    results.append(result)
    target_probs.append(SAMPLED.probs(target_logits))
    assert len(results) < 2 * MAX_NEW
  return draft, states, results, target_probs


def context(state, row):
  """Prompt plus emitted tokens: everything the next step conditions on."""
  n = int(state.output.lengths[row])
  return PROMPTS[row] + np.asarray(state.output.tokens[row, :n]).tolist()


def np_probs(logits, sampling):
  """Temperature and top-k in numpy, independent of Sampling."""
  z = np.asarray(logits, np.float64) / sampling.temperature
  kth = np.sort(z, axis=-1)[..., -sampling.top_k][..., None]
  z = np.where(z < kth, -np.inf, z)
  z = np.exp(z - z.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def test_alpha_is_one_minus_total_variation(target, trajectory):
  draft, states, results, target_probs = trajectory
  width = 32 + MAX_NEW + K + 1
  checked = 0
  for before, result, p in zip(states, results, target_probs):
    for row in np.flatnonzero(result.active):
      ctx, x = context(before, row), np.asarray(result.drafted[row]).tolist()
      t_logits, _ = apply(target.params, target.config, pad([ctx + x], width))
      d_logits, _ = apply(draft.params, draft.config, pad([ctx + x[:-1]], width))
      first = len(ctx) - 1
      p_np = np_probs(t_logits[0, first:first + K + 1], SAMPLED)
      q_np = np_probs(d_logits[0, first:first + K], SAMPLED)
      tv = 0.5 * np.abs(p_np[:K] - q_np).sum(-1)
      np.testing.assert_allclose(result.alpha[row], 1 - tv, atol=2e-5)
      np.testing.assert_allclose(p[row], p_np, atol=2e-5)
      n = int(result.num_accepted[row])
      np.testing.assert_array_equal(result.is_verified[row], np.arange(K) <= n)
      checked += 1
  assert checked >= 6


def test_caches_after_rejection_equal_fresh_prefill(target, trajectory):
  draft, states, results, _ = trajectory
  rejections = 0
  for before, after, result in zip(states, states[1:], results):
    committed = [context(after, row)[:-1] for row in range(3)]  # last is uncached
    lengths = np.array([len(c) for c in committed])
    np.testing.assert_array_equal(after.target_cache.lengths, lengths)
    cache_size = after.target_cache.size
    for model, cache, valid in [(target, after.target_cache, lengths),
                                (draft, after.draft_cache, lengths - 1)]:
      _, fresh = prefill_jit(model.params, model.config, pad(committed, cache_size),
                             jnp.asarray(lengths), model.config.init_cache(3, cache_size))
      for row in range(3):
        for got, want in [(cache.k, fresh.k), (cache.v, fresh.v)]:
          np.testing.assert_allclose(got[:, row, :valid[row]],
                                     want[:, row, :valid[row]], atol=1e-5)
    rejections += int(np.sum(np.asarray(result.active) & (result.num_accepted < K)))
  assert rejections > 0


def test_finished_rows_stop_changing(trajectory):
  _, states, results, _ = trajectory
  finished_early = 0
  for before, after, result in zip(states, states[1:], results):
    done = np.asarray(before.output.done)
    np.testing.assert_array_equal(result.active, ~done)
    for row in np.flatnonzero(done):
      finished_early += 1
      assert int(result.kept[row]) == 0 and bool(after.output.done[row])
      for a, b in [(before.output.tokens, after.output.tokens),
                   (before.output.lengths, after.output.lengths),
                   (before.target_cache.lengths, after.target_cache.lengths),
                   (before.last_token, after.last_token),
                   (before.prev_token, after.prev_token),
                   (before.metrics.emitted, after.metrics.emitted),
                   (before.metrics.target_calls, after.metrics.target_calls),
                   (before.metrics.alpha_count, after.metrics.alpha_count)]:
        np.testing.assert_array_equal(a[row], b[row])
  assert finished_early > 0


def test_rows_stop_at_eos_or_length(target, trajectory):
  _, states, _, _ = trajectory
  out = states[-1].output
  stopped_by_eos = []
  for row in range(3):
    n = int(out.lengths[row])
    is_eos = np.asarray(out.tokens[row, :n]) == target.config.eos_id
    assert n == MAX_NEW or (is_eos[-1] and n < MAX_NEW)
    assert not is_eos[:-1].any()
    stopped_by_eos.append(bool(is_eos[-1]))
  assert set(stopped_by_eos) == {True, False}  # both kinds of stop happened


def test_metrics_are_consistent(trajectory):
  _, states, results, _ = trajectory
  m = states[-1].metrics
  np.testing.assert_array_equal(m.emitted, states[-1].output.lengths)
  np.testing.assert_array_equal(m.proposed, K * m.target_calls)
  verified = sum(np.asarray(r.is_verified).sum(1) for r in results)
  np.testing.assert_array_equal(m.alpha_count, verified)
  # Draft position i+1 is verified exactly when position i was accepted.
  np.testing.assert_array_equal(m.accepted_by_position[:-1], m.reached_by_position[1:])
  assert m.reached_by_position[0] == m.target_calls.sum()
  assert m.accepted_by_position.sum() == m.accepted.sum()


# --- the real model -----------------------------------------------------------


@pytest.mark.real_model
def test_real_greedy_speculative_equals_target(smollm2):
  """SmolLM2 with its derived draft (2 layers, 8,192-token head), k = 3."""
  head = draft_lib.frequent_token_ids(smollm2.tokenizer, 8192)
  draft = draft_lib.derive(smollm2, [0, 1], head)
  speculative_out = Engine(smollm2, draft, k=3, max_new_tokens=16).generate(REAL_PROMPTS)
  target_only = Engine(smollm2, max_new_tokens=16)
  for c in speculative_out:
    [alone] = target_only.generate([c.prompt])
    assert c.token_ids == alone.token_ids
    assert c.metrics["target_calls"] <= len(c.token_ids)
    assert 0 <= c.metrics["alpha"] <= 1
