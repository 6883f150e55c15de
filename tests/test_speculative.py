"""Speculative decoding: lossless greedy output for every draft kind, rollback,
alpha, per-position metrics, per-row stops, and the n-gram lookup."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import (Context, Draft, HybridDraft, ModelDraft,
                                     MultiDraft, NGramDraft, Verified)
from osd_jax.decoding.drafts.base import Forced
from osd_jax.decoding.engine import Engine, acceptance_by_position
from osd_jax.decoding.prefill import prefill
from osd_jax.decoding.sampling import GREEDY, Sampling
from osd_jax.models import llama
from osd_jax.models.kv_cache import KVCache
from tests.test_generation import (MAX_NEW, REAL_PROMPTS, VOCAB,
                                   prompts_of_lengths, tiny_model, with_eos)

apply = jax.jit(llama.apply, static_argnames="config")
prefill_jit = jax.jit(prefill, static_argnames="config")
start = jax.jit(speculative.start, static_argnames=(
    "target_config", "drafter", "k", "cache_size"))
step = jax.jit(speculative.speculate_and_verify, static_argnames=(
    "target_config", "drafter", "k", "sampling", "window"))
CACHE = 64
CONFIDENCE = 0.1  # a threshold the tiny draft's draws fall on both sides of


def pad(rows, width):
  out = np.zeros((len(rows), width), np.int32)
  for o, r in zip(out, rows):
    o[:len(r)] = r
  return jnp.asarray(out)


def ngram_draft(model):
  return Draft(NGramDraft(model.config.vocab_size), (), "n-gram")


def hybrid_draft(draft):
  """n-gram rows where lookup matches, the model draft elsewhere."""
  drafter = HybridDraft(ModelDraft(draft.config), NGramDraft(draft.config.vocab_size))
  return Draft(drafter, draft.params, f"hybrid of {draft.source}")


@pytest.fixture(scope="module")
def prompts():
  """Lengths 1 to 16; the last one repeats a passage, as code and SQL answers do.

  It is a prompt, the model's own continuation, then the prompt again: the
  n-gram draft proposes that continuation, which the target partly repeats.
  """
  model = tiny_model()
  base = prompts_of_lengths((1, 9, 5, 4), seed=4)
  [continued] = Engine(model, max_new_tokens=8).generate_ids([base[-1]])
  return base[:-1] + [base[-1] + continued.token_ids + base[-1]]


def run(target, draft, prompts, k, sampling=Sampling(), trim_verify=False,
        num_slots=8):
  """Engine results, one per prompt (trimmed over several slots: packed)."""
  engine = Engine(target, draft, k=k, sampling=sampling, max_new_tokens=MAX_NEW,
                  trim_verify=trim_verify, num_slots=num_slots)
  return engine.generate_ids(prompts)


def total(results, name):
  return sum(r.metrics[name] for r in results)


@pytest.fixture(scope="module")
def target(prompts):
  """The tiny target, with an EOS it emits so rows stop at different times."""
  model = tiny_model()
  return with_eos(model, run(model, None, prompts, k=0)[1].token_ids[4])


@pytest.fixture(scope="module")
def target_greedy(target, prompts):
  rows = [r.token_ids for r in run(target, None, prompts, k=0)]
  assert len({len(r) for r in rows}) > 1 and min(len(r) for r in rows) < MAX_NEW
  return rows


def drafts(target):
  head = tuple(range(0, 64, 2)) + (2, 3)  # misses half the target's vocabulary
  derived = draft_lib.derive(target, [0, 1, 2])
  return {
      "derived": derived,
      "independent": with_eos(tiny_model(seed=7, num_layers=2), target.config.eos_id),
      "restricted": draft_lib.derive(target, [0, 1], head),
      "ngram": ngram_draft(target),
      "hybrid": hybrid_draft(draft_lib.derive(target, [0])),
      "confident": confident(derived),
      "hybrid_confident": Draft(
          HybridDraft(confident(derived).drafter, NGramDraft(VOCAB)),
          derived.params, "hybrid, confident"),
      # The serving defaults: short proposals, for trimmed verification.
      "hybrid_short": Draft(
          HybridDraft(ModelDraft(derived.config, confidence_threshold=0.6,
                                 stop_before_unconfident=True),
                      NGramDraft(VOCAB, max_ngram=4, min_ngram=2, cap_at_match=True)),
          derived.params, "hybrid, confident, capped lookup"),
      # Gated: the draft runs only while it pays (here, rarely).
      "hybrid_gated": Draft(
          HybridDraft(ModelDraft(derived.config, confidence_threshold=0.6,
                                 stop_before_unconfident=True),
                      NGramDraft(VOCAB, max_ngram=4, min_ngram=2, cap_at_match=True),
                      draft_cost=0.3),
          derived.params, "gated hybrid"),
  }


def confident(draft, threshold=CONFIDENCE):
  """The model draft, stopping each row's proposal after an unlikely draw."""
  return Draft(ModelDraft(draft.config, confidence_threshold=threshold),
               draft.params, f"{draft.source}, confidence {threshold}")


