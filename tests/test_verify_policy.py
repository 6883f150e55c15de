"""Verifying only the drafted positions that pay: the per-row limit, its
exactness (greedy equals target-only, samples follow the target), the
host's measured position costs and their flag."""

import math

from absl import app, flags
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import step_flags
from osd_jax.checkpoints import draft as draft_lib
from osd_jax.decoding import speculative, verify_policy
from osd_jax.decoding.drafts import HybridDraft, ModelDraft, NGramDraft
from osd_jax.serving import online, verify_costs
from tests import test_sampling_exactness as exactness
from tests.test_speculative import drafts, prompts, run, target, target_greedy  # pylint: disable=unused-import

K = 4


def metrics(proposed, accepted, emitted, calls):
  """Metrics of rows whose requests so far proposed / accepted these counts
  at each position, emitted `emitted` tokens in `calls` target calls."""
  m = speculative.Metrics.zeros(len(emitted), K)
  return m.replace(proposed_by_position=jnp.asarray(proposed, jnp.float32),
                   accepted_by_position=jnp.asarray(accepted, jnp.float32),
                   emitted=jnp.asarray(emitted, jnp.float32),
                   target_calls=jnp.asarray(calls, jnp.float32))


def test_a_new_request_and_exploring_steps_verify_everything():
  m = metrics([[0] * K, [9, 9, 9, 9]], [[0] * K, [0, 0, 0, 0]], [0, 24], [0, 24])
  assert verify_policy.limits(m, K, 0.5).tolist() == [K, K]  # step 0, step 24


def test_a_row_verifies_the_leading_positions_that_pay():
  # Position worth (accepted + 1) / (proposed + 1): row 0 0.9 / 0.4 / 0.8 / 0.1,
  # row 1 0.1 first, row 2 all 1. Rates (emitted + 1) / (calls + 1) = 1.
  m = metrics([[9, 9, 9, 9], [9, 9, 9, 9], [0, 0, 0, 0]],
              [[8, 3, 7, 0], [0, 9, 9, 9], [0, 0, 0, 0]], [9, 9, 9], [9, 9, 9])
  assert verify_policy.limits(m, K, 0.45).tolist() == [1, 0, K]
  assert verify_policy.limits(m, K, 0.3).tolist() == [3, 0, K]
  assert verify_policy.limits(m, K, 0.0).tolist() == [K, K, K]
  # A row emitting more a step asks more of a position: rate 2 doubles the bar.
  fast = metrics([[9, 9, 9, 9]], [[8, 3, 7, 0]], [19], [9])
  assert verify_policy.limits(fast, K, 0.3).tolist() == [1]


# Each draft once, each slot count twice: one slot trims to the proposal's
# width, eight pack the rows' proposals.
POLICY_CASES = [(1, "ngram"), (8, "hybrid_short"), (1, "hybrid_gated"),
                (8, "confident")]


@pytest.mark.parametrize("num_slots, draft_name", POLICY_CASES)
def test_greedy_output_equals_target_whatever_the_cost(target, target_greedy,
                                                        prompts, draft_name, num_slots):
  draft = drafts(target)[draft_name]
  free = run(target, draft, prompts, K, trim_verify=True, num_slots=num_slots)
  for cost in (0.3, 50.0):
    results = run_with_cost(target, draft, prompts, cost, num_slots)
    assert [r.token_ids for r in results] == target_greedy
  # At a prohibitive cost rows propose only on their exploring steps.
  for r in results:
    explored = math.ceil(r.metrics["target_calls"] / verify_policy.EXPLORE_EVERY)
    assert r.metrics["proposed"] <= K * explored
  assert (sum(r.metrics["proposed"] for r in results)
          < sum(r.metrics["proposed"] for r in free))


def run_with_cost(target, draft, prompts, cost, num_slots):
  from osd_jax.decoding.engine import Engine  # pylint: disable=import-outside-toplevel
  from tests.test_generation import MAX_NEW  # pylint: disable=import-outside-toplevel
  engine = Engine(target, draft, k=K, max_new_tokens=MAX_NEW, trim_verify=True,
                  num_slots=num_slots, position_cost=cost)
  return engine.generate_ids(prompts)


