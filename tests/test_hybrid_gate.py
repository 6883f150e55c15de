"""The hybrid's gate: the learned draft runs only while its tokens pay for its pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.decoding.drafts import Draft, HybridDraft, ModelDraft, NGramDraft
from osd_jax.decoding.drafts.gate import EXPLORE_STEPS, Gate
from osd_jax.decoding.engine import Engine
from osd_jax.serving import driver, online
from tests import test_online
from tests.test_generation import VOCAB, prompts_of_lengths, tiny_model, with_eos

MAX_NEW = 40  # enough steps for a closed gate to show


def gate(accepted, emitted, age=(9, 9), live=(True, True), own=(True, True),
         misses=None):
  b = len(age)
  misses = (0,) * b if misses is None else misses
  return Gate(jnp.array(accepted, jnp.float32), jnp.array(emitted, jnp.float32),
              jnp.array(age, jnp.int32), jnp.array(live), jnp.array(own),
              jnp.zeros((b,), bool), jnp.array(misses, jnp.int32),
              jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32),
              jnp.zeros((b,), jnp.int32))


def test_serves_the_missed_rows_while_their_accepted_tokens_outweigh_the_cost():
  missed = jnp.array([True, False])
  # Row 0 yields 0.3 a step; both rows emit 2: the pass pays below cost 0.075.
  assert gate([0.3, 5.0], [2.0, 2.0]).serves(missed, cost=0.07).tolist() == [True, False]
  assert not gate([0.3, 5.0], [2.0, 2.0]).serves(missed, cost=0.08).any()
  # Only rows lookup missed count: row 1's yield does not open it.
  assert not gate([0.0, 5.0], [2.0, 2.0]).serves(missed, cost=0.01).any()
  # No row missed: nothing to serve, however good the draft.
  assert not gate([5.0, 5.0], [1.0, 1.0]).serves(jnp.array([False, False]), 0.01).any()


def test_finished_and_foreign_rows_are_not_served():
  missed = jnp.array([True, True])
  dead = gate([5.0, 5.0], [1.0, 1.0], live=(False, False))
  assert not dead.serves(missed, cost=0.1).any()
  foreign = gate([5.0, 0.0], [1.0, 1.0], own=(False, True))
  assert not foreign.serves(missed, cost=0.1).any()


def test_a_closed_gate_serves_only_requests_still_exploring():
  missed = jnp.array([True, True])
  young = gate([0.0, 0.0], [2.0, 2.0], age=(EXPLORE_STEPS - 1, EXPLORE_STEPS))
  assert young.serves(missed, cost=0.5).tolist() == [True, False]
  opened = gate([3.0, 3.0], [2.0, 2.0], age=(EXPLORE_STEPS - 1, EXPLORE_STEPS))
  assert opened.serves(missed, cost=0.5).tolist() == [True, True]


def test_means_move_only_where_measured():
  g = gate([1.0, 1.0], [1.0, 1.0]).proposed(jnp.array([True, False]),
                                            jnp.array([True, False]))
  after = g.after(jnp.array([3, 0]), own=True)
  np.testing.assert_allclose(after.accepted, [1.0 + 0.1 * (2 - 1.0), 1.0])
  np.testing.assert_allclose(after.emitted, [1.0 + 0.1 * (3 - 1.0), 1.0])
  assert after.live.tolist() == [True, False] and not after.ran.any()
  inserted = after.insert_row(jnp.int32(1))
  assert inserted.age.tolist() == [10, 0] and inserted.live.tolist() == [True, True]
  np.testing.assert_allclose(inserted.accepted, after.accepted)  # the slot's


def run_gate(draft_accepts: bool, steps: int, explore_every: int, k: int = 3,
             cost: float = 0.3, estimate_at: int | None = None,
             start: float = 0.0, proposes: bool = True):
  """One row of a gate (closed: its accepted mean at `start`) on a stream
  where lookup always misses: the steps the draft ran on. A draft that
  `draft_accepts` gets all k tokens accepted (k + 1 kept), else none (1
  kept); one that never `proposes` stops before its first draw every pass.
  `estimate_at`: the step before which an update's estimate of that draft
  comes in."""
  g = gate([start], [1.0], age=(9,), live=(True,), own=(True,))
  missed = jnp.array([True])
  served = []
  for step in range(steps):
    if step == estimate_at:
      g = g.reestimated(jnp.float32(k if draft_accepts else 0.0))
    ran = g.serves(missed, cost, explore_every)
    g = g.proposed(ran, missed, None if proposes else jnp.array([0]))
    kept = k + 1 if (draft_accepts and bool(ran[0])) else 1
    g = g.after(jnp.array([kept]), own=True)
    if bool(ran[0]):
      served.append(step)
  return served


@pytest.mark.parametrize("every", [1, 4, 8])
def test_a_closed_gate_explores_every_nth_miss_step(every):
  """Exploring is a fixed schedule of the row's lookup misses: the first,
  then every n-th (only past steps and this step's lookup decide)."""
  assert run_gate(False, 24, every) == list(range(0, 24, every))
  g = gate([0.0], [1.0], age=(9,), live=(True,), own=(True,), misses=(every,))
  assert g.serves(jnp.array([False]), 0.3, every).tolist() == [False]  # a lookup hit
  g = g.proposed(jnp.array([False]), jnp.array([False]))
  assert int(g.misses[0]) == every  # hits do not count


def test_a_draft_that_improves_gets_proposals_again_within_n_steps():
  """Closed on a useless draft, without exploring it never proposes again;
  exploring every 4th miss it proposes within 4 steps of improving, and an
  update's estimate reopens it at once."""
  assert run_gate(True, 40, explore_every=0) == []  # today's gate: shut for good
  served = run_gate(True, 40, explore_every=4)
  assert served[0] < 4
  # Measured proposals raise the mean until the gate stays open.
  assert served[-12:] == list(range(28, 40))
  reopened = run_gate(True, 40, explore_every=0, estimate_at=10)
  assert reopened == list(range(10, 40))


def test_a_useless_draft_stays_closed():
  """It proposes on the exploring steps only: a share 1/n of the misses."""
  for every in (2, 5):
    assert len(run_gate(False, 100, every)) == 100 // every
  # An estimate of a useless draft does not open it either.
  assert run_gate(False, 30, 0, estimate_at=5) == []


def test_a_pass_that_proposed_nothing_is_measured_as_nothing_accepted():
  """A draft that stopped before its first (unconfident) draw spent its pass
  and yielded no token: its mean falls as that of one whose draws were all
  rejected."""
  g = gate([1.0, 1.0], [1.0, 1.0]).proposed(
      jnp.array([True, True]), jnp.array([True, True]), jnp.array([0, 3]))
  after = g.after(jnp.array([1, 1]), own=True)
  np.testing.assert_allclose(after.accepted, [0.9, 0.9])
  assert after.drafted.tolist() == [0, 3] and after.drafted_accepted.tolist() == [0, 0]


def test_a_draft_that_never_proposes_closes_the_optimistic_gate():
  """The gate starts open (every proposal as if accepted once). A draft that
  is never confident enough to propose is closed after a few passes, then
  runs only on the exploring steps; counted as no evidence, it ran on every
  miss for good (2026-12-07: 1.6 ms of a 30 ms step in the main job)."""
  served = run_gate(False, 40, explore_every=4, start=1.0, proposes=False)
  assert served[-6:] == [16, 20, 24, 28, 32, 36]
  assert len(served) < 40 // 4 + 12


def test_an_estimate_blends_into_the_rows_of_its_draft_only():
  g = gate([1.0, 1.0], [1.0, 1.0], own=(True, False)).reestimated(jnp.float32(3.0))
  np.testing.assert_allclose(g.accepted, [2.0, 1.0])
  same = g.reestimated(jnp.float32(jnp.nan))
  np.testing.assert_allclose(same.accepted, g.accepted)


def test_a_negative_exploring_period_is_refused():
  with pytest.raises(ValueError, match="every n-th"):
    HybridDraft(ModelDraft(test_online.tiny_pair()[1].drafter.config),
                NGramDraft(VOCAB), 0.3, explore_every=-1)


@pytest.fixture(scope="module")
def target():
  model = tiny_model()
  return with_eos(model, VOCAB - 1)  # an EOS it rarely emits: long answers


@pytest.fixture(scope="module")
def prompts():
  return prompts_of_lengths((3, 7, 5, 9, 4, 6), seed=11)


def serve(target, draft, prompts, draft_cost=None):
  """(greedy token ids per prompt, drafted tokens proposed in all) over 2 slots."""
  drafter = NGramDraft(VOCAB, max_ngram=3, min_ngram=3)  # lookup misses often
  if draft is not None:
    drafter = HybridDraft(ModelDraft(draft.config), drafter, draft_cost or 0.0)
    draft = Draft(drafter, draft.params, "hybrid")
  else:
    draft = Draft(drafter, (), "lookup")
  results = Engine(target, draft, k=3, max_new_tokens=MAX_NEW,
                   num_slots=2).generate_ids(prompts)
  return [r.token_ids for r in results], sum(r.metrics["proposed"] for r in results)


def test_gate_closes_on_a_useless_draft_and_stays_open_on_a_good_one(target, prompts):
  greedy, _ = serve(target, None, prompts)
  useless = with_eos(tiny_model(seed=7, num_layers=1), target.config.eos_id)
  exact = draft_lib.derive(target, list(range(target.config.num_layers)))
  counts = {}
  for name, draft in (("useless", useless), ("exact", exact)):
    for cost in (None, 0.3):
      tokens, counts[name, cost] = serve(target, draft, prompts, cost)
      assert tokens == greedy, (name, cost)
  lookup = serve(target, None, prompts)[1]
  # A draft the target rejects: after each request's first steps it mostly
  # stops proposing, so the hybrid proposes little more than lookup alone.
  assert lookup < counts["useless", 0.3] < counts["useless", None]
  assert counts["useless", 0.3] - lookup < 0.5 * (counts["useless", None] - lookup)
  # The exact draft yields k tokens a pass: the gate never closes.
  assert counts["exact", 0.3] == counts["exact", None]


def test_the_online_loop_serves_alike_on_one_device_and_two():
  """The gate state rides with the slots (sharded by row); each device
  decides for its own slots, and what is served does not change."""
  target, draft = test_online.tiny_pair()
  drafter = HybridDraft(draft.drafter, NGramDraft(test_online.VOCAB, max_ngram=3,
                                                  min_ngram=2), draft_cost=0.3)
  rng = np.random.default_rng(5)
  prompts = [rng.integers(3, test_online.VOCAB, n) for n in (6, 9, 4, 7, 5, 8)] * 2
  cfg = online.OnlineConfig(k=3, max_new_tokens=10, cache_size=64, steps_per_call=2,
                            learn=False, trim_verify=True)
  served = {}
  for devices in (1, 2):
    records = []
    state = driver.run_stream(target, Draft(drafter, draft.params, "gated"),
                              [test_online.query(p) for p in prompts], cfg, num_slots=4,
                              mesh=online.make_mesh(devices), seed=0, chat=False,
                              on_request=records.append)
    served[devices] = [(r["request"], r["new_tokens"]) for r in records]
    (gate_state,) = [leaf for leaf in jax.tree.leaves(
        state.slots.draft, is_leaf=lambda x: isinstance(x, Gate)) if isinstance(leaf, Gate)]
    assert gate_state.accepted.shape == (4,) and int(gate_state.age.min()) > 0
  assert sorted(served[1]) == sorted(served[2]) and len(served[1]) == len(prompts)


def test_an_update_estimate_becomes_expected_tokens_of_a_proposal():
  """Per-token acceptance a becomes a + a^2 + ... + a^k accepted tokens of a
  k-token proposal, blended into the gate; a plain hybrid has no gate."""
  _, draft = test_online.tiny_pair()
  lookup = NGramDraft(test_online.VOCAB)
  gated = HybridDraft(draft.drafter, lookup, draft_cost=0.3)
  state = gated.init_state(2, 16)
  after = gated.with_estimate(state, jnp.float32(0.5), k=3)
  (g,) = [x for x in jax.tree.leaves(after, is_leaf=lambda x: isinstance(x, Gate))
          if isinstance(x, Gate)]
  np.testing.assert_allclose(g.accepted, 1.0 + 0.5 * (0.875 - 1.0))
  plain = HybridDraft(draft.drafter, lookup)
  state = plain.init_state(2, 16)
  assert plain.with_estimate(state, jnp.float32(0.5), k=3) is state