# Every draft, k from 1 to 5, full-width and trimmed verification (packed
# over 8 slots); not every combination: each compiles its own programs.
@pytest.mark.parametrize("draft_name, k, trim_verify", [
    ("derived", 1, False), ("derived", 5, False), ("derived", 3, True),
    ("independent", 3, False), ("restricted", 2, False), ("ngram", 1, False),
    ("ngram", 4, False), ("hybrid", 2, False), ("confident", 4, True),
    ("hybrid_confident", 4, False), ("hybrid_short", 4, True),
    ("hybrid_gated", 4, True), ("hybrid_gated", 3, False)])
def test_greedy_speculative_equals_greedy_target(target, target_greedy, prompts,
                                                 draft_name, k, trim_verify):
  results = run(target, drafts(target)[draft_name], prompts, k,
                trim_verify=trim_verify)
  assert [r.token_ids for r in results] == target_greedy
  proposed, accepted = total(results, "proposed"), total(results, "accepted")
  if draft_name in ("derived", "ngram", "hybrid"):  # accept and reject paths ran
    assert 0 < accepted < proposed
  if draft_name in ("ngram", "confident", "hybrid_short"):  # some proposed < k
    assert proposed < k * total(results, "target_calls")
  if draft_name == "confident":  # and some more than one
    assert proposed > total(results, "target_calls")


@pytest.mark.parametrize("draft_name", ["hybrid_short", "confident"])
def test_one_slot_trimmed_to_the_proposals_width_equals_greedy_target(
    target, target_greedy, prompts, draft_name):
  """At one slot trimming runs at the proposal's width, not packed."""
  results = run(target, drafts(target)[draft_name], prompts, 4, trim_verify=True,
                num_slots=1)
  assert [r.token_ids for r in results] == target_greedy


def test_identical_draft_accepts_everything_greedy(target, target_greedy, prompts):
  results = run(target, target, prompts, k=3)
  assert [r.token_ids for r in results] == target_greedy
  for r in results:
    assert r.metrics["accepted"] == r.metrics["proposed"] > 0
    assert r.metrics["alpha"] == pytest.approx(1.0, abs=1e-5)
  # The whole-batch loop agrees, and so do its per-position counts.
  lens = jnp.asarray([len(p) for p in prompts])
  state = speculative.generate(
      target.params, target.params, pad(prompts, 32), lens, jax.random.key(0),
      target_config=target.config, drafter=ModelDraft(target.config), k=3,
      sampling=GREEDY, max_new_tokens=MAX_NEW, cache_size=CACHE)
  assert [speculative.output_of(state, row) for row in range(len(prompts))] == (
      target_greedy)
  assert acceptance_by_position(state.metrics) == [1.0, 1.0, 1.0]


def test_identical_draft_accepts_everything_sampled(target, prompts):
  results = run(target, target, prompts, k=3, sampling=Sampling(temperature=1.0))
  for r in results:
    assert r.metrics["accepted"] == r.metrics["proposed"] > 0
  assert total(results, "accepted") > total(results, "target_calls")


# --- n-gram lookup ------------------------------------------------------------


def lookup_context(rows, width=24):
  """A Context whose rows end at their last token; stale tokens after them
  repeat the row, so a lookup reading past the end would find false matches."""
  tokens = np.zeros((len(rows), width), np.int32)
  for out, row in zip(tokens, rows):
    out[:] = np.resize(row, width)
  lengths = jnp.asarray([len(r) - 1 for r in rows], jnp.int32)
  return Context(jnp.asarray(tokens), lengths, jnp.zeros_like(lengths))


def reference_lookup(row, k, max_ngram, min_ngram):
  """What prompt lookup should propose, in plain Python (None: no match)."""
  for n in range(max_ngram, min_ngram - 1, -1):
    earlier = [j for j in range(len(row) - n) if row[j:j + n] == row[-n:]]
    if earlier:
      copied = row[max(earlier) + n:]
      return [copied[i % len(copied)] for i in range(k)]
  return None


