"""bench_serve's turns: every server serves the same questions in the same
order, each one goes first equally often, and a level's figures add its turns."""

import math

import pytest

from experiments import bench_serve_turns


def test_slices_keep_every_question_in_order():
  questions = list(range(10))
  parts = bench_serve_turns.slices(questions, 4)
  assert [len(p) for p in parts] == [2, 3, 2, 3]
  assert sum(parts, []) == questions
  # More turns than questions: one question a turn, none empty.
  assert bench_serve_turns.slices(questions[:3], 5) == [[0], [1], [2]]
  with pytest.raises(ValueError, match="at least 1"):
    bench_serve_turns.slices(questions, 0)


def test_each_server_takes_each_place_once_in_as_many_turns():
  names = ["target", "static", "online"]
  orders = [bench_serve_turns.order(names, t) for t in range(len(names))]
  for place in range(len(names)):
    assert sorted(o[place] for o in orders) == sorted(names)
  assert all(sorted(o) == sorted(names) for o in orders)
  assert bench_serve_turns.order(names, 3) == names


def test_figures_add_the_turns():
  records = [{"ttft_s": 0.1, "itl_s": 0.02, "tokens": 30, "alpha": 0.5},
             {"refused": True},
             {"ttft_s": 0.3, "itl_s": 0.04, "tokens": 10, "alpha": 0.3}]
  turn = {"updates": 1.0, "update_s": 0.5, "saved_s": 1.0, "plain_calls": 3.0,
          "serve_calls": 4.0, "serve_s": 5.0}
  summed = {key: 2 * value for key, value in turn.items()}  # two like turns
  got = bench_serve_turns.figures(records, 8.0, summed)
  assert got["requests"] == 2 and got["refused"] == 1
  assert got["tokens_per_s"] == pytest.approx(40 / 8.0)
  assert got["alpha"] == pytest.approx(0.4)
  assert got["ttft_p50_ms"] == pytest.approx(200.0)
  assert got["plain_share"] == pytest.approx(0.75)
  assert got["learning_share"] == pytest.approx(0.1)
  assert got["updates"] == 2.0 and got["saved_s"] == 2.0


def test_no_calls_no_share():
  none = dict.fromkeys(bench_serve_turns.COUNTERS, 0.0)
  got = bench_serve_turns.figures([{"refused": True}], 1.0, none)
  assert got["requests"] == 0 and got["tokens_per_s"] == 0.0
  assert math.isnan(got["plain_share"]) and math.isnan(got["itl_p99_ms"])


def test_counter_deltas_name_the_servers_metrics():
  before = {name: 1.0 for name in bench_serve_turns.COUNTERS.values()}
  after = {name: 4.0 for name in bench_serve_turns.COUNTERS.values()}
  assert bench_serve_turns.counter_deltas(before, after) == dict.fromkeys(
      bench_serve_turns.COUNTERS, 3.0)