def test_a_position_cost_needs_trimmed_verification(target):
  state = speculative.empty_state(target.config, NGramDraft(target.config.vocab_size),
                                  batch_size=1, cache_size=16, k=2)
  with pytest.raises(ValueError, match="trim"):
    speculative.speculate_and_verify(
        target.params, (), state, target_config=target.config,
        drafter=NGramDraft(target.config.vocab_size), k=2, sampling=None,
        position_cost=0.2)
  with pytest.raises(ValueError, match="trim"):
    online.OnlineConfig(position_costs=((1, 0.2),), trim_verify=False)


@pytest.mark.parametrize("make", ["model", "hybrid"])
def test_samples_follow_the_target_when_the_limit_reads_past_draws(make):
  """Two tokens a run: a first proposal fully rejected (1 token kept) makes
  the second step's first position worth 0.5 a token at a rate of 1, under
  the cost of 0.6: that step is a plain one. What was drawn before decides
  the length of the next proposal, never its own draws: p holds."""
  tgt = exactness.model(seed=11, num_layers=2, logit_scale=2.0)  # its fixtures'
  tiny_draft = draft_lib.derive(tgt, [1])
  sampling, k = exactness.SETTINGS[2]
  drafter = (ModelDraft(tiny_draft.config) if make == "model" else
             HybridDraft(ModelDraft(tiny_draft.config), NGramDraft(exactness.V)))
  p = exactness.exact_distribution(tgt, sampling)
  samples, m = sample(tgt, drafter, tiny_draft.params, k, sampling, 0.6)
  free, m_free = sample(tgt, drafter, tiny_draft.params, k, sampling, 0.0)
  assert 0 < m.accepted < m.proposed < m_free.proposed  # some steps were cut
  assert not np.array_equal(samples, free)
  assert exactness.empirical_tv(samples, p) < exactness.tv_bound(p)


def sample(target, drafter, draft_params, k, sampling, cost):
  import jax  # pylint: disable=import-outside-toplevel
  p = exactness.PROMPT

  def go(target_params, draft_params, prompts, lens, rng):
    return speculative.generate.__wrapped__(
        target_params, draft_params, prompts, lens, rng,
        target_config=target.config, drafter=drafter, k=k, sampling=sampling,
        max_new_tokens=2, cache_size=len(p) + 2 + k + 1, trim_verify=True,
        position_cost=cost)

  n = exactness.N
  prompts = jnp.tile(jnp.asarray([p], jnp.int32), (n, 1))
  state = jax.jit(go)(target.params, draft_params, prompts,
                      jnp.full((n,), len(p), jnp.int32), jax.random.key(0))
  samples = exactness.cells(np.asarray(state.tokens[:, len(p):len(p) + 2]),
                            np.asarray(state.num_generated))
  return samples, jax.tree.map(lambda x: float(np.sum(x)), state.metrics)


def test_a_position_costs_what_it_adds_to_a_plain_pass(monkeypatch):
  seconds = lambda params, config, batch, width, window, clock: 1.0 + 0.1 * batch * (width - 1)
  monkeypatch.setattr(verify_costs, "_pass_seconds", seconds)
  costs = verify_costs.measure(None, None, k=4, batches=[8, 1, 2, 2], window=64)
  assert costs == ((1, 0.1), (2, 0.2), (8, 0.8))
  assert verify_costs.measure(None, None, k=0, batches=[1], window=64) == ()


def test_a_real_pass_is_timed(target):
  from osd_jax.models import llama  # pylint: disable=import-outside-toplevel
  params = llama.for_decoding(target.params, target.config)
  [(batch, cost)] = verify_costs.measure(params, target.config, k=2, batches=[2],
                                         window=32)
  assert batch == 2 and cost >= 0.0 and math.isfinite(cost)