HAND_BUILT = [  # (row, k, proposal)
    # [5, 6] occurred twice: the latest match is copied.
    ([5, 6, 20, 30, 5, 6, 40, 41, 5, 6], 4, [40, 41, 5, 6]),
    # The 3-gram [7, 5, 6] beats the later 2-gram [5, 6].
    ([7, 5, 6, 10, 11, 5, 6, 12, 7, 5, 6], 3, [10, 11, 5]),
    # The copy runs past the end and keeps copying.
    ([9, 8, 9], 5, [8, 9, 8, 9, 8]),
    ([5, 6, 20, 30, 5, 6, 40, 41, 5, 6], 6, [40, 41, 5, 6, 40, 41]),
    # No earlier occurrence of any suffix: nothing proposed.
    ([3, 4, 5, 6, 7], 3, None),
    ([3], 3, None),
]


@pytest.mark.parametrize("row, k, expected", HAND_BUILT)
def test_ngram_proposes_the_latest_longest_match(row, k, expected):
  assert reference_lookup(row, k, 3, 1) == expected
  proposal, _ = NGramDraft(VOCAB, max_ngram=3).propose(
      (), (), lookup_context([row]), None, k, GREEDY, None)
  assert int(proposal.num_proposed[0]) == (0 if expected is None else k)
  if expected is not None:
    assert proposal.tokens[0].tolist() == expected
    # q is one-hot at the copied tokens, whatever the sampling rule.
    for sampling in (GREEDY, Sampling(temperature=1.5, top_k=5, top_p=0.9)):
      np.testing.assert_array_equal(sampling.probs(proposal.logits[0]),
                                    jax.nn.one_hot(expected, VOCAB))


def test_ngram_lookup_matches_the_reference_on_random_rows():
  rng = np.random.default_rng(0)
  rows = [rng.integers(3, 7, int(n)).tolist() for n in rng.integers(1, 20, 64)]
  for max_ngram, min_ngram in [(3, 1), (2, 2), (4, 2)]:
    drafter = NGramDraft(VOCAB, max_ngram=max_ngram, min_ngram=min_ngram)
    tokens, counts = drafter.lookup(lookup_context(rows), 4)
    for row, got, count in zip(rows, tokens.tolist(), counts.tolist()):
      expected = reference_lookup(row, 4, max_ngram, min_ngram)
      assert count == (0 if expected is None else 4)
      if count:
        assert got == expected


def matched_length(row, max_ngram, min_ngram):
  """n of the longest suffix n-gram that occurred earlier (0: none)."""
  return next((n for n in range(max_ngram, min_ngram - 1, -1)
               if any(row[j:j + n] == row[-n:] for j in range(len(row) - n))), 0)


def test_a_capped_lookup_proposes_as_many_tokens_as_it_matched():
  rng = np.random.default_rng(1)
  rows = [rng.integers(3, 6, int(n)).tolist() for n in rng.integers(1, 24, 64)]
  for k in (2, 3):
    capped = NGramDraft(VOCAB, max_ngram=4, min_ngram=1, cap_at_match=True)
    full = dataclasses.replace(capped, cap_at_match=False)
    ctx = lookup_context(rows)
    tokens, counts = capped.lookup(ctx, k)
    np.testing.assert_array_equal(tokens, full.lookup(ctx, k)[0])
    expected = [min(matched_length(row, 4, 1), k) for row in rows]
    assert counts.tolist() == expected
    assert 0 < sum(c < k for c in expected if c) and sum(c == k for c in expected)


def test_hybrid_proposes_ngram_where_matched_and_the_draft_elsewhere(target):
  k, sampling = 3, Sampling(temperature=1.2)
  draft = draft_lib.derive(target, [0])
  model = ModelDraft(draft.config)
  hybrid = HybridDraft(model, NGramDraft(VOCAB))
  rows = [row for row, _, _ in HAND_BUILT[:3]] + [[10, 11, 12], [3, 4, 5, 6, 7]]
  ctx = lookup_context(rows)
  copied, counts = hybrid.ngram.lookup(ctx, k)
  matched = counts > 0
  assert matched.tolist() == [True, True, True, False, False]
  params = model.prepare(draft.params)
  cache = jax.jit(model.prefill)(params, model.init_state(len(rows), 24),
                                 ctx.tokens, ctx.lengths + 1)
  keys = speculative.row_keys(jax.random.key(1), len(rows))
  propose = lambda drafter: jax.jit(functools.partial(
      drafter.propose, k=k, sampling=sampling, window=None))(
          params, cache, ctx, keys)[0]
  own, mixed = propose(model), propose(hybrid)
  np.testing.assert_array_equal(mixed.num_proposed, k)
  hot = np.asarray(matched)
  np.testing.assert_array_equal(mixed.tokens[hot], copied[hot])
  np.testing.assert_array_equal(sampling.probs(mixed.logits[hot]),
                                jax.nn.one_hot(copied[hot], VOCAB))
  np.testing.assert_array_equal(mixed.tokens[~hot], own.tokens[~hot])
  np.testing.assert_allclose(mixed.logits[~hot], own.logits[~hot], atol=1e-5)
  # A capped lookup's rows propose its counts; the draft's rows still k.
  capped = HybridDraft(model, dataclasses.replace(hybrid.ngram, cap_at_match=True))
  counts = capped.ngram.lookup(ctx, k)[1]
  assert counts.tolist()[:3] != [k] * 3
  np.testing.assert_array_equal(propose(capped).num_proposed,
                                np.where(hot, counts, k))


