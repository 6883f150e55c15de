"""Plain target steps (k = 0) between speculative ones, whatever the drafter:
the output stays the target's, and each draft stays in step to propose again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import Draft, NoDraft
from osd_jax.decoding.engine import as_draft
from osd_jax.decoding.sampling import GREEDY
from osd_jax.models import llama
from tests.test_generation import MAX_NEW
from tests.test_speculative import (drafts, pad, prompts, start, step,  # pylint: disable=unused-import
                                    target)

K = 4
CACHE = 64
# Which steps speculate (True) and which are plain, in turn: runs of both.
PATTERN = (True, False, False, True, True, False, True, False, False, False, True)


def decode(target, draft, prompts_, pattern):
  """Every row to its budget (or EOS), step i speculating when pattern[i %
  len]; (tokens per row, accepted drafts, plain steps taken)."""
  tparams = llama.for_decoding(target.params, target.config)
  dparams = draft.drafter.prepare(draft.params, tparams)
  lens = jnp.asarray([len(p) for p in prompts_], jnp.int32)
  b = len(prompts_)
  state, _ = start(tparams, dparams, pad(prompts_, max(map(len, prompts_))), lens,
                   jnp.full((b,), MAX_NEW), speculative.row_keys(jax.random.key(0), b),
                   target_config=target.config, drafter=draft.drafter, k=K,
                   cache_size=CACHE)
  i, plain = 0, 0
  while not bool(jnp.all(state.done)):
    k = K if pattern[i % len(pattern)] else 0
    plain += k == 0
    state, _ = step(tparams, dparams, state, target_config=target.config,
                    drafter=draft.drafter, k=k, sampling=GREEDY)
    i += 1
  rows = [speculative.output_of(state, r) for r in range(b)]
  return rows, int(np.asarray(state.metrics.accepted).sum()), plain


# The model draft, lookup, and their gated hybrid (the serving default); the
# ungated hybrid catches up as the gated one does.
@pytest.mark.parametrize("draft_name", ["derived", "hybrid_gated", "ngram"])
def test_plain_steps_between_speculative_ones_keep_the_target_output(
    target, prompts, draft_name):
  """(The feature draft: tests/test_feature_draft.py, its state after plain
  steps equals a fresh prefill.)"""
  draft = as_draft(target, drafts(target)[draft_name])
  none = Draft(NoDraft(target.config.vocab_size), (), "none")
  expected, _, _ = decode(target, none, prompts, (False,))
  rows, accepted, plain = decode(target, draft, prompts, PATTERN)
  assert rows == expected
  assert plain > 0
  if draft_name == "derived":  # a draft close to the target
    # After plain steps it still proposes what the target accepts, about
    # as much a speculative step as without them.
    _, speculative_only, _ = decode(target, draft, prompts, (True,))
    assert accepted >= 0.5 * speculative_only * sum(PATTERN) / len(PATTERN) > 0


def test_a_plain_step_leaves_a_model_draft_cache_where_it_was(target, prompts):
  """It catches up at its next proposal: the plain step writes no entries."""
  draft = as_draft(target, drafts(target)["derived"])
  tparams = llama.for_decoding(target.params, target.config)
  dparams = draft.drafter.prepare(draft.params, tparams)
  b = len(prompts)
  state, _ = start(tparams, dparams, pad(prompts, max(map(len, prompts))),
                   jnp.asarray([len(p) for p in prompts], jnp.int32),
                   jnp.full((b,), MAX_NEW), speculative.row_keys(jax.random.key(0), b),
                   target_config=target.config, drafter=draft.drafter, k=K,
                   cache_size=CACHE)
  after, result = step(tparams, dparams, state, target_config=target.config,
                       drafter=draft.drafter, k=0, sampling=GREEDY)
  assert np.array_equal(after.draft.lengths, state.draft.lengths)
  assert result.drafted.shape == (b, 0) and not np.asarray(result.num_proposed).any()
  assert np.array_equal(after.lengths, state.lengths + 1)
