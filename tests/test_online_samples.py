"""Where training tokens come from, their loss weights, and the teacher kept for them.

A short driver run per setting, learning never triggered, so the buffer ends
up holding one sample per request. Every sample is checked against what the
models do on their own: served tokens against greedy target decoding, draft
tokens against greedy draft decoding, every kept teacher against a plain
target forward pass over the sample.
"""

import dataclasses

import jax
import numpy as np
import pytest

from osd_jax.distillation import samples, teacher
from osd_jax.models import llama
from osd_jax.serving import online
from tests.test_online import (K, MAX_NEW, VOCAB, greedy, prompt_ids, query,
                               random_prompts, serve_stream, tiny_pair)

PROMPTS = random_prompts([3, 5, 7, 9, 12, 4, 10, 6], seed=7)
BASE = online.OnlineConfig(
    k=K, max_new_tokens=MAX_NEW, cache_size=32, steps_per_call=2,
    update_interval=10_000, buffer_capacity=len(PROMPTS),
    teacher_k=VOCAB)  # all of it: the exact teacher
CFGS = {
    "served": BASE,  # corrected weighting, as published
    "served_all": dataclasses.replace(BASE, loss_weighting="all"),
    "draft": dataclasses.replace(BASE, sample_source="draft"),
    "mixed_token": dataclasses.replace(BASE, sample_source="mixed_token"),
    "mixed_request": dataclasses.replace(BASE, sample_source="mixed_request"),
}
apply = jax.jit(llama.apply, static_argnames="config")


def buffered(run) -> dict:
  """Per prompt, its sample: tokens, where generation starts, weights, teacher."""
  buffer = run["state"].buffer
  valid, tokens, starts, weight, ids, probs = jax.device_get(
      (buffer.is_valid[0, 0], buffer.tokens[0, 0], buffer.gen_start[0, 0],
       buffer.loss_weight[0, 0], buffer.teacher_ids[0, 0],
       buffer.teacher_probs[0, 0]))
  assert valid.sum() == len(PROMPTS)
  dense = np.asarray(teacher.dense(ids, probs, VOCAB))
  out = {}
  for i in np.flatnonzero(valid):
    prompt = tuple(int(t) for t in tokens[i, :starts[i] + 1])
    out[prompt] = dict(full=tokens[i], start=int(starts[i]), weight=weight[i],
                       teacher=dense[i])
  assert set(out) == set(PROMPTS)
  return out


@pytest.fixture(scope="module")
def runs():
  queries = [query(p) for p in PROMPTS]
  out = {}
  for name, cfg in CFGS.items():
    run = serve_stream(queries, cfg, devices=1, num_slots=4)
    assert not run["state"].num_updates.any()
    calls = {prompt_ids(queries[r["request"]]): r["target_calls"]
             for r in run["records"]}
    out[name] = dict(samples=buffered(run), outputs=run["tap"].outputs,
                     target_calls=calls)
  return out


def generated(sample) -> np.ndarray:
  """The MAX_NEW positions after the prompt."""
  return sample["full"][sample["start"] + 1:sample["start"] + 1 + MAX_NEW]


def next_token_probs(model: str, sample) -> np.ndarray:
  """The model's distribution predicting each generated token: [MAX_NEW, V]."""
  target, draft = tiny_pair()
  config, params = ((target.config, target.params) if model == "target"
                    else (draft.drafter.config, draft.params))
  logits, _ = apply(params, config, sample["full"][None])
  probs = np.asarray(jax.nn.softmax(logits[0], axis=-1))
  return probs[sample["start"] + np.arange(MAX_NEW)]


def test_served_output_is_greedy_target_output(runs):
  for name in ("served", "served_all"):
    outputs = runs[name]["outputs"]
    assert [outputs[i] for i in range(len(PROMPTS))] == [greedy(p) for p in PROMPTS]


def test_served_samples_are_prompt_then_output(runs):
  for name in ("served", "served_all"):
    for prompt, sample in runs[name]["samples"].items():
      out = greedy(prompt)
      assert sample["start"] == len(prompt) - 1
      np.testing.assert_array_equal(generated(sample)[:len(out)], out)