@pytest.mark.parametrize("stop_before, temperature", [(False, 1.2), (True, 0.1)])
def test_a_confident_draft_stops_at_its_first_unlikely_draw(target, stop_before,
                                                           temperature):
  """Row b proposes draws up to and including the first with q < threshold,
  or, with stop_before_unconfident, up to it and as one-hots (a threshold
  above 0.5, reached at a low temperature)."""
  k, sampling = 4, Sampling(temperature=temperature)
  draft = draft_lib.derive(target, [0])
  rows = [row for row, _, _ in HAND_BUILT[:3]] + [[10, 11, 12], [3, 4, 5, 6, 7]]
  ctx = lookup_context(rows)
  keys = speculative.row_keys(jax.random.key(1), len(rows))

  def propose(drafter):
    params = drafter.prepare(draft.params)
    cache = jax.jit(drafter.prefill)(params, drafter.init_state(len(rows), 24),
                                     ctx.tokens, ctx.lengths + 1)
    return jax.jit(functools.partial(drafter.propose, k=k, sampling=sampling,
                                     window=None))(params, cache, ctx, keys)[0]

  full = propose(ModelDraft(draft.config))
  q_x = np.take_along_axis(np.asarray(sampling.probs(full.logits)),
                           np.asarray(full.tokens)[..., None], axis=2)[..., 0]
  # Both outcomes occur; halfway between two draws, not at one: the draft's
  # own softmax may differ from this one in the last bit.
  values = np.sort(q_x[:, :k - 1].ravel())
  middle = len(values) // 2
  threshold = float(values[middle - 1] + values[middle]) / 2
  assert threshold > 0.5 or not stop_before
  unlikely = q_x[:, :k - 1] < threshold
  after = np.where(unlikely.any(1), unlikely.argmax(1) + 1, k)
  expected = np.where(unlikely.any(1), after - 1, k) if stop_before else after
  assert expected.min() == (0 if stop_before else 1) and expected.max() > 1
  short = propose(ModelDraft(draft.config, confidence_threshold=threshold,
                             stop_before_unconfident=stop_before))
  np.testing.assert_array_equal(short.num_proposed, expected)
  for row, count in enumerate(expected):
    np.testing.assert_array_equal(short.tokens[row, :count], full.tokens[row, :count])
    if stop_before:  # given that it was proposed, a draw is the one likely token
      np.testing.assert_array_equal(sampling.probs(short.logits[row, :count]),
                                    jax.nn.one_hot(full.tokens[row, :count], VOCAB))
    else:
      np.testing.assert_allclose(short.logits[row, :count], full.logits[row, :count],
                                 atol=1e-5)


def test_full_width_steps_turn_the_short_proposal_options_off():
  config = tiny_model().config
  short = HybridDraft(
      ModelDraft(config, confidence_threshold=0.6, stop_before_unconfident=True),
      NGramDraft(VOCAB, max_ngram=4, min_ngram=2, cap_at_match=True))
  full = MultiDraft(short, 2).at_full_width().base
  assert full == HybridDraft(ModelDraft(config, confidence_threshold=0.6),
                             NGramDraft(VOCAB, max_ngram=4, min_ngram=2,
                                        history_min_share=0.0))


def test_a_confidence_threshold_must_be_a_probability():
  with pytest.raises(ValueError, match="confidence threshold"):
    ModelDraft(tiny_model().config, confidence_threshold=1.0)


# --- one step at a time -------------------------------------------------------

K = 3
SAMPLED = Sampling(temperature=1.2, top_k=30)


def trajectory_draft(target, kind):
  """(the model draft or None, the drafter) of each kind the step runs."""
  draft = draft_lib.derive(target, [0, 1])
  return {"model": (draft, ModelDraft(draft.config)),
          "hybrid": (draft, hybrid_draft(draft).drafter),
          "ngram": (None, NGramDraft(VOCAB))}[kind]


