"""The learning budget: a due update waits while updates have taken their share."""

import dataclasses
import functools
import queue
import time

import jax
import numpy as np
import pytest

from osd_jax.serving import driver, live, online
from osd_jax.serving.learning_budget import LearningBudget
from osd_jax.serving.live_request import Finished, LiveRequest, RequestParams, Tokens
from tests.test_online import (MAIN, MAX_NEW, QUERIES, admit, fresh_state, host, max_abs_diff,
                               placed_target, prompt_ids, serve_stream, tiny_pair)


def test_no_budget_always_allows_and_never_asks_the_other_hosts():
  budget = LearningBudget(0.0)
  budget.record("shape", 100.0, updated=True)
  assert budget.allows(agree=lambda flag: pytest.fail("asked"))


def test_an_update_costs_its_call_less_a_plain_call_of_its_shape():
  budget = LearningBudget(0.1)
  assert budget.record((64, 1), 0.2, updated=False) == 0.0
  assert budget.record((128, 1), 0.4, updated=False) == 0.0
  assert budget.record((64, 1), 1.2, updated=True) == pytest.approx(1.0)
  # A shape never seen without an update is priced against the cheapest.
  assert budget.record((256, 1), 0.7, updated=True) == pytest.approx(0.5)
  assert budget.record((64, 1), 0.1, updated=True) == 0.0  # never negative
  assert budget.update_seconds == pytest.approx(1.5) and budget.updates == 3


def test_updates_wait_until_serving_time_pays_for_them():
  budget = LearningBudget(0.1)
  assert budget.allows()  # nothing spent yet
  budget.record("s", 0.5, updated=False)
  budget.record("s", 1.5, updated=True)  # 1 s of updates: needs 10 s of serving
  assert not budget.allows()
  for _ in range(79):
    budget.record("s", 0.1, updated=False)
  assert budget.serving_seconds == pytest.approx(9.9) and not budget.allows()
  budget.record("s", 0.2, updated=False)  # 10.1 s
  assert budget.allows()
  assert not budget.allows(agree=lambda flag: False)  # another host says no


def test_a_payback_spends_only_what_the_learned_draft_saved():
  budget = LearningBudget(0.0, payback=0.5)
  assert budget.allows()  # the first update is free
  budget.record("s", 1.0, updated=False)
  assert budget.finished(10, 5) == pytest.approx(0.5)  # 5 tokens at 0.1 s a token
  budget.record("s", 3.0, updated=True)  # 2 s of updates: needs 4 s saved
  assert not budget.allows()
  # The price is the serve calls' seconds a token, updates left out: 2 s / 20.
  assert budget.finished(10, 0) == 0.0  # lookup's tokens earn nothing
  assert budget.finished(0, 35) == pytest.approx(3.5)
  assert budget.saved_seconds == pytest.approx(4.0)
  assert budget.allows() and not budget.allows(agree=lambda flag: False)
  both = LearningBudget(0.1, payback=1.0)  # the share holds too
  both.finished(1, 100)
  both.record("s", 1.0, updated=False)
  both.record("s", 2.0, updated=True)
  both.finished(1, 100)
  assert both.saved_seconds > 1.0 and not both.allows()
  split = LearningBudget(0.0, payback=0.5)  # an update spread over calls
  split.record("s", 2.0, updated=True, completed=False)
  assert split.allows() and split.updates == 0  # the free update goes on
  split.record("s", 2.0, updated=True, completed=True)
  assert split.updates == 1 and not split.allows()
  with pytest.raises(ValueError, match="payback"):
    LearningBudget(0.1, payback=1.5)


def test_a_request_keeps_its_sample_if_an_update_could_follow_within_the_horizon():
  budget = LearningBudget(0.0, payback=0.5)
  assert budget.worth_keeping(0)  # for the free update
  budget.record("s", 1.0, updated=False)
  budget.finished(10, 5)  # one request saved 0.5 s
  budget.record("s", 3.0, updated=True)  # 2 s of updates: needs 4 s saved
  assert not budget.allows()
  # At 0.5 s a request, 7 more requests make 4 s; 6 make 3.5 s.
  assert budget.worth_keeping(7) and not budget.worth_keeping(6)
  assert not budget.worth_keeping(7, agree=lambda flag: False)
  share = LearningBudget(0.1)  # 1 s of updates needs 10 s of serving
  share.record("s", 1.0, updated=False)
  share.finished(1, 0)
  share.record("s", 2.0, updated=True)
  assert not share.allows() and share.worth_keeping(3) and not share.worth_keeping(2)
  assert LearningBudget(0.0).worth_keeping(0, agree=lambda flag: pytest.fail("asked"))


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_a_share_outside_0_1_is_refused(share):
  with pytest.raises(ValueError, match="learning budget"):
    LearningBudget(share)


