"""Multiple drafts routed by category, pad rows, and a draft that never updates."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding import generate as generate_lib
from osd_jax.decoding.sampling import GREEDY
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import online
from tests.test_online import (K, MAX_NEW, PROMPT_LEN, cached_make_step, host,
                               max_abs_diff, prompts, row_alpha, run_steps,
                               tiny_pair, tree_equal)

DEVICES = 2
BATCH = 4
# Shared with test_online_checkpoint (same compiled step through the driver).
DRAFTS = online.OnlineConfig(
    k=K, max_new_tokens=MAX_NEW, prompt_len=PROMPT_LEN, update_interval=BATCH,
    buffer_capacity=BATCH, teacher_k=8, num_drafts=2,
    distill=DistillConfig(learning_rate=1e-2))


def real(n):
  return np.arange(BATCH) < n


# (draft, real rows) per step; the interval is 4 real requests per draft.
ROUTE = [(0, 1), (1, 4), (0, 4), (1, 2), (1, 3)]
UPDATES = [False, True, True, False, True]


@pytest.fixture(scope="module")
def routed():
  target, draft = tiny_pair()
  mesh = online.make_mesh(DEVICES)
  step = cached_make_step(mesh, target_config=target.config,
                          draft_config=draft.config, cfg=DRAFTS)
  state = online.place_state(
      online.init_state(draft.params, DRAFTS, DEVICES, seed=0), mesh)
  initial = dict(draft_params=host(state.draft_params),
                 opt_state=host(state.opt_state), buffer=host(state.buffer))
  batches = []
  for i, (d, n) in enumerate(ROUTE):
    ids, lens = prompts(BATCH, seed=10 + i)
    batches.append((ids, lens, real(n), d))
  _, records = run_steps(step, mesh, target.params, state, batches)
  return dict(initial=initial, records=records, batches=batches)


def of_draft(tree, d, axis=0):
  return jax.tree.map(lambda x: np.take(x, d, axis=axis), tree)


def test_a_request_only_trains_its_own_draft(routed):
  before = routed["initial"]
  for (d, _), did_update, rec in zip(ROUTE, UPDATES, routed["records"]):
    other = 1 - d
    assert bool(rec["out"].did_update) == did_update
    assert tree_equal(of_draft(rec["draft_params"], other),
                      of_draft(before["draft_params"], other))
    assert tree_equal(of_draft(rec["opt_state"], other),
                      of_draft(before["opt_state"], other))
    assert tree_equal(of_draft(rec["buffer"], other, axis=1),
                      of_draft(before["buffer"], other, axis=1))
    moved = max_abs_diff(of_draft(rec["draft_params"], d),
                         of_draft(before["draft_params"], d))
    assert (moved > 0) == did_update
    before = rec
  np.testing.assert_array_equal(routed["records"][-1]["num_updates"], [1, 2])
  np.testing.assert_array_equal(routed["records"][-1]["num_skipped"], [0, 0])
  # Two drafts trained on different traffic are different drafts.
  final = routed["records"][-1]["draft_params"]
  assert max_abs_diff(of_draft(final, 0), of_draft(final, 1)) > 1e-3


def test_buffers_hold_only_their_category(routed):
  for rec in routed["records"]:
    buffer = rec["buffer"]  # [device, draft, slot]
    for d in range(2):
      valid = buffer.is_valid[:, d]
      assert np.all(buffer.category[:, d][valid] == d)


def test_pad_rows_are_neither_buffered_nor_counted(routed):
  first = routed["records"][0]  # draft 0: one real row of four
  np.testing.assert_array_equal(first["since_update"], [1, 0])
  # Rows 0-1 live on device 0, rows 2-3 on device 1.
  np.testing.assert_array_equal(first["buffer"].is_valid[:, 0].sum(-1), [1, 0])
  assert not first["buffer"].is_valid[:, 1].any()
  fourth = routed["records"][3]  # draft 1: two real rows, after its update
  np.testing.assert_array_equal(fourth["since_update"], [0, 2])
  np.testing.assert_array_equal(fourth["buffer"].is_valid[:, 1].sum(-1), [2, 0])


def test_every_draft_serves_losslessly(routed):
  """Whichever draft serves, greedy output is the target's greedy output."""
  target, _ = tiny_pair()
  for (ids, lens, _, _), rec in zip(routed["batches"], routed["records"]):
    out, _ = generate_lib.generate(
        target.params, jnp.asarray(ids), jnp.asarray(lens),
        target.config.init_cache(BATCH, PROMPT_LEN + MAX_NEW), jax.random.key(0),
        config=target.config, sampling=GREEDY, max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(rec["out"].lengths, out.lengths)
    for row, n in enumerate(np.asarray(out.lengths)):
      np.testing.assert_array_equal(rec["out"].tokens[row, :n], out.tokens[row, :n])


# Update interval beyond the stream: the static draft ------------------------

STATIC = dataclasses.replace(DRAFTS, num_drafts=1, update_interval=10_000,
                             teacher_k=0)


def test_update_interval_beyond_the_stream_never_changes_the_draft():
  target, draft = tiny_pair()
  mesh = online.make_mesh(DEVICES)
  step = cached_make_step(mesh, target_config=target.config,
                          draft_config=draft.config, cfg=STATIC)
  state = online.place_state(
      online.init_state(draft.params, STATIC, DEVICES, seed=0), mesh)
  initial = host((state.draft_params, state.opt_state))
  ids, lens = prompts(BATCH, seed=3)
  steps = 4
  _, records = run_steps(step, mesh, target.params, state,
                         [(ids, lens, real(BATCH), 0)] * steps)
  for rec in records:
    assert not rec["out"].did_update
    assert tree_equal(initial, (rec["draft_params"], rec["opt_state"]))
  last = records[-1]
  assert int(last["num_updates"][0]) == 0
  assert int(last["since_update"][0]) == steps * BATCH
  # Same draft, same prompts: the same alpha every time (no learning happened).
  alphas = [row_alpha(r["out"].metrics) for r in records]
  for alpha in alphas[1:]:
    np.testing.assert_array_equal(alpha, alphas[0])
  # The ring kept the newest samples: capacity per device, all valid.
  assert last["buffer"].is_valid.all()
