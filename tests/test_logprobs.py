"""logprobs and top_logprobs: the target's own log-probs of what was emitted.

One live engine on the tiny pair serves every test here (compiles dominate
on CPU): its log-probs are checked against a plain teacher-forced forward of
the target, then through the HTTP layer with the openai client.
"""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import Draft, ModelDraft
from osd_jax.models import llama
from osd_jax.serving import live, online
from osd_jax.serving.live_request import Failed, Finished, LiveRequest, RequestParams
from tests import tiny_models

MAX_LOGPROBS = 5
MAX_TOKENS = 12
CFG = online.OnlineConfig(k=3, sampling=None, max_new_tokens=16, cache_size=64,
                          steps_per_call=2, learn=False, trim_verify=True,
                          max_logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def engine():
  target, draft = tiny_models.pair()
  engine = live.LiveEngine(
      target, Draft(ModelDraft(draft.config), draft.params, draft.source), CFG,
      live.LiveConfig(num_slots=4), mesh=online.make_mesh(1))
  engine.start(warm_up=False)
  try:
    yield engine
  finally:
    engine.stop()


def _serve(engine, prompts, params):
  """Every prompt as one request, all in flight together; per request its
  (ids, TokenLogprobs, stats)."""
  results = [([], [], None) for _ in prompts]
  done = threading.Semaphore(0)

  def listener(i):
    def on_event(event):
      ids, logprobs, _ = results[i]
      if isinstance(event, Failed):
        raise AssertionError(event.message)
      if isinstance(event, Finished):
        results[i] = (ids, logprobs, event.stats)
        done.release()
      else:
        ids.extend(event.ids)
        logprobs.extend(event.logprobs)
    return on_event

  for i, prompt in enumerate(prompts):
    engine.submit(LiveRequest(prompt, params, listener(i)))
  for _ in prompts:
    assert done.acquire(timeout=300)
  return results


def _teacher_forced(target, prompt, output):
  """log_softmax of one uncached target pass over prompt + output, at the
  positions that predicted each output token: [len(output), V]."""
  tokens = jnp.asarray([list(prompt) + list(output)], jnp.int32)
  logits, _ = llama.apply(target.params, target.config, tokens)
  return np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1:-1], axis=-1))


def _assert_exact(target, prompt, ids, logprobs, top_n):
  reference = _teacher_forced(target, prompt, ids)
  assert len(logprobs) == len(ids)
  got = np.array([lp.logprob for lp in logprobs])
  want = reference[np.arange(len(ids)), ids]
  np.testing.assert_allclose(got, want, atol=1e-4)
  top_values, top_ids = jax.lax.top_k(reference, top_n)
  got_ids = np.array([[t for t, _ in lp.top] for lp in logprobs])
  got_values = np.array([[v for _, v in lp.top] for lp in logprobs])
  assert got_ids.shape == (len(ids), top_n)
  np.testing.assert_allclose(got_values, top_values, atol=1e-4)
  # Ids agree wherever the ranking is not a near tie.
  gaps = np.abs(np.diff(np.asarray(top_values), axis=1))
  clear = np.ones_like(got_ids, bool)
  clear[:, :-1] &= gaps > 1e-3
  clear[:, 1:] &= gaps > 1e-3
  np.testing.assert_array_equal(got_ids[clear], np.asarray(top_ids)[clear])


PROMPTS = [[1] + list(np.random.default_rng(i).integers(5, tiny_models.VOCAB, n))
           for i, n in enumerate((4, 9, 15, 6))]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_logprobs_equal_a_teacher_forced_target_pass(engine, temperature):
  params = RequestParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=3,
                         logprobs=3)
  results = _serve(engine, PROMPTS, params)
  proposed = accepted = 0
  for prompt, (ids, logprobs, stats) in zip(PROMPTS, results):
    assert len(ids) == stats.completion_tokens
    _assert_exact(engine.target, prompt, ids, logprobs, 3)
    if temperature == 0.0:  # the emitted token is the target's first choice
      assert [lp.top[0][0] for lp in logprobs] == ids
    proposed += stats.num_draft_tokens
    accepted += stats.num_accepted_tokens
  # Drafts were accepted and rejected: the log-probs come from every kind of
  # verified position (accepted drafts, corrections and bonus tokens).
  assert 0 < accepted < proposed
