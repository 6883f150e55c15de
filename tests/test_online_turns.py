"""The main job's passes taking turns over the stream's segments."""

import numpy as np

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


def test_interleaved_passes_take_turns_and_each_finishes_once(monkeypatch):
  monkeypatch.setattr(driver, "memory_maps", lambda: (1000, 65530))
  log, done = [], []
  runs = {"target": _pass("target", 3, log), "static": _pass("static", 3, log),
          "online": _pass("online", 3, log)}
  driver.serve_in_turns(runs, interleave=True, on_done=done.append)
  assert log == [(name, piece) for piece in range(3)
                 for name in ("target", "static", "online")]
  assert done == ["target", "static", "online"]


def test_without_interleaving_each_pass_runs_to_its_end_first(monkeypatch):
  log, done, dropped = [], [], []
  # The programs of a pass that ended are dropped before the next compiles.
  monkeypatch.setattr(driver.jax, "clear_caches", lambda: dropped.append(len(log)))
  runs = {"target": _pass("target", 2, log), "online": _pass("online", 2, log)}
  driver.serve_in_turns(runs, interleave=False, on_done=done.append)
  assert log == [("target", 0), ("target", 1), ("online", 0), ("online", 1)]
  assert done == ["target", "online"]
  assert dropped == [2]


def _growing_pass(name, pieces, log, maps, grows_by):
  """A pass whose first turn maps `grows_by` more regions (its programs)."""
  for piece in range(pieces):
    if piece == 0:
      maps[0] += grows_by
    log.append((name, piece))
    yield piece


def test_a_pass_joins_the_turns_only_while_its_programs_fit(monkeypatch):
  # Limit 150, 90 % usable, and a pass is assumed to map up to twice the
  # largest so far: two passes of 30 fit beside a base of 20, a third waits for
  # them to end, and their programs are dropped before it starts.
  maps, log, dropped = [20], [], []
  monkeypatch.setattr(driver, "memory_maps", lambda: (maps[0], 150))
  def drop():
    dropped.append([name for name, _ in log])
    maps[0] = 20
  monkeypatch.setattr(driver.jax, "clear_caches", drop)
  runs = {name: _growing_pass(name, 2, log, maps, 30)
          for name in ("target", "static", "online")}
  driver.serve_in_turns(runs, interleave=True)
  assert log == [("target", 0), ("static", 0), ("target", 1), ("static", 1),
                 ("online", 0), ("online", 1)]
  assert dropped == [["target", "static", "target", "static"]]


def test_without_a_known_limit_every_pass_joins(monkeypatch):
  log = []
  monkeypatch.setattr(driver, "memory_maps", lambda: None)
  runs = {name: _pass(name, 2, log) for name in ("target", "static", "online")}
  driver.serve_in_turns(runs, interleave=True)
  assert log == [(name, piece) for piece in range(2)
                 for name in ("target", "static", "online")]


def test_every_host_takes_the_same_turns(monkeypatch):
  """With several processes a pass joins only if it fits on every host: here
  this host has room and another has not."""
  log = []
  monkeypatch.setattr(driver, "memory_maps", lambda: (1000, 65530))
  monkeypatch.setattr(driver.jax, "clear_caches", lambda: None)
  monkeypatch.setattr(driver.distributed.jax, "process_count", lambda: 2)
  monkeypatch.setattr(driver.distributed.multihost_utils, "process_allgather",
                      lambda flag: np.asarray([flag, False]))
  runs = {name: _pass(name, 2, log) for name in ("target", "static")}
  driver.serve_in_turns(runs, interleave=True)
  assert log == [("target", 0), ("target", 1), ("static", 0), ("static", 1)]