def test_a_due_update_waits_while_it_may_not_run(monkeypatch):
  """may_update=False keeps a due update (and the samples) for a later call;
  the learn program runs only after calls with work for it."""
  cfg = dataclasses.replace(MAIN, update_interval=1, buffer_capacity=4)
  mesh = online.make_mesh(1)
  target, draft = tiny_pair()
  step = online.make_step(mesh, target_config=target.config, drafter=draft.drafter,
                          cfg=cfg)
  learns = []
  monkeypatch.setattr(step, "learn", lambda *args, run=step.learn: (
      learns.append(len(finishing)), run(*args))[1])
  target_params = placed_target(mesh)
  state = fresh_state(cfg, mesh, num_slots=2)
  start = host(state.draft_params)
  state = admit(step, mesh, target_params, state,
                {0: prompt_ids(QUERIES[0]), 1: prompt_ids(QUERIES[1])})
  finishing = []  # per call: the requests that finished in it
  serve = lambda state, **kw: step.serve(target_params, state, steps=cfg.steps_per_call,
                                         window=cfg.window(cfg.cache_size), **kw)
  while not (done := jax.device_get(state.slots.done)).all():
    finishing.append(0)
    state, out = serve(state, may_update=False)
    finishing[-1] = int(jax.device_get(state.slots.done).sum() - done.sum())
    assert not np.asarray(out.did_update).any()
  assert int(state.since_update[0]) == 2 and int(state.num_updates[0]) == 0
  assert int(np.asarray(state.buffer.is_valid).sum()) == 2
  assert max_abs_diff(host(state.draft_params), start) == 0.0
  # Only the calls in which a request finished ran the learn program.
  assert 0 in finishing  # some calls finished none
  assert learns == [i + 1 for i, n in enumerate(finishing) if n], (learns, finishing)
  state, out = serve(state)  # nothing finishes: the due update is the work
  assert np.asarray(out.did_update).all() and int(state.num_updates[0]) == 1
  assert max_abs_diff(host(state.draft_params), start) > 1e-4
  assert len(learns) == len([n for n in finishing if n]) + 1
  state, out = serve(state)  # no work: no learn program
  assert len(learns) == len([n for n in finishing if n]) + 1
  assert not np.asarray(out.did_update).any()


def _fake_clock(monkeypatch, module, name: str, update_s: float = 0.9):
  """Replaces module.name, a host clock, by one that serve calls advance:
  0.1 s, and `update_s` more for a call that updates."""
  clock = [0.0]
  monkeypatch.setattr(module, name, lambda: clock[0])
  serve = online.Step.serve

  def timed_serve(self, *args, **kwargs):
    state, out = serve(self, *args, **kwargs)
    clock[0] += 0.1 + (update_s if np.asarray(out.did_update).any() else 0.0)
    return state, out

  monkeypatch.setattr(online.Step, "serve", timed_serve)


def _stream_with_clock(monkeypatch, budget: float, payback: float = 0.0,
                       update_s: float = 0.9) -> dict:
  _fake_clock(monkeypatch, driver, "_host_seconds", update_s)
  # A ring (no clear): exactly one update per 2 requests, however they finish.
  return serve_stream(QUERIES[:24], dataclasses.replace(MAIN, update_interval=2,
                                                        clear_after_update=False),
                      devices=1, num_slots=2, learning_budget=budget,
                      learning_payback=payback)


def test_the_driver_holds_updates_to_their_share_of_the_clock(monkeypatch):
  free = _stream_with_clock(monkeypatch, 0.0)
  held = _stream_with_clock(monkeypatch, 0.2)
  updates = lambda run: [r for r in run["records"] if r.get("updates")]
  count = lambda run: sum(r["updates"] for r in updates(run))
  assert count(free) == 12 == int(free["state"].num_updates[0])  # one per 2 requests
  assert 1 <= count(held) == int(held["state"].num_updates[0]) < 12
  # Each update is booked at what the clock says it cost.
  assert all(r["update_s"] == pytest.approx(0.9 * r["updates"])
             for r in updates(held)[1:])
  # Every request is served either way; only when the draft learns differs.
  assert sorted(r["request"] for r in held["records"]) == list(range(24))
  serving_s = max(r["finished_s"] for r in held["records"])
  assert sum(r["update_s"] for r in updates(held)) <= 0.2 * serving_s + 0.9


def test_the_driver_learns_within_what_the_learned_draft_saved(monkeypatch):
  """The tiny pair's draft has most of its proposals accepted: cheap updates
  are all paid for, dear ones only the first (free) one."""
  cheap = _stream_with_clock(monkeypatch, 0.0, payback=0.5, update_s=0.01)
  dear = _stream_with_clock(monkeypatch, 0.0, payback=0.5, update_s=100.0)
  count = lambda run: int(run["state"].num_updates[0])
  assert count(cheap) == 12 and count(dear) == 1
  # Once no update can follow, requests keep no sample (the ring holds 24).
  learned = lambda run: [r["learned"] for r in sorted(run["records"],
                                                      key=lambda r: r["served"])]
  assert all(learned(cheap))
  assert 2 <= sum(learned(dear)) < 8 and not any(learned(dear)[8:])
  for run in (cheap, dear):
    assert int(np.asarray(run["state"].buffer.is_valid).sum()) == sum(learned(run))
  for run in (cheap, dear):
    saved = [r["draft_saved_s"] for r in run["records"]]
    accepted = [r["accepted"] for r in run["records"]]
    assert sum(saved) > 0 and all((s > 0) == (a > 0) for s, a in zip(saved, accepted))
  assert sorted(r["request"] for r in dear["records"]) == list(range(24))