def test_costs_are_cached_under_their_key(tmp_path):
  calls = []
  compute = lambda: calls.append(1) or ((1, 0.25),)
  assert verify_costs.cached(str(tmp_path), "abc", compute) == (((1, 0.25),), True)
  assert verify_costs.cached(str(tmp_path), "abc", compute) == (((1, 0.25),), False)
  assert len(calls) == 1
  (tmp_path / "abc.json").write_text("{torn")
  assert verify_costs.cached(str(tmp_path), "abc", compute)[1]  # timed again
  assert verify_costs.cached(None, "abc", compute)[1]  # nowhere to keep it
  blocked = tmp_path / "a_file"
  blocked.write_text("")  # a folder that cannot be made: timed, not kept
  assert verify_costs.cached(str(blocked / "sub"), "abc", compute) == (((1, 0.25),), True)


def test_the_key_changes_with_what_the_timing_depends_on(target):
  key = lambda **kw: verify_costs.cache_key(
      target.config, target.params, **{"k": 4, "batches": [1, 2], "window": 64,
                                        "host": "h", **kw})
  assert key() == key(batches=[2, 1, 1])
  assert len({key(), key(k=3), key(batches=[1]), key(window=128), key(host="g")}) == 5


@pytest.fixture
def flag_values():
  saved = {name: flags.FLAGS[name].value
           for name in ("position_costs", "batch_k", "compilation_cache")}
  yield flags.FLAGS
  for name, value in saved.items():
    flags.FLAGS[name].value = value


def test_the_flag_takes_auto_off_or_pairs(flag_values):
  flags.FLAGS(["prog"], known_only=True)
  flag_values.position_costs = "off"
  assert step_flags.given_position_costs() == ()
  flag_values.position_costs = "1:0.05,8:0.3"
  assert step_flags.given_position_costs() == ((1, 0.05), (8, 0.3))
  flag_values.position_costs = "auto"
  assert step_flags.given_position_costs() is None
  for bad in ("1", "0:0.1", "2:-1", "x:y", "1:inf"):
    flag_values.position_costs = bad
    with pytest.raises(app.UsageError, match="position_costs"):
      step_flags.given_position_costs()
  flag_values.position_costs = "1:0.1"
  with pytest.raises(app.UsageError, match="trim"):
    step_flags.position_costs(None, None, k=4, batches=[1], window=64,
                              trim_verify=False)
  # Auto is off where --batch_k overrides it, or verification is not trimmed.
  flag_values.position_costs = "auto"
  assert step_flags.position_costs(None, None, k=4, batches=[1], window=64,
                                   trim_verify=False) == ()
  flag_values.batch_k = ["4:2"]
  assert step_flags.position_costs(None, None, k=4, batches=[1], window=64,
                                   trim_verify=True) == ()


def test_auto_times_once_and_keeps_the_table_beside_the_programs(
    flag_values, target, tmp_path, monkeypatch):
  flags.FLAGS(["prog"], known_only=True)
  timed = []
  monkeypatch.setattr(verify_costs, "measure",
                      lambda *a, **kw: timed.append(kw) or ((1, 0.2), (2, 0.3)))
  flag_values.position_costs, flag_values.batch_k = "auto", []
  flag_values["compilation_cache"].parse(str(tmp_path))  # given, as on a command line
  costs = lambda: step_flags.position_costs(target.params, target.config, k=4,
                                            batches=[1, 2], window=64, trim_verify=True)
  try:
    assert costs() == costs() == ((1, 0.2), (2, 0.3))
    assert len(timed) == 1  # the second start read the table
    [folder] = [p for p in tmp_path.iterdir() if p.name.endswith("-verify_costs")]
    assert len(list(folder.glob("*.json"))) == 1
  finally:
    flag_values["compilation_cache"].unparse()


def test_a_call_takes_the_cost_of_its_batch():
  cfg = online.OnlineConfig(position_costs=((1, 0.05), (4, 0.3)), trim_verify=True)
  assert [cfg.position_cost_at(b) for b in (1, 2, 4, 8)] == [0.05, 0.05, 0.3, 0.3]
  assert online.OnlineConfig().position_cost_at(8) == 0.0
