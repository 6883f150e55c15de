"""Lookup in the requests a device served before (NGramDraft.history)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.decoding import lookup_replay
from osd_jax.decoding.drafts import Draft, HybridDraft, ModelDraft, NGramDraft
from osd_jax.decoding.drafts.ngram import History
from osd_jax.decoding.engine import Engine
from osd_jax.serving import driver, online
from tests.test_generation import VOCAB, naive_greedy, prompts_of_lengths, tiny_model
from tests import test_online
from tests.test_online import TIMING, query, random_prompts, tiny_pair
from tests.test_speculative import lookup_context, reference_lookup

SIZE = 32  # positions of a history entry


def reference(row, served, k, max_ngram, min_ngram, cap, history_min, min_share):
  """What the lookup should propose, in plain Python: (tokens, count)."""
  own = reference_lookup(row, k, max_ngram, min_ngram)
  if own is not None:
    n = next(n for n in range(max_ngram, min_ngram - 1, -1)
             if any(row[j:j + n] == row[-n:] for j in range(len(row) - n)))
    return own, min(n, k) if cap else k
  for n in range(max_ngram, history_min - 1, -1):
    if len(row) < n:
      continue
    offers = []  # what followed each served request's latest match, youngest first
    for entry in reversed(served):
      starts = [j for j in range(len(entry) - n) if entry[j:j + n] == row[-n:]]
      if starts:
        offers.append(entry[max(starts) + n:][:k])
    agree = lambda offer, t: sum(len(o) > t and o[:t + 1] == offer[:t + 1]
                                 for o in offers) if len(offer) > t else 0
    # Most agreement on the first token, then the first two, ...; max()
    # keeps the first of equals, the youngest.
    best = max(offers, key=lambda o: [agree(o, t) for t in range(k)], default=[])
    count = 0
    while count < len(best) and agree(best, count) >= min_share * len(offers):
      count += 1
    if count:
      return best, min(count, min(n, k) if cap else k)
  return None, 0


def remembered(rows_served, size):
  """A ring per row that remembered `rows_served[b]`, oldest first (rows of
  a device share theirs; lookup takes any ring a row holds)."""
  remember = jax.jit(History.remember)
  rings = []
  for served in rows_served:
    ring = History.empty(1, size, SIZE)
    for entry in served:
      tokens = jnp.asarray(np.resize(entry, SIZE) * (np.arange(SIZE) < len(entry)))
      ring = remember(ring, tokens, jnp.int32(len(entry)))
    rings.append(ring)
  return jax.tree.map(lambda *rows: jnp.concatenate(rows), *rings)


@pytest.mark.parametrize("cap, history_min, min_share",
                         [(False, 2, 0.0), (True, 2, 0.5), (True, 3, 0.5), (False, 2, 1.0)])
def test_lookup_falls_back_on_what_the_served_requests_continued(cap, history_min,
                                                                 min_share):
  rng = np.random.default_rng(0)
  size, k = 3, 4
  rows = [rng.integers(3, 9, int(n)).tolist() for n in rng.integers(1, 12, 48)]
  # Up to 5 earlier requests a row: a ring of 3 keeps the last 3.
  served = [[rng.integers(3, 9, int(n)).tolist() for n in rng.integers(1, SIZE, int(c))]
            for c in rng.integers(0, 6, len(rows))]
  drafter = NGramDraft(VOCAB, max_ngram=3, min_ngram=2, cap_at_match=cap, history=size,
                       history_min_ngram=history_min, history_min_share=min_share)
  tokens, counts = jax.jit(drafter.lookup, static_argnums=1)(
      lookup_context(rows), k, remembered(served, size))
  from_history = 0
  for row, earlier, got, count in zip(rows, served, tokens.tolist(), counts.tolist()):
    want, want_count = reference(row, earlier[-size:], k, 3, 2, cap, history_min,
                                 min_share)
    assert count == want_count, (row, earlier)
    assert got[:count] == (want or [])[:count]
    from_history += reference_lookup(row, k, 3, 2) is None and count > 0
  assert from_history >= 4  # the fallback was exercised
  # Without a history the same rows find only their own matches.
  plain = NGramDraft(VOCAB, max_ngram=3, min_ngram=2, cap_at_match=cap)
  _, own_counts = plain.lookup(lookup_context(rows), k)
  assert sum(own_counts.tolist()) < sum(counts.tolist())


@pytest.mark.parametrize("min_share, proposed", [(0.0, [7, 2]), (0.5, [7]), (0.7, [])])
def test_the_continuation_most_served_requests_share_wins(min_share, proposed):
  """Three requests continued [5, 6] with [7, 1], [7, 2] and [8, 3] (the
  youngest): 7 has two votes of three, then 1 and 2 one each (the younger
  wins); a token is proposed only while its share of votes reaches min_share."""
  history = remembered([[[5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 8, 3]]], size=3)
  drafter = NGramDraft(VOCAB, max_ngram=2, min_ngram=2, history=3,
                       history_min_share=min_share)
  tokens, count = drafter.lookup(lookup_context([[4, 5, 6]]), 2, history)
  assert tokens[0, :int(count[0])].tolist() == proposed


def test_the_ring_forgets_its_oldest_request_and_ignores_an_empty_one():
  history = remembered([[[5, 6, 7], [5, 6, 8], [5, 6, 9]]], size=2)
  assert sorted(history.lengths[0].tolist()) == [3, 3]
  ctx = lookup_context([[1, 5, 6]])
  drafter = NGramDraft(VOCAB, max_ngram=2, min_ngram=2, history=2, history_min_ngram=2)
  assert drafter.lookup(ctx, 1, history)[0].tolist() == [[9]]  # the youngest
  # A slot that served nothing leaves the ring as it was.
  same = History.remember(history, jnp.zeros((SIZE,), jnp.int32), jnp.int32(0))
  for got, want in zip(jax.tree.leaves(same), jax.tree.leaves(history)):
    np.testing.assert_array_equal(got, want)


def test_every_row_of_a_device_remembers_what_any_slot_served():
  history = History.empty(3, 2, SIZE)
  for entry in ([5, 6, 7], [5, 6, 8], [5, 6, 9]):
    tokens = jnp.zeros((SIZE,), jnp.int32).at[:3].set(jnp.asarray(entry))
    history = history.remember(tokens, jnp.int32(3))
  drafter = NGramDraft(VOCAB, max_ngram=2, min_ngram=2, history=2, history_min_ngram=2)
  ctx = lookup_context([[1, 5, 6], [2, 5, 6], [3, 5, 6]])
  assert drafter.lookup(ctx, 1, history)[0].tolist() == [[9], [9], [9]]
  for leaf in jax.tree.leaves(history):
    assert (leaf == leaf[:1]).all()


def engine(model, drafter, params=()):
  return Engine(model, Draft(drafter, params, "test"), k=3, max_new_tokens=10,
                num_slots=1, steps_per_call=3, trim_verify=True)


@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
def test_served_requests_make_repeats_cheaper_and_outputs_stay_greedy(model, kind):
  """The same prompt twice, one slot: the second copies the first's output."""
  first, other = prompts_of_lengths([7, 5], seed=4)
  stream = [first, other, first]
  expected = [naive_greedy(model, p, 10) for p in stream]
  calls = {}
  for size in (0, 4):
    drafter = NGramDraft(VOCAB, max_ngram=3, min_ngram=2, history=size,
                         history_min_ngram=2)
    params = ()
    if kind == "hybrid":
      derived = draft_lib.derive(model, [0])
      drafter, params = HybridDraft(ModelDraft(derived.config), drafter), derived.params
    results = engine(model, drafter, params).generate_ids(stream)
    assert [r.token_ids for r in results] == expected
    calls[size] = [r.metrics["target_calls"] for r in results]
  assert calls[4][0] == calls[0][0]  # nothing served before: no change
  assert calls[4][2] <= 4 < calls[0][2]  # 10 tokens, 3 a call + 1 from the copy


