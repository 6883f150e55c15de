"""Choosing per call between speculating and the target alone, by the clock:
the choice, its exploration, and the live engine serving plain calls."""

import numpy as np
import pytest

from osd_jax.serving import live, online
from osd_jax.serving.call_choice import CallChoice
from tests.test_learning_budget import make_inserts_late, ring_engine, serve_all
from tests.test_logprobs import serve_flags_printing
from tests.test_online import QUERIES


def run_calls(choice, batch, seconds, calls):
  """`calls` calls at `batch`; a speculative call takes seconds[False] for 10
  tokens, a plain one seconds[True]. Returns the kinds chosen."""
  kinds = []
  for _ in range(calls):
    plain = choice.plain(batch)
    choice.record(batch, plain, seconds[plain], 10)
    kinds.append(plain)
  return kinds


def test_each_kind_is_measured_then_the_faster_runs_and_the_other_is_explored():
  choice = CallChoice(explore_every=4)
  kinds = run_calls(choice, 8, {False: 2.0, True: 1.0}, 14)
  # Speculation first, then the target alone, in turns until each is timed
  # twice; then plain, but every 4th call at this batch speculates.
  assert kinds[:4] == [False, True, False, True]
  assert [i + 1 for i, k in enumerate(kinds) if not k] == [1, 3, 8, 12]
  assert choice.plain_share == pytest.approx(10 / 14)


def test_batch_sizes_are_measured_apart():
  choice = CallChoice(explore_every=4)
  run_calls(choice, 8, {False: 2.0, True: 1.0}, 6)
  kinds = run_calls(choice, 1, {False: 1.0, True: 2.0}, 9)
  assert kinds == [False, True, False, True, False, False, False, True, False]


def test_a_kind_that_gets_faster_wins_back_the_calls():
  choice = CallChoice(explore_every=4)
  run_calls(choice, 8, {False: 2.0, True: 1.0}, 8)
  # The draft learns: speculation now takes a quarter of the time. Its
  # explored calls raise its running mean until it wins.
  kinds = run_calls(choice, 8, {False: 0.25, True: 1.0}, 24)
  assert sum(kinds[-8:]) == 2  # only the explored calls are plain now


def test_calls_that_emitted_nothing_are_not_timed():
  choice = CallChoice()
  choice.record(8, False, 1.0, 10)
  choice.record(8, False, 1.0, 0)
  choice.record(8, False, 0.0, 10)
  assert choice.rate(8, False) == pytest.approx(10.0)
  assert choice.calls[False] == 3
  assert choice.rate(8, True) is None


def test_off_always_speculates_and_every_host_must_agree_on_plain():
  off = CallChoice(enabled=False)
  assert not any(run_calls(off, 8, {False: 9.0, True: 1.0}, 5))
  choice = CallChoice()
  run_calls(choice, 8, {False: 9.0, True: 1.0}, 4)
  assert choice.plain(8) and not choice.plain(8, agree=lambda flag: False)
  with pytest.raises(ValueError, match="explore_every"):
    CallChoice(explore_every=1)


def _serve(monkeypatch, choose: bool, plain_s: float = 0.1, **live_fields):
  """12 greedy requests through a 2-slot live engine whose clock makes a
  plain call take `plain_s` and a speculative one 1 s (10x slower, by
  default): (token ids by request, the engine)."""
  clock = [0.0]
  monkeypatch.setattr(live, "_busy_clock", lambda: clock[0])
  serve = online.Step.serve

  def timed_serve(self, *args, plain=False, **kwargs):
    state, out = serve(self, *args, plain=plain, **kwargs)
    clock[0] += plain_s if plain else 1.0
    return state, out

  monkeypatch.setattr(online.Step, "serve", timed_serve)
  engine = ring_engine(choose_calls=choose, **live_fields)
  tokens = serve_all(engine, QUERIES[:12])
  monkeypatch.undo()
  return tokens, engine


def test_the_live_engine_runs_plain_calls_where_they_are_faster(monkeypatch):
  always, spec = _serve(monkeypatch, choose=False)
  chosen, engine = _serve(monkeypatch, choose=True)
  assert chosen == always  # greedy: the target's tokens either way
  assert spec.calls.calls[True] == 0
  assert engine.calls.plain_share > 0.5 and engine.calls.calls[False] >= 2
  # Plain calls learn as speculative ones do: the same updates, one per 2
  # finished requests.
  updates = lambda e: int(np.asarray(e._state.num_updates).sum())  # pylint: disable=protected-access
  assert updates(engine) == updates(spec) == 6


def test_the_server_banks_what_speculative_calls_saved(monkeypatch):
  """osd:speculation_saved_seconds: negative where speculation is 10x
  slower; positive where a speculative call (more tokens) takes what a
  plain one does."""
  _, losing = _serve(monkeypatch, choose=True)
  assert losing._speculation_saved < 0  # pylint: disable=protected-access
  _, saving = _serve(monkeypatch, choose=True, plain_s=1.0)
  assert saving._speculation_saved > 0  # pylint: disable=protected-access


def test_a_call_saves_its_tokens_at_the_plain_rate_less_its_time():
  choice = CallChoice()
  assert choice.seconds_saved(1, False, 1.0, 10) == 0.0  # no plain call timed yet
  choice.record(1, True, 1.0, 4)  # plain: 4 tokens/s
  assert choice.seconds_saved(1, True, 1.0, 4) == 0.0  # a plain call saves nothing
  assert choice.seconds_saved(1, False, 1.0, 8) == pytest.approx(1.0)
  assert choice.seconds_saved(1, False, 1.0, 2) == pytest.approx(-0.5)
  assert choice.seconds_saved(2, False, 1.0, 8) == 0.0  # another batch size


def test_the_server_flag_turns_the_choice_on_and_off():
  run = serve_flags_printing("serve_flags.live_config().choose_calls")
  assert run().stdout.split() == ["True"]  # auto
  assert run("--speculate=always").stdout.split() == ["False"]
  refused = run("--speculate=never")
  assert refused.returncode != 0 and "speculate" in refused.stderr


def test_an_insert_is_not_timed_as_part_of_the_next_call(monkeypatch):
  """Dispatch is asynchronous: an insert still running when a serve call
  starts would be timed as that call's, and the choice and the learning
  budget would book its prefill to whichever kind of call came next. Here
  each insert's result arrives late and moves the engine's clock on by
  100 s as it does: none of that reaches a serve call."""
  clock = [0.0]
  monkeypatch.setattr(live, "_busy_clock", lambda: clock[0])
  engine = ring_engine()
  make_inserts_late(monkeypatch, engine._step, clock)  # pylint: disable=protected-access
  serve_all(engine, QUERIES[:3])
  assert clock[0] >= 300.0  # every insert ran, late
  assert engine._learning.serving_seconds == 0.0  # pylint: disable=protected-access
