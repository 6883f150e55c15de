"""What learning records of each served position, and the loss weights it makes of them."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding.speculative import StepResult
from osd_jax.serving.records import Records, samples

K, V, S, GEN = 3, 8, 16, 8
PROMPT_LEN = 3


def step(start, kept, accepted):
  """One row's step: `kept` tokens appended from sequence position `start`."""
  one = lambda x, dtype=jnp.int32: jnp.asarray([x], dtype)
  return StepResult(
      drafted=jnp.zeros((1, K), jnp.int32), num_proposed=one(K),
      num_accepted=one(accepted), emitted=jnp.zeros((1, K + 1), jnp.int32),
      kept=one(kept), alpha=jnp.zeros((1, K)), is_verified=jnp.ones((1, K), bool),
      active=one(True, bool), start=one(start),
      target_logits=jnp.zeros((1, K + 1, V)), hidden=jnp.zeros((1, K + 1, 0)))


# (kept, accepted, lookup missed): lookup proposes, misses twice, proposes.
STEPS = ((2, 1, False), (3, 2, True), (1, 0, True), (2, 1, False))


def served(keep=True, **record_kw):
  records = Records.empty(1, S, 2, 0).with_prompt(0, None, jax.random.key(0), keep)
  start = PROMPT_LEN
  for kept, accepted, missed in STEPS:
    records = records.record(step(start, kept, accepted),
                             lookup_missed=jnp.asarray([missed]), **record_kw)
    start += kept
  generated = start - PROMPT_LEN
  slots = types.SimpleNamespace(prompt_lens=jnp.asarray([PROMPT_LEN]),
                                num_generated=jnp.asarray([generated]),
                                tokens=jnp.zeros((1, S), jnp.int32))
  return records, slots


@pytest.mark.parametrize("weighting, expected", [
    # Generated tokens g = 0..7: steps of 2, 3, 1, 2 tokens.
    ("lookup_missed", [0, 0, 1, 1, 1, 1, 0, 0]),
    ("corrected", [0, 1, 0, 0, 1, 1, 0, 1]),
    ("all", [1, 1, 1, 1, 1, 1, 1, 1]),
])
def test_loss_weights_by_weighting_on_a_hand_built_request(weighting, expected):
  """lookup_missed weighs exactly the tokens of the steps lookup missed."""
  records, slots = served(corrected_only=weighting == "corrected")
  weight = samples(records, slots, max_len=S, gen_len=GEN, weighting=weighting)[2]
  np.testing.assert_array_equal(weight[0], expected)


def test_weights_stop_at_the_end_of_the_output():
  records, slots = served(corrected_only=False)
  slots.num_generated = jnp.asarray([5])
  weight = samples(records, slots, max_len=S, gen_len=GEN, weighting="lookup_missed")[2]
  np.testing.assert_array_equal(weight[0], [0, 0, 1, 1, 1, 0, 0, 0])


def test_a_new_request_gets_an_id_from_its_key():
  records = Records.empty(2, S, 0, 0)
  a = records.with_prompt(1, None, jax.random.key(3), True)
  b = records.with_prompt(1, None, jax.random.key(4), True)
  assert int(a.uid[0]) == 0 and int(a.uid[1]) != 0 and int(a.uid[1]) != int(b.uid[1])


def test_a_request_that_keeps_no_sample_records_nothing():
  """Where no row keeps its sample, a step writes none of its teacher."""
  kept, _ = served(corrected_only=False)
  skipped, _ = served(keep=False, corrected_only=False)
  assert kept.teacher_probs.any() and kept.lookup_missed.any()
  empty = Records.empty(1, S, 2, 0)
  for field in ("is_corrected", "teacher_ids", "teacher_probs", "lookup_missed"):
    np.testing.assert_array_equal(getattr(skipped, field), getattr(empty, field))
