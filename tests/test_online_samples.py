"""Where training tokens come from, their loss weights, and the teacher kept for them.

Every source is checked against what the models do on their own: the served
rows against greedy target decoding, the draft rows against greedy draft
decoding, and every kept teacher against a plain target forward pass.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding import generate as generate_lib
from osd_jax.decoding.sampling import GREEDY
from osd_jax.distillation import samples, teacher
from osd_jax.models import llama
from osd_jax.serving import online
from osd_jax.serving.serve import serve_batch
from tests.test_online import K, MAX_NEW, PROMPT_LEN, VOCAB, prompts, tiny_pair

serve = jax.jit(serve_batch, static_argnames=(
    "target_config", "draft_config", "k", "sampling", "max_new_tokens",
    "teacher_k"))
training_rows = jax.jit(online._training_rows,  # pylint: disable=protected-access
                        static_argnums=(6, 7, 8))
apply = jax.jit(llama.apply, static_argnames="config")

BASE = online.OnlineConfig(k=K, max_new_tokens=MAX_NEW, prompt_len=PROMPT_LEN,
                           teacher_k=VOCAB)  # all of it: exact teacher
CFGS = {
    "served": BASE,
    "served_all": dataclasses.replace(BASE, loss_weighting="all"),
    "draft": dataclasses.replace(BASE, sample_source="draft"),
    "mixed_token": dataclasses.replace(BASE, sample_source="mixed_token"),
    "mixed_request": dataclasses.replace(BASE, sample_source="mixed_request"),
}


def greedy_output(model, ids, lens):
  cache = model.config.init_cache(ids.shape[0], PROMPT_LEN + MAX_NEW)
  out, _ = generate_lib.generate(model.params, jnp.asarray(ids), jnp.asarray(lens), cache,
                                  jax.random.key(0), config=model.config,
                                  sampling=GREEDY, max_new_tokens=MAX_NEW)
  return np.asarray(out.tokens[:, :MAX_NEW]), np.asarray(out.lengths)


@pytest.fixture(scope="module")
def data():
  target, draft = tiny_pair()
  ids, lens = prompts(8, seed=2)
  served = serve(target.params, draft.params, jnp.asarray(ids),
                 jnp.asarray(lens), jax.random.key(1),
                 target_config=target.config, draft_config=draft.config, k=K,
                 sampling=GREEDY, max_new_tokens=MAX_NEW, teacher_k=VOCAB)
  rows = {}
  for name, cfg in CFGS.items():
    full, weight, t_ids, t_probs = training_rows(
        target.params, draft.params, jnp.asarray(ids), jnp.asarray(lens),
        served, jax.random.key(7), target.config, draft.config, cfg)
    rows[name] = dict(full=np.asarray(full), weight=np.asarray(weight),
                      teacher=np.asarray(teacher.dense(t_ids, t_probs, VOCAB)))
  return dict(ids=ids, lens=lens, served=jax.device_get(served), rows=rows,
              target_greedy=greedy_output(target, ids, lens),
              draft_greedy=greedy_output(draft, ids, lens))


def generated(full, lens):
  """[B, MAX_NEW] generated tokens out of the placed rows."""
  return np.stack([row[n:n + MAX_NEW] for row, n in zip(full, lens)])


def lengths_of(weight_all):
  return weight_all.sum(1).astype(int)


def next_token_probs(model, full, lens):
  """The model's distribution predicting each generated token g: [B, G, V]."""
  logits, _ = apply(model.params, model.config, jnp.asarray(full))
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  positions = lens[:, None] - 1 + np.arange(MAX_NEW)
  return np.take_along_axis(probs, positions[..., None], axis=1)


def test_served_output_is_greedy_target_output(data):
  tokens, lengths = data["target_greedy"]
  served = data["served"]
  np.testing.assert_array_equal(served.lengths, lengths)
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(served.tokens[row, :n], tokens[row, :n])


def test_served_rows_are_prompt_then_output(data):
  ids, lens, served = data["ids"], data["lens"], data["served"]
  for name in ("served", "served_all"):
    full = data["rows"][name]["full"]
    assert full.shape == (8, PROMPT_LEN + MAX_NEW)
    for row, n in enumerate(lens):
      np.testing.assert_array_equal(full[row, :n], ids[row, :n])
      m = served.lengths[row]
      np.testing.assert_array_equal(full[row, n:n + m], served.tokens[row, :m])