def test_loss_weighting_corrected_vs_all(runs):
  """all: every generated position; corrected: only corrections and bonus tokens."""
  total_all = total_corrected = 0
  for prompt in PROMPTS:
    n = len(greedy(prompt))
    w_all = runs["served_all"]["samples"][prompt]["weight"]
    w_corrected = runs["served"]["samples"][prompt]["weight"]
    np.testing.assert_array_equal(w_all, (np.arange(MAX_NEW) < n).astype(np.float32))
    assert set(np.unique(w_corrected)) <= {0.0, 1.0}
    assert np.all(w_corrected <= w_all)
    # One correction or bonus per verification step; only the last may be cut.
    calls = runs["served"]["target_calls"][prompt]
    assert calls - 1 <= w_corrected.sum() <= calls
    total_all += w_all.sum()
    total_corrected += w_corrected.sum()
  assert 0 < total_corrected < total_all


def test_corrected_marks_where_the_draft_was_wrong(runs):
  """Positions not corrected are accepted drafts: the draft's own greedy choice."""
  accepted_seen = wrong_seen = 0
  for prompt in PROMPTS:
    sample = runs["served"]["samples"][prompt]
    choice = next_token_probs("draft", sample).argmax(-1)
    tokens = generated(sample)
    is_gen = np.arange(MAX_NEW) < len(greedy(prompt))
    corrected = sample["weight"] > 0
    accepted = is_gen & ~corrected
    np.testing.assert_array_equal(choice[accepted], tokens[accepted])
    draft_wrong = is_gen & (choice != tokens)
    assert corrected[draft_wrong].all()
    accepted_seen += accepted.sum()
    wrong_seen += draft_wrong.sum()
  assert accepted_seen and wrong_seen


@pytest.mark.parametrize("name", list(CFGS))
def test_kept_teacher_is_the_target_at_the_predicting_position(runs, name):
  """The teacher of generated token g is the target's next-token distribution there."""
  weighted = 0
  for sample in runs[name]["samples"].values():
    mask = sample["weight"] > 0
    expected = next_token_probs("target", sample)
    np.testing.assert_allclose(sample["teacher"][mask], expected[mask], atol=2e-5)
    weighted += mask.sum()
  assert weighted > len(PROMPTS)


def test_draft_source_is_the_drafts_own_greedy_output(runs):
  differs = False
  for prompt, sample in runs["draft"]["samples"].items():
    own = greedy(prompt, model="draft")
    np.testing.assert_array_equal(generated(sample)[:len(own)], own)
    # Nothing was verified: every generated position is weighted.
    np.testing.assert_array_equal(
        sample["weight"], (np.arange(MAX_NEW) < len(own)).astype(np.float32))
    differs |= own != greedy(prompt)
  assert differs  # the draft is not the target: these are not the served tokens


def test_mixed_token_source_mixes_within_requests(runs):
  """Each token is the target's or the draft's greedy choice on its own prefix."""
  target_only = draft_only = 0
  for sample in runs["mixed_token"]["samples"].values():
    tokens, mask = generated(sample), sample["weight"] > 0
    t_choice = next_token_probs("target", sample).argmax(-1)
    d_choice = next_token_probs("draft", sample).argmax(-1)
    assert np.all((tokens == t_choice) | (tokens == d_choice) | ~mask)
    target_only += ((tokens == t_choice) & (tokens != d_choice) & mask).sum()
    draft_only += ((tokens == d_choice) & (tokens != t_choice) & mask).sum()
  assert target_only and draft_only


def test_mixed_request_source_picks_whole_requests(runs):
  kinds = set()
  for prompt, sample in runs["mixed_request"]["samples"].items():
    same = [name for name in ("served", "draft") if all(
        np.array_equal(sample[f], runs[name]["samples"][prompt][f])
        for f in ("full", "start", "weight", "teacher"))]
    assert same, f"{prompt} is neither its served nor its draft sample"
    kinds.update(same)
  assert kinds == {"served", "draft"}


def test_bad_source_or_weighting_raises():
  with pytest.raises(ValueError, match="sample_source"):
    online.OnlineConfig(sample_source="teacher")
  with pytest.raises(ValueError, match="loss_weighting"):
    online.OnlineConfig(loss_weighting="rejected")
  assert set(samples.SOURCES) == {"served", "draft", "mixed_token", "mixed_request"}