@pytest.fixture(scope="module", params=["model", "hybrid", "ngram"])
def trajectory(request, target, prompts):
  """States and step results of sampled speculative decoding until all rows stop.

  Each prompt runs twice (rows draw with their own keys): more kinds of stop.
  """
  draft, drafter = trajectory_draft(target, request.param)
  target_params = llama.for_decoding(target.params, target.config)
  draft_params = drafter.prepare(draft.params if draft else (), target_params)
  prompts = prompts * 2
  b = len(prompts)
  state, _ = start(target_params, draft_params, pad(prompts, 32),
                   jnp.asarray([len(p) for p in prompts]), jnp.full((b,), MAX_NEW),
                   speculative.row_keys(jax.random.key(0), b),
                   target_config=target.config, drafter=drafter, k=K,
                   cache_size=CACHE)
  states, results = [state], []
  while not np.all(state.done):
    state, result = step(target_params, draft_params, state,
                         target_config=target.config, drafter=drafter, k=K,
                         sampling=SAMPLED)
    states.append(state)
    results.append(result)
    assert len(results) < 2 * MAX_NEW
  return draft, drafter, states, results


def context(state, row):
  """Prompt plus emitted tokens c_0..c_m: everything the next step conditions on."""
  return np.asarray(state.tokens[row, :int(state.lengths[row]) + 1]).tolist()