def ring_engine(**live_fields) -> live.LiveEngine:
  """A 2-slot live engine over the tiny pair, learning from a ring (no
  clear): exactly one update per 2 finished requests, when allowed."""
  target, draft = tiny_pair()
  cfg = dataclasses.replace(MAIN, sampling=None, update_interval=2,
                            clear_after_update=False)
  return live.LiveEngine(target, draft, cfg, live.LiveConfig(num_slots=2, **live_fields),
                         mesh=online.make_mesh(1))


def serve_all(engine: live.LiveEngine, queries) -> list[list[int]]:
  """Starts the engine, serves every query (greedy, MAX_NEW tokens) to its
  end and stops it; the token ids each got."""
  finished, tokens = queue.Queue(), [[] for _ in queries]

  def on_event(i, event):
    if isinstance(event, Tokens):
      tokens[i].extend(event.ids)
    elif isinstance(event, Finished):
      finished.put(i)

  engine.start(warm_up=False)
  for i, q in enumerate(queries):
    engine.submit(LiveRequest(list(prompt_ids(q)), RequestParams(max_tokens=MAX_NEW),
                              functools.partial(on_event, i)))
  for _ in queries:
    finished.get(timeout=300)
  engine.stop()
  return tokens


def _live_updates(monkeypatch, budget: float, payback: float = 0.0,
                  update_s: float = 0.9) -> tuple[int, live.LiveEngine]:
  """Updates of the live engine over 24 requests, its clock a _fake_clock."""
  _fake_clock(monkeypatch, live, "_busy_clock", update_s)
  engine = ring_engine(learning_budget=budget, learning_payback=payback)
  serve_all(engine, QUERIES[:24])
  monkeypatch.undo()
  return int(np.asarray(engine._state.num_updates).sum()), engine  # pylint: disable=protected-access


def test_the_live_engine_holds_updates_to_their_share_of_its_time(monkeypatch):
  assert _live_updates(monkeypatch, 0.0)[0] == 12
  assert 1 <= _live_updates(monkeypatch, 0.2)[0] < 12


def test_the_live_engine_learns_within_what_the_learned_draft_saved(monkeypatch):
  assert _live_updates(monkeypatch, 0.0, payback=0.5, update_s=0.01)[0] == 12
  updates, engine = _live_updates(monkeypatch, 0.0, payback=0.5, update_s=100.0)
  assert updates == 1  # the free one
  # Then requests keep no sample: the ring (24) holds the few before it.
  assert 2 <= int(np.asarray(engine._state.buffer.is_valid).sum()) < 8  # pylint: disable=protected-access
  saved = engine._learning.saved_seconds  # pylint: disable=protected-access
  assert saved > 0
  assert "osd:draft_saved_seconds " in engine.metrics.render()


def make_inserts_late(monkeypatch, step, clock: list) -> None:
  """Makes `step`'s inserts' results arrive half a second after the call
  returns (dispatch is asynchronous), moving clock[0] on by 100 s as they
  do. The compiled programs are shared: monkeypatch puts them back."""

  def late(x):
    time.sleep(0.5)
    clock[0] += 100.0
    return x

  delayed = jax.jit(lambda x: jax.pure_callback(
      late, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
  insert = step.insert

  def late_insert(*args):
    state = insert(*args)
    return state.replace(slots=state.slots.replace(budget=delayed(state.slots.budget)))

  monkeypatch.setattr(step, "insert", late_insert)


def test_the_driver_does_not_time_an_insert_as_part_of_the_next_call(monkeypatch):
  """An insert still running when the next serve call starts would count in
  that call's seconds (the learning budget's cost of an update) and in its
  own request's decoding time."""
  clock = [0.0]
  monkeypatch.setattr(driver, "_host_seconds", lambda: clock[0])
  target, draft = tiny_pair()
  make_inserts_late(monkeypatch, online.make_step(
      online.make_mesh(1), target_config=target.config, drafter=draft.drafter,
      cfg=MAIN), clock)
  records = serve_stream(QUERIES[:3], MAIN, devices=1, num_slots=2)["records"]
  assert clock[0] >= 300.0  # every insert ran, late
  itl = {r["request"]: r["itl_s"] for r in records}
  # Requests 0 and 2 decode apart from their own prefills. Request 1 was
  # decoding while request 2 was inserted, and waited for it (as an engine's
  # inter-token latency counts another request's prefill).
  assert itl[0] == itl[2] == 0.0 and itl[1] > 0.0