def test_loss_weighting_corrected_vs_all(data):
  """all: every generated position; corrected: only corrections and bonus tokens."""
  served = data["served"]
  gen = np.arange(MAX_NEW) < served.lengths[:, None]
  w_all = data["rows"]["served_all"]["weight"]
  w_corrected = data["rows"]["served"]["weight"]
  np.testing.assert_array_equal(w_all, gen.astype(np.float32))
  np.testing.assert_array_equal(w_corrected, (served.is_corrected & gen).astype(np.float32))
  assert 0 < w_corrected.sum() < w_all.sum()
  # One correction or bonus per verification step; only the last may be cut.
  calls = served.metrics.target_calls
  assert np.all(w_corrected.sum(1) <= calls) and np.all(w_corrected.sum(1) >= calls - 1)


def test_corrected_marks_where_the_draft_was_wrong(data):
  """Uncorrected tokens are accepted drafts: the draft's own greedy choice."""
  _, draft = tiny_pair()
  full, lens = data["rows"]["served"]["full"], data["lens"]
  choice = next_token_probs(draft, full, lens).argmax(-1)
  tokens = generated(full, lens)
  is_gen = np.arange(MAX_NEW) < data["served"].lengths[:, None]
  corrected = data["served"].is_corrected
  accepted = is_gen & ~corrected
  assert accepted.any()
  np.testing.assert_array_equal(choice[accepted], tokens[accepted])
  draft_wrong = is_gen & (choice != tokens)
  assert draft_wrong.any() and corrected[draft_wrong].all()


@pytest.mark.parametrize("name", ["served", "draft", "mixed_token", "mixed_request"])
def test_kept_teacher_is_the_target_at_the_predicting_position(data, name):
  """The teacher of generated token g is the target's next-token distribution at it."""
  target, _ = tiny_pair()
  rows, lens = data["rows"][name], data["lens"]
  expected = next_token_probs(target, rows["full"], lens)
  w = data["rows"]["served_all"]["weight"] if name == "served" else rows["weight"]
  mask = w > 0
  assert mask.sum() > 8
  np.testing.assert_allclose(rows["teacher"][mask], expected[mask], atol=2e-5)


def test_draft_source_is_the_drafts_own_greedy_output(data):
  tokens, lengths = data["draft_greedy"]
  rows = data["rows"]["draft"]
  np.testing.assert_array_equal(lengths_of(rows["weight"]), lengths)
  got = generated(rows["full"], data["lens"])
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(got[row, :n], tokens[row, :n])
  # The draft is not the target: these are not the served tokens.
  assert not np.array_equal(got, generated(data["rows"]["served"]["full"],
                                           data["lens"]))
  # Nothing was verified: every generated position is weighted (not "corrected").
  np.testing.assert_array_equal(
      rows["weight"], (np.arange(MAX_NEW) < lengths[:, None]).astype(np.float32))


def test_mixed_token_source_mixes_within_requests(data):
  """Each token is the target's or the draft's greedy choice on its own prefix."""
  target, draft = tiny_pair()
  rows, lens = data["rows"]["mixed_token"], data["lens"]
  tokens = generated(rows["full"], lens)
  t_choice = next_token_probs(target, rows["full"], lens).argmax(-1)
  d_choice = next_token_probs(draft, rows["full"], lens).argmax(-1)
  mask = rows["weight"] > 0
  assert np.all((tokens == t_choice) | (tokens == d_choice) | ~mask)
  assert ((tokens == t_choice) & (tokens != d_choice) & mask).any()
  assert ((tokens == d_choice) & (tokens != t_choice) & mask).any()
  for other in ("served", "draft"):
    assert not np.array_equal(rows["full"], data["rows"][other]["full"])


def test_mixed_request_source_picks_whole_requests(data):
  rows = data["rows"]["mixed_request"]
  kinds = []
  for row in range(8):
    same = [name for name in ("served", "draft") if
            all(np.array_equal(rows[f][row], data["rows"][name][f][row])
                for f in ("full", "weight", "teacher"))]
    assert same, f"row {row} is neither the served nor the draft row"
    kinds += same
  assert {"served", "draft"} <= set(kinds)


def test_bad_source_or_weighting_raises():
  with pytest.raises(ValueError, match="sample_source"):
    online.OnlineConfig(sample_source="teacher")
  with pytest.raises(ValueError, match="loss_weighting"):
    online.OnlineConfig(loss_weighting="rejected")
  assert set(samples.SOURCES) == {"served", "draft", "mixed_token", "mixed_request"}