def np_probs(logits, sampling):
  """Temperature and top-k in numpy, independent of Sampling."""
  z = np.asarray(logits, np.float64) / sampling.temperature
  kth = np.sort(z, axis=-1)[..., -sampling.top_k][..., None]
  z = np.where(z < kth, -np.inf, z)
  z = np.exp(z - z.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def test_alpha_is_one_minus_total_variation(target, trajectory):
  draft, drafter, states, results = trajectory
  width = CACHE + K + 1
  checked = 0
  for before, result in zip(states, results):
    p = SAMPLED.probs(result.target_logits)
    ctx = Context(before.tokens, before.lengths, before.route)
    copied, matched = NGramDraft(VOCAB).lookup(ctx, K)
    for row in np.flatnonzero(result.active):
      seq, x = context(before, row), np.asarray(result.drafted[row]).tolist()
      num_proposed = int(result.num_proposed[row])
      t_logits, _ = apply(target.params, target.config, pad([seq + x], width))
      first = len(seq) - 1
      p_np = np_probs(t_logits[0, first:first + K + 1], SAMPLED)
      np.testing.assert_allclose(p[row], p_np, atol=2e-5)
      if drafter.__class__ is not ModelDraft and matched[row]:  # copied: q one-hot
        assert x == copied[row].tolist()
        q_np = np.eye(VOCAB)[x]
      elif num_proposed:
        d_logits, _ = apply(draft.params, draft.config, pad([seq + x[:-1]], width))
        q_np = np_probs(d_logits[0, first:first + K], SAMPLED)
      n = int(result.num_accepted[row])
      np.testing.assert_array_equal(result.is_verified[row],
                                    (np.arange(K) <= n) & (np.arange(K) < num_proposed))
      if num_proposed:
        tv = 0.5 * np.abs(p_np[:K] - q_np).sum(-1)
        np.testing.assert_allclose(result.alpha[row], 1 - tv, atol=2e-5)
        checked += 1
  assert checked >= 6


def test_caches_after_rejection_equal_fresh_prefill(target, trajectory):
  draft, _, states, results = trajectory
  rejections = 0
  rows = range(len(states[0].prompt_lens))
  for after, result in zip(states[1:], results):
    committed = [context(after, row)[:-1] for row in rows]  # c_m is uncached
    lengths = np.array([len(c) for c in committed])
    np.testing.assert_array_equal(after.target_cache.lengths, lengths)
    checks = [(target, after.target_cache, lengths)]
    if isinstance(after.draft, KVCache):  # a prefix: the next proposal catches up
      assert np.all(np.asarray(after.draft.lengths) <= lengths)
      checks.append((draft, after.draft, np.asarray(after.draft.lengths)))
    for model, cache, valid in checks:
      _, fresh = prefill_jit(model.params, model.config, pad(committed, CACHE),
                             jnp.asarray(lengths),
                             model.config.init_cache(len(rows), CACHE))
      for row in rows:
        for got, want in zip(cache.valid_entries(row, valid[row]),
                             fresh.valid_entries(row, valid[row])):
          np.testing.assert_allclose(got, want, atol=1e-5)
    rejections += int(np.sum(np.asarray(result.active) &
                             (result.num_accepted < result.num_proposed)))
  assert rejections > 0


def test_finished_rows_stop_changing(trajectory):
  _, _, states, results = trajectory
  finished_early = 0
  for before, after, result in zip(states, states[1:], results):
    done = np.asarray(before.done)
    np.testing.assert_array_equal(result.active, ~done)
    for row in np.flatnonzero(done):
      finished_early += 1
      assert int(result.kept[row]) == 0 and bool(after.done[row])
      for a, b in [(before.tokens, after.tokens),
                   (before.lengths, after.lengths),
                   *zip(jax.tree.leaves(before.metrics),
                        jax.tree.leaves(after.metrics))]:
        np.testing.assert_array_equal(a[row], b[row])
  assert finished_early > 0


def test_rows_stop_at_eos_or_length(target, trajectory):
  _, _, states, _ = trajectory
  stopped_by_eos = []
  for row in range(len(states[-1].prompt_lens)):
    out = speculative.output_of(states[-1], row)
    is_eos = np.asarray(out) == target.config.eos_id
    assert len(out) == MAX_NEW or (is_eos[-1] and len(out) < MAX_NEW)
    assert not is_eos[:-1].any()
    stopped_by_eos.append(bool(is_eos[-1]))
  assert set(stopped_by_eos) == {True, False}  # both kinds of stop happened


def test_metrics_are_consistent(trajectory):
  """Running sums, per row and per draft position, agree with the step results."""
  _, _, states, results = trajectory
  m = jax.tree.map(np.asarray, states[-1].metrics)
  sum_of = lambda f: sum(np.asarray(f(r), np.float32) for r in results)
  np.testing.assert_array_equal(m.emitted, states[-1].num_generated)
  np.testing.assert_array_equal(m.target_calls, sum_of(lambda r: r.active))
  np.testing.assert_array_equal(m.proposed,
                                sum_of(lambda r: r.active * r.num_proposed))
  np.testing.assert_array_equal(m.alpha_count, sum_of(lambda r: r.is_verified.sum(1)))
  np.testing.assert_array_equal(m.reached_by_position, sum_of(lambda r: r.is_verified))
  # Draft position i+1 is verified exactly when position i was accepted.
  np.testing.assert_array_equal(m.accepted_by_position[:, :-1],
                                m.reached_by_position[:, 1:])
  np.testing.assert_array_equal(
      m.reached_by_position[:, 0], sum_of(lambda r: r.active & (r.num_proposed > 0)))
  np.testing.assert_array_equal(m.accepted_by_position.sum(1), m.accepted)
  assert 0 < m.accepted.sum() < m.proposed.sum()


@pytest.mark.parametrize("needed", [1, 2, 4])
def test_a_trimmed_verification_scores_only_what_was_proposed(target, needed):
  """Below the full width, the pass runs on the first `needed` positions: they
  match the full pass, the rest is zero padding, and the cache holds the
  same committed entries."""
  config = target.config
  params = llama.for_decoding(target.params, config)
  tokens = jnp.asarray([[3, 5, 7, 9, 11], [4, 6, 8, 10, 12]], jnp.int32)
  cache = config.init_cache(2, CACHE).with_lengths(jnp.asarray([0, 0], jnp.int32))
  cache = llama.forward(params, config, jnp.asarray([[1, 2, 3], [2, 3, 4]]), cache)[1]
  score = jax.jit(speculative.verify_pass, static_argnums=(1, 5))
  full_h, full_logits, full_cache = score(params, config, tokens, cache, None, (5,), 5)
  h, logits, new_cache = score(params, config, tokens, cache, None,
                               speculative.verify_widths(4), needed)
  np.testing.assert_allclose(h[:, :needed], full_h[:, :needed], atol=1e-5)
  np.testing.assert_allclose(logits[:, :needed], full_logits[:, :needed], atol=1e-4)
  assert not np.any(np.asarray(h[:, needed:])) and np.any(np.asarray(full_h[:, needed:]))
  for row in range(2):
    for ours, theirs in zip(new_cache.valid_entries(row, 3 + needed),
                            full_cache.valid_entries(row, 3 + needed)):
      np.testing.assert_allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("counts", [(1, 1, 1), (5, 0, 3), (2, 5, 1), (0, 0, 0)])
def test_a_packed_verification_scores_only_each_rows_proposal(target, counts):
  """Packed, each row's first counts[b] positions (0: a finished row) match
  the full pass, the rest read as zeros, and the cache holds the same
  committed entries: rows of different proposal lengths share one pass."""
  config = target.config
  params = llama.for_decoding(target.params, config)
  tokens = jnp.asarray([[3, 5, 7, 9, 11], [4, 6, 8, 10, 12], [1, 9, 2, 8, 3]],
                       jnp.int32)
  cache = config.init_cache(3, CACHE)
  cache = llama.forward(params, config, jnp.asarray([[1, 2, 3], [2, 3, 4], [5, 4, 3]]),
                        cache)[1]
  score = jax.jit(speculative.verify_pass, static_argnums=(1, 5))
  full_h, full_logits, full_cache = score(params, config, tokens, cache, None, (5,), 5)
  packed = jax.jit(speculative.verify_packed, static_argnums=1)
  h, logits, new_cache = packed(params, config, tokens, cache, None,
                                jnp.asarray(counts, jnp.int32))
  for row, count in enumerate(counts):
    np.testing.assert_allclose(h[row, :count], full_h[row, :count], atol=1e-5)
    np.testing.assert_allclose(logits[row, :count], full_logits[row, :count],
                               atol=1e-4)
    assert not np.any(np.asarray(h[row, count:]))
    assert not np.any(np.asarray(logits[row, count:]))
    for ours, theirs in zip(new_cache.valid_entries(row, 3 + count),
                            full_cache.valid_entries(row, 3 + count)):
      np.testing.assert_allclose(ours, theirs, atol=1e-5)


def lagging(target, lags):
  """A draft cache whose two rows lag c_0..c_m by `lags` tokens, and the context."""
  draft = draft_lib.derive(target, [0, 1])
  drafter = ModelDraft(draft.config)
  params = llama.for_decoding(draft.params, draft.config)
  seqs = [[(7 * i + 3 * r) % VOCAB for i in range(20 + r)] for r in range(2)]
  m = np.array([len(q) - 1 for q in seqs])  # c_m is the last token
  held = [max(int(mi) - lag, 0) for mi, lag in zip(m, lags)]
  cache = draft.config.init_cache(2, CACHE)
  _, cache = prefill_jit(params, draft.config, pad([q[:h] for q, h in zip(seqs, held)],
                                                    32), jnp.asarray(held), cache)
  ctx = Context(pad(seqs, CACHE), jnp.asarray(m, jnp.int32), jnp.zeros((2,), jnp.int32))
  return draft, drafter, params, seqs, m, held, cache, ctx


@pytest.mark.parametrize("lags", [(0, 0), (1, 0), (3, 5), (4, 11), (12, 2)])
def test_a_proposal_catches_up_on_what_its_cache_lacks(target, lags):
  """A draft cache lagging the committed tokens by any amount (steps where
  lookup proposed alone, a fully accepted proposal's last draw) is fed the
  rest before drawing: its first draw's logits and its cache equal a fresh
  prefill of c_0..c_m, for lags shorter and longer than one pass (k + 1)."""
  draft, drafter, params, seqs, m, _, cache, ctx = lagging(target, lags)
  catch_up = jax.jit(drafter.catch_up, static_argnums=(3, 4))
  logits, caught = catch_up(params, cache, ctx, K + 1, None)
  np.testing.assert_array_equal(caught.lengths, m + 1)
  fresh_logits, fresh = prefill_jit(params, draft.config, pad(seqs, 32),
                                    jnp.asarray(m + 1), draft.config.init_cache(2, CACHE))
  for row in range(2):
    for got, want in zip(caught.valid_entries(row, int(m[row]) + 1),
                         fresh.valid_entries(row, int(m[row]) + 1)):
      np.testing.assert_allclose(got, want, atol=1e-5)
  full, _ = apply(params, draft.config, pad(seqs, 32))
  np.testing.assert_allclose(logits, full[np.arange(2), m], atol=1e-4)
  # A proposal begins there: the same first draw, k draws in all.
  proposal, after = jax.jit(drafter.propose, static_argnums=(4, 5, 6))(
      params, cache, ctx, speculative.row_keys(jax.random.key(1), 2), K, GREEDY, None)
  np.testing.assert_array_equal(proposal.tokens[:, 0], np.argmax(logits, axis=-1))
  np.testing.assert_array_equal(after.lengths, m + K)


@pytest.mark.parametrize("lags", [(3, 11), (12, 2), (1, 0), (0, 30)])
def test_an_idle_row_catches_up_only_as_far_as_the_passes_reach(target, lags):
  """Row 1 is forced and left idle (the gated hybrid's lookup rows): the
  passes run for row 0 alone, row 1 moves on only as far as they reach,
  and what it holds is still a prefix of c_0..c_m (a fresh prefill's)."""
  draft, drafter, params, seqs, m, held, cache, ctx = lagging(target, lags)
  forced = Forced(jnp.full((2, K), 5, jnp.int32), jnp.array([0, 2]),
                  idle=jnp.array([False, True]))
  proposal, after = jax.jit(drafter.propose, static_argnums=(4, 5, 6))(
      params, cache, ctx, speculative.row_keys(jax.random.key(1), 2), K, GREEDY, None,
      forced)
  lengths = np.asarray(after.lengths)
  assert lengths[0] == m[0] + K  # caught up, then fed its k - 1 draws
  # Passes of k + 1 while row 0 has more to go, then one as wide as its rest:
  # row 1 moves with a pass only when it has more than it to go.
  rest, idle_rest, reached = int(m[0]) + 1 - held[0], int(m[1]) + 1 - held[1], 0
  while rest > K + 1:
    if idle_rest > K + 1:
      idle_rest, reached = idle_rest - (K + 1), reached + K + 1
    rest -= K + 1
  assert lengths[1] == held[1] + reached + min(idle_rest, rest)
  assert proposal.tokens[1].tolist()[:2] == [5, 5] and int(proposal.num_proposed[1]) == 2
  _, fresh = prefill_jit(params, draft.config, pad(seqs, 32), jnp.asarray(m + 1),
                         draft.config.init_cache(2, CACHE))
  for row in range(2):
    n = min(int(lengths[row]), int(m[row]) + 1)
    for got, want in zip(after.valid_entries(row, n), fresh.valid_entries(row, n)):
      np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_commit_reads_nothing_and_keeps_what_the_proposal_fed(target):
  """After its own proposal the draft's cache holds c_m, x_1, .. : a commit
  keeps min(kept, fed) of them, bit for bit, reading nothing; a copy that did
  not serve the row (MultiDraft) keeps only c_m; a step that fed nothing
  (lookup alone) keeps the cache as it was."""
  draft = draft_lib.derive(target, [0, 1])
  drafter = ModelDraft(draft.config)
  params = llama.for_decoding(draft.params, draft.config)
  start = jnp.asarray([3], jnp.int32)
  cache = draft.config.init_cache(1, CACHE).with_lengths(jnp.zeros((1,), jnp.int32))
  cache = llama.forward(params, draft.config, jnp.asarray([[1, 2, 3]]), cache)[1]
  # The proposal fed c_m = 5 and a draw 6; verification read [5, 6, 7, ..].
  planted = llama.forward(params, draft.config, jnp.asarray([[5, 6]]), cache)[1]
  tokens = jnp.asarray([[5, 6, 7, 9, 11]], jnp.int32)

  def verified(kept, own=None):
    return Verified(jnp.zeros((1, 5, draft.config.hidden_dim)), tokens, tokens,
                    jnp.asarray([kept], jnp.int32), start, jnp.zeros((1,), jnp.int32),
                    own)

  commit = jax.jit(drafter.commit)
  for kept, own, cached, source in [(1, None, 4, planted), (2, None, 5, planted),
                                    (4, None, 5, planted),
                                    (2, jnp.asarray([False]), 4, planted),
                                    (3, None, 3, cache)]:
    out = commit(params, source, verified(kept, own), None)
    np.testing.assert_array_equal(out.lengths, [cached])
    for got, want in zip(out.k + out.v, source.k + source.v):
      np.testing.assert_array_equal(got, want)  # nothing was read or written
  ours, other = MultiDraft(drafter, 2).commit((params, params), (planted, planted),
                                              verified(2), None)
  np.testing.assert_array_equal(ours.lengths, [5])
  np.testing.assert_array_equal(other.lengths, [4])


# --- the real model -----------------------------------------------------------


@pytest.mark.real_model
def test_real_greedy_speculative_equals_target(smollm2):
  """SmolLM2, k = 3, with its derived draft (2 layers, 8,192-token head), the
  n-gram draft and their hybrid, on a batch of mixed lengths."""
  head = draft_lib.frequent_token_ids(smollm2.tokenizer, 8192)
  derived = draft_lib.derive(smollm2, [0, 1], head)
  prompts = REAL_PROMPTS + ["Hello"]
  target_only = Engine(smollm2, max_new_tokens=16).generate(prompts)
  assert len({len(c.prompt_ids) for c in target_only}) == len(prompts)
  expected = [c.token_ids for c in target_only]
  for name, draft in [("derived", derived), ("ngram", ngram_draft(smollm2)),
                      ("hybrid", hybrid_draft(derived))]:
    out = Engine(smollm2, draft, k=3, max_new_tokens=16).generate(prompts)
    assert [c.token_ids for c in out] == expected, name
    for c in out:
      assert c.metrics["target_calls"] <= len(c.token_ids)
      assert not 0 > c.metrics["alpha"] and not c.metrics["alpha"] > 1  # NaN: none
    if name != "ngram":
      assert sum(c.metrics["accepted"] for c in out) > 0