def served(drafter, queries, devices):
  """(records without timings, final state) of the online loop serving
  `queries` on 4 slots, no learning."""
  target, _ = tiny_pair()
  cfg = online.OnlineConfig(k=3, max_new_tokens=10, cache_size=64, steps_per_call=2,
                            learn=False, trim_verify=True)
  records = []
  state = driver.run_stream(target, Draft(drafter, (), "test"), queries, cfg,
                            num_slots=4, mesh=online.make_mesh(devices), seed=0,
                            chat=False, on_request=records.append)
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records], state


def test_the_slots_of_a_device_share_its_history_on_any_number_of_devices():
  """Every slot of a device holds the requests any of them served; outputs
  stay the same, and prompts served again cost fewer target calls."""
  queries = [query(p) for p in random_prompts((6, 9, 4, 7), seed=5) * 3]
  vocab = test_online.VOCAB
  plain = NGramDraft(vocab, max_ngram=3, min_ngram=2)
  with_history = NGramDraft(vocab, max_ngram=3, min_ngram=2, history=16)
  without, _ = served(plain, queries, 1)
  # By their third round every prompt has left a slot of each device.
  calls = lambda records: sum(r["target_calls"] for r in records if r["request"] >= 8)
  for devices in (1, 2):
    records, state = served(with_history, queries, devices)
    assert [r["new_tokens"] for r in records] == [r["new_tokens"] for r in without]
    assert calls(records) < 0.7 * calls(without)
    (history,) = jax.device_get(state.slots.draft)  # one draft
    # Each device's slots keep one ring: the requests that left its slots,
    # all but the last in each of the 4 slots.
    rings = [jax.tree.map(lambda x: x[d * 4 // devices:(d + 1) * 4 // devices], history)
             for d in range(devices)]
    for ring in rings:
      for leaf in jax.tree.leaves(ring):
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
    assert sum(int((ring.lengths[0] > 0).sum()) for ring in rings) == len(queries) - 4


def test_the_lookup_replay_makes_the_engines_target_calls(model):
  """lookup_replay (experiments.bench_lookup) replays lookup over greedy
  answers instead of serving them: per request, its target calls equal the
  engine's, the served-request history and its vote included."""
  a, b, c = prompts_of_lengths([7, 5, 6], seed=4)
  stream = [a, b, a, c, b, a, c]
  drafter = NGramDraft(VOCAB, max_ngram=3, min_ngram=2, cap_at_match=True, history=4,
                       history_min_share=0.5)
  results = engine(model, drafter).generate_ids(stream)
  answers = [{"domain": "test", "prompt": p, "answer": r.token_ids}
             for p, r in zip(stream, results)]
  rows = lookup_replay.replay(drafter, answers, k=3, size=SIZE)
  assert [r["calls"] for r in rows] == [r.metrics["target_calls"] for r in results]
  assert [r["tokens"] for r in rows] == [len(r.token_ids) for r in results]
  assert sum(r["accepted"] for r in rows) >= 10  # repeats were copied
