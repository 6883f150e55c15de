"""Drafts per category sharing slots and calls, and a draft that never updates."""

import dataclasses

import jax
import numpy as np
import pytest

from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import online
from tests.test_online import (K, MAX_NEW, fresh_state, greedy, host, prompt_ids,
                               query, random_prompts, serve_stream, tree_equal)

DEVICES = 2
SLOTS = 4  # two per device
CATEGORIES = ("a", "b")
# Shared with test_online_checkpoint (the same compiled step through the driver).
DRAFTS = online.OnlineConfig(
    k=K, max_new_tokens=MAX_NEW, cache_size=32, steps_per_call=2,
    update_interval=4, buffer_capacity=8, teacher_k=8, num_drafts=2,
    distill=DistillConfig(learning_rate=1e-2))

_ORDER = "aaaaabbbabababbbaabbabaa"  # slots of both categories share calls
QUERIES = [query(p, category=c) for p, c in
           zip(random_prompts([2 + i % 11 for i in range(len(_ORDER))], seed=5),
               _ORDER)]


@pytest.fixture(scope="module")
def routed():
  run = serve_stream(QUERIES, DRAFTS, devices=DEVICES, num_slots=SLOTS,
                     categories=CATEGORIES, every_call=True)
  initial = fresh_state(DRAFTS, run["mesh"], SLOTS)
  return dict(run, initial=host({name: getattr(initial, name) for name in
                                 ("draft_params", "opt_state", "buffer")}))


def of_draft(tree, d, axis=0):
  return jax.tree.map(lambda x: np.take(x, d, axis=axis), tree)


def draft_of(request: int) -> int:
  return CATEGORIES.index(QUERIES[request].category)


def test_a_request_only_trains_its_own_draft(routed):
  """Per call and draft: its params and optimizer state move iff it updated,
  its buffer changes iff one of its requests finished, and it updates every
  `update_interval` of its own finished requests."""
  tap = routed["tap"]
  before, since = routed["initial"], [0, 0]
  for finished, now in zip(tap.finished, tap.snapshots, strict=True):
    for d in range(2):
      new = sum(draft_of(i) == d for i in finished)
      since[d] += new
      updates = since[d] >= DRAFTS.update_interval
      # The surplus carries over: one update per interval in the long run.
      since[d] -= DRAFTS.update_interval if updates else 0
      assert bool(now["out"].did_update[d]) == updates, (now["call"], d)
      for name in ("draft_params", "opt_state"):
        moved = not tree_equal(of_draft(now[name], d), of_draft(before[name], d))
        assert moved == updates, (now["call"], d, name)
      moved = not tree_equal(of_draft(now["buffer"], d, axis=1),
                             of_draft(before["buffer"], d, axis=1))
      assert moved == (new > 0), (now["call"], d)
    np.testing.assert_array_equal(now["since_update"], since)
    before = now
  final = tap.snapshots[-1]
  assert (final["num_updates"] >= 1).all() and not final["num_skipped"].any()
  assert any(len({draft_of(i) for i in f}) == 2 for f in tap.finished)  # shared calls
  # Two drafts trained on different traffic are different drafts.
  params = final["draft_params"]
  assert not tree_equal(of_draft(params, 0), of_draft(params, 1))


def test_buffers_hold_only_their_category(routed):
  prompts = [{prompt_ids(q) for q in QUERIES if q.category == c} for c in CATEGORIES]
  for snapshot in routed["tap"].snapshots:
    buffer = snapshot["buffer"]  # [device, draft, sample]
    for d in range(2):
      valid = buffer.is_valid[:, d]
      assert np.all(buffer.category[:, d][valid] == d)
      starts = buffer.gen_start[:, d][valid]
      for tokens, start in zip(buffer.tokens[:, d][valid], starts):
        assert tuple(int(t) for t in tokens[:start + 1]) in prompts[d]


def test_every_draft_serves_losslessly(routed):
  """Whichever draft serves a request, its greedy output is the target's."""
  outputs = routed["tap"].outputs
  assert sorted(outputs) == list(range(len(QUERIES)))
  for i, q in enumerate(QUERIES):
    assert outputs[i] == greedy(prompt_ids(q)), i
  for r in routed["records"]:
    assert r["draft"] == draft_of(r["request"])
    assert r["category"] == QUERIES[r["request"]].category


# Update interval beyond the stream: the static draft ------------------------

STATIC = dataclasses.replace(DRAFTS, num_drafts=1, update_interval=10_000,
                             teacher_k=0)


def test_update_interval_beyond_the_stream_never_changes_the_draft():
  repeats = 20
  queries = [query(random_prompts([7], seed=6)[0])] * repeats
  run = serve_stream(queries, STATIC, devices=DEVICES, num_slots=SLOTS,
                     every_call=True)
  initial = fresh_state(STATIC, run["mesh"], SLOTS)
  start = host((initial.draft_params, initial.opt_state))
  for snapshot in run["tap"].snapshots:
    assert not snapshot["out"].did_update.any()
    assert tree_equal(start, (snapshot["draft_params"], snapshot["opt_state"]))
  last = run["tap"].snapshots[-1]
  np.testing.assert_array_equal(last["num_updates"], [0])
  np.testing.assert_array_equal(last["since_update"], [repeats])
  # Same draft, same prompt: the same alpha every time (nothing was learnt).
  alphas = {r["alpha"] for r in run["records"]}
  assert len(alphas) == 1, alphas
  # The rings kept the newest samples: capacity per device, all valid.
  buffer = last["buffer"]
  assert buffer.num_added.sum() == repeats
  np.testing.assert_array_equal(buffer.is_valid.sum(-1)[:, 0],
                                np.minimum(buffer.num_added[:, 0],
                                           STATIC.buffer_capacity))
  assert buffer.is_valid.all()
