"""The main job's passes taking turns over the stream's segments."""

from experiments import online as main_job
from osd_jax.serving import driver
from osd_jax.serving.driver import Query


def test_turns_end_where_the_domain_changes_after_a_window():
  domains = ["math"] * 5 + ["sql"] * 2 + ["code"] * 6 + ["math"] * 3
  queries = [Query("q", domain=d) for d in domains]
  assert main_job.turn_ends(queries, min_requests=1) == [5, 7, 13]
  # The 2 SQL requests are too few for a turn of their own: they open the
  # code turn.
  assert main_job.turn_ends(queries, min_requests=4) == [5, 13]
  assert main_job.turn_ends(queries[:5], min_requests=1) == []


def test_short_turns_also_end_every_few_requests():
  domains = ["math"] * 5 + ["sql"] * 2 + ["code"] * 6
  queries = [Query("q", domain=d) for d in domains]
  assert main_job.turn_ends(queries, min_requests=4, every=3) == [3, 6, 9, 12]
  assert main_job.turn_ends(queries, min_requests=1, every=4) == [4, 5, 7, 11]


def _pass(name, pieces, log):
  for piece in range(pieces):
    log.append((name, piece))
    yield piece


def test_interleaved_passes_take_turns_and_each_finishes_once():
  log, done = [], []
  runs = {"target": _pass("target", 3, log), "static": _pass("static", 3, log),
          "online": _pass("online", 3, log)}
  driver.serve_in_turns(runs, interleave=True, on_done=done.append)
  assert log == [(name, piece) for piece in range(3)
                 for name in ("target", "static", "online")]
  assert done == ["target", "static", "online"]


def test_without_interleaving_each_pass_runs_to_its_end_first():
  log, done = [], []
  runs = {"target": _pass("target", 2, log), "online": _pass("online", 2, log)}
  driver.serve_in_turns(runs, interleave=False, on_done=done.append)
  assert log == [("target", 0), ("target", 1), ("online", 0), ("online", 1)]
  assert done == ["target", "online"]
