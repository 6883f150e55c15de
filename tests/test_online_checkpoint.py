"""Orbax checkpoints through the driver: resume mid-stream, requests in flight,
equals an uninterrupted run; refused, mismatched and corrupt checkpoints fail clearly.

Every run shares one compiled step (online.make_step is memoised), the one
test_online_drafts uses too.
"""

import contextlib
import dataclasses
import hashlib
import io
import os
import re
import shutil
import time

import numpy as np
import pytest

from osd_jax.checkpoints.layout import CheckpointError
from osd_jax.serving import driver, online
from osd_jax.serving.checkpoint import Checkpointer
from tests.test_online import TIMING, VOCAB, host, tiny_pair, tree_equal
from tests.test_online_drafts import CATEGORIES, DEVICES, DRAFTS, SLOTS

EVERY = 4  # served requests between checkpoints
INTERRUPT_AFTER = 15  # records, mid-stream
TOO_LONG = 5  # this request's prompt cannot fit a slot
# orbax's asyncio helpers complain at garbage collection once closed.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")


def make_queries(num, seed=0):
  rng = np.random.default_rng(seed)
  queries = []
  for i in range(num):
    # DRAFTS fits prompts of up to 32 - 8 - 2 = 22 tokens.
    n = 23 if i == TOO_LONG else int(rng.integers(2, 13))
    words = " ".join(f"<{t}>" for t in rng.integers(3, VOCAB, n))
    queries.append(driver.Query(words, category=CATEGORIES[rng.integers(2)],
                                domain=f"d{i % 3}"))
  return queries


QUERIES = make_queries(22)


def run_config(cfg=DRAFTS):
  return {"online": dataclasses.asdict(cfg), "num_requests": len(QUERIES),
          "slots": SLOTS, "devices": DEVICES, "seed": 0}


class Interrupt(Exception):
  pass


class Saves(Checkpointer):
  """A Checkpointer that notes how many records had been emitted at each save."""

  def __init__(self, *args, records, **kwargs):
    super().__init__(*args, **kwargs)
    self.records, self.saved = records, []

  def save(self, step, state, host_state):
    super().save(step, state, host_state)
    self.saved.append(len(self.records))


def run(directory, *, resume, queries=QUERIES, cfg=DRAFTS, stop_after=None,
        config=None, pauses=(), every=EVERY) -> dict:
  """One driver run: final state (numpy; None if interrupted), records without
  timings, records emitted at each save and at each pause, and what it printed."""
  target, draft = tiny_pair()
  records = []

  def on_request(record):
    if stop_after is not None and len(records) == stop_after:
      raise Interrupt
    records.append({k: v for k, v in record.items() if k not in TIMING})

  checkpointer = Saves(directory, config or run_config(cfg), resume=resume,
                       records=records)
  printed = io.StringIO()
  state, pieces = None, []
  try:
    with contextlib.redirect_stdout(printed):
      for state in driver.serve_stream(
          target, draft, queries, cfg, num_slots=SLOTS,
          mesh=online.make_mesh(DEVICES), seed=0, chat=False,
          categories=CATEGORIES, checkpointer=checkpointer,
          checkpoint_every=every, on_request=on_request, pauses=pauses):
        pieces.append(len(records))
      state = host(state)
  except Interrupt:
    state = None
  finally:
    checkpointer.close()
  return dict(state=state, records=records, saved=checkpointer.saved,
              pieces=pieces, printed=printed.getvalue())


def snapshot(directory):
  """Every file under directory and a hash of its bytes."""
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("ckpt") / "run")
  return dict(run(directory, resume=False), directory=directory)


def test_every_request_is_served_or_refused_and_routed(uninterrupted):
  """The prompt too long for a slot gets its error record; the stream goes on."""
  records = uninterrupted["records"]
  errors = [r for r in records if "error" in r]
  served = [r for r in records if "error" not in r]
  assert [r["request"] for r in errors] == [TOO_LONG]
  assert "does not fit" in errors[0]["error"] and errors[0]["prompt_tokens"] == 23
  assert errors[0]["category"] == QUERIES[TOO_LONG].category
  assert sorted(r["request"] for r in served) == [
      i for i in range(len(QUERIES)) if i != TOO_LONG]
  assert [r["served"] for r in served] == list(range(1, len(served) + 1))
  for r in served:
    assert r["draft"] == CATEGORIES.index(QUERIES[r["request"]].category)
    assert r["category"] == CATEGORIES[r["draft"]]
    assert r["new_tokens"] >= 1
  assert sum("loss" in r for r in served) >= 2  # updates ran
  assert np.all(uninterrupted["state"].num_updates >= 1)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  """The same stream, interrupted by an exception mid-way, then resumed."""
  directory = str(tmp_path_factory.mktemp("ckpt") / "run")
  first = run(directory, resume=False, stop_after=INTERRUPT_AFTER)
  assert first["state"] is None and len(first["records"]) == INTERRUPT_AFTER
  return dict(first=first, after=run(directory, resume=True))


def test_resume_with_requests_in_flight_equals_uninterrupted_run(uninterrupted,
                                                                 resumed):
  full, first, after = (uninterrupted["records"], resumed["first"]["records"],
                        resumed["after"]["records"])
  assert first == full[:INTERRUPT_AFTER]
  # It resumed from the last checkpoint before the interruption, mid-stream,
  # while slots still held requests.
  at = resumed["first"]["saved"][-1]
  assert 0 < at < INTERRUPT_AFTER
  found = re.search(r"Resumed at request (\d+) \((\d+) served, (\d+) in flight\)",
                    resumed["after"]["printed"])
  assert found, resumed["after"]["printed"]
  assert int(found[3]) > 0
  # Served, call numbers, losses: every record after the checkpoint is the same.
  assert after == full[at:]
  assert tree_equal(resumed["after"]["state"], uninterrupted["state"])


def test_existing_checkpoints_without_resume_raise_and_are_kept(uninterrupted):
  directory = uninterrupted["directory"]
  before = snapshot(directory)
  with pytest.raises(CheckpointError, match="resume"):
    Checkpointer(directory, run_config(), resume=False)
  assert snapshot(directory) == before


def test_resume_with_other_settings_raises(uninterrupted):
  directory = uninterrupted["directory"]
  before = snapshot(directory)
  other = run_config(dataclasses.replace(DRAFTS, update_interval=8))
  with pytest.raises(CheckpointError, match="other settings"):
    Checkpointer(directory, other, resume=True)
  assert snapshot(directory) == before


def test_resume_with_other_shapes_raises(uninterrupted, tmp_path):
  """Same recorded settings, but a state of other shapes: a clear error."""
  directory = str(tmp_path / "copy")
  shutil.copytree(uninterrupted["directory"], directory)
  bigger = dataclasses.replace(DRAFTS, buffer_capacity=2 * DRAFTS.buffer_capacity)
  with pytest.raises(CheckpointError, match="does not match"):
    run(directory, resume=True, cfg=bigger, config=run_config())


@pytest.mark.parametrize("victim", ["largest", "state/_METADATA",
                                    "state/manifest.ocdbt", "host/metadata"])
@pytest.mark.parametrize("garbage", ["random", "empty"])
def test_corrupt_checkpoint_raises(uninterrupted, tmp_path, victim, garbage):
  directory = str(tmp_path / "copy")
  shutil.copytree(uninterrupted["directory"], directory)
  steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  latest = os.path.join(directory, str(steps[-1]))
  if victim == "largest":  # a data file of the saved arrays
    victim = max(snapshot(latest), key=lambda n: os.path.getsize(
        os.path.join(latest, n)))
  path = os.path.join(latest, victim)
  size = os.path.getsize(path)
  with open(path, "wb") as f:
    f.write(np.random.default_rng(0).bytes(size) if garbage == "random" else b"")
  before = snapshot(directory)
  with pytest.raises(CheckpointError, match="corrupt"):
    run(directory, resume=True)
  assert snapshot(directory) == before  # never overwritten


def test_garbled_run_config_raises(uninterrupted, tmp_path):
  directory = str(tmp_path / "copy")
  shutil.copytree(uninterrupted["directory"], directory)
  with open(os.path.join(directory, "run_config.json"), "w") as f:
    f.write("{not json")
  before = snapshot(directory)
  with pytest.raises(CheckpointError, match="run_config.json"):
    Checkpointer(directory, run_config(), resume=True)
  assert snapshot(directory) == before


def test_stream_ending_on_a_checkpoint(tmp_path):
  """The last call saves at the same step as the save at exit: one save, no error."""
  queries = [driver.Query("<5> <6> <7>", category=c) for c in "aaaabbbb"]
  directory = str(tmp_path / "run")
  done = run(directory, resume=False, queries=queries, config={"short": True})
  assert done["state"] is not None and len(done["records"]) == 8
  assert sorted(int(n) for n in os.listdir(directory) if n.isdigit())[-1] == 8
  assert len(done["saved"]) == len(set(done["saved"]))
  # Resuming the finished run serves nothing more and saves nothing new.
  again = run(directory, resume=True, queries=queries, config={"short": True})
  assert again["records"] == [] and again["saved"] == []
  assert tree_equal(again["state"], done["state"])


def test_checkpoint_saves_stop_the_serving_clock(tmp_path, monkeypatch):
  """Timings measure serving: a save, here one that takes 1000 s on the host
  clock, adds nothing to any request's times. The Checkpointer counts it."""
  lost = [0.0]
  monkeypatch.setattr(driver, "_host_seconds", lambda: time.perf_counter() + lost[0])

  class SlowSaves(Checkpointer):
    def save(self, step, state, host_state):
      super().save(step, state, host_state)
      lost[0] += 1000.0

  target, draft = tiny_pair()
  checkpointer = SlowSaves(str(tmp_path / "run"), run_config(), resume=False)
  records = []
  try:
    driver.run_stream(target, draft, QUERIES[:10], DRAFTS, num_slots=SLOTS,
                      mesh=online.make_mesh(DEVICES), seed=0, chat=False,
                      categories=CATEGORIES, checkpointer=checkpointer,
                      checkpoint_every=EVERY, on_request=records.append)
  finally:
    checkpointer.close()
  served = [r for r in records if "error" not in r]
  assert checkpointer.saves >= 3 and lost[0] >= 3000  # mid-stream and at exit
  assert checkpointer.seconds < 1000  # its own clock: the real save time
  assert len(served) == 9  # request TOO_LONG is refused
  assert max(r["finished_s"] for r in served) < 1000
  assert max(r["queue_s"] + r["ttft_s"] for r in served) < 1000


PAUSES = (8, 15)  # where a paused stream hands its turn to another pass
PAUSED_INTERRUPT = 13  # records: inside the second piece


@pytest.fixture(scope="module")
def paused(tmp_path_factory):
  """The stream served in three pieces, whole and interrupted then resumed."""
  whole = run(str(tmp_path_factory.mktemp("ckpt") / "run"), resume=False,
              pauses=PAUSES)
  directory = str(tmp_path_factory.mktemp("ckpt") / "run")
  first = run(directory, resume=False, pauses=PAUSES, stop_after=PAUSED_INTERRUPT)
  return dict(whole=whole, first=first,
              after=run(directory, resume=True, pauses=PAUSES))


def test_a_paused_stream_finishes_each_piece_before_the_next(paused):
  records, pieces = paused["whole"]["records"], paused["whole"]["pieces"]
  ends = (*PAUSES, len(QUERIES))
  assert len(pieces) == len(ends)
  for end, count in zip(ends, pieces):
    assert sorted(r["request"] for r in records[:count]) == list(range(end))
  # Pieces change which requests share a call, not what each request gets.
  served = [r for r in records if "error" not in r]
  assert [r["served"] for r in served] == list(range(1, len(served) + 1))
  assert sum("loss" in r for r in served) >= 2


def test_a_paused_stream_resumes_exactly(paused):
  at = paused["first"]["saved"][-1]
  assert PAUSES[0] < at < PAUSED_INTERRUPT  # mid-piece
  assert paused["first"]["records"] == paused["whole"]["records"][:PAUSED_INTERRUPT]
  assert paused["after"]["records"] == paused["whole"]["records"][at:]
  assert tree_equal(paused["after"]["state"], paused["whole"]["state"])


def test_a_pause_is_not_a_save(tmp_path):
  """Saves come every `checkpoint_every` requests and at the end, however
  often the stream pauses (the main job pauses every 8 requests)."""
  done = run(str(tmp_path / "run"), resume=False, pauses=(2, 4, 6, 8), every=0)
  assert done["saved"] == [len(done["records"])]


def test_a_paused_stream_stops_its_clock_while_paused(monkeypatch):
  """Another pass's turn, here 1000 s on the host clock, is not serving time."""
  lost = [0.0]
  monkeypatch.setattr(driver, "_host_seconds", lambda: time.perf_counter() + lost[0])
  target, draft = tiny_pair()
  records = []
  for _ in driver.serve_stream(target, draft, QUERIES[:10], DRAFTS, num_slots=SLOTS,
                               mesh=online.make_mesh(DEVICES), seed=0, chat=False,
                               categories=CATEGORIES, on_request=records.append,
                               pauses=(3, 7)):
    lost[0] += 1000.0
  served = [r for r in records if "error" not in r]
  assert len(served) == 9 and lost[0] == 3000.0
  assert max(r["finished_s"] for r in served) < 1000
  assert max(r["queue_s"] + r["ttft_s"] for r in served) < 1000


# Minibatch replay draws from a key carried in the state: a resume draws the
# same minibatches as the run it continues.
REPLAY = dataclasses.replace(DRAFTS, minibatch=3, update_steps=2,
                             clear_after_update=False)


def test_replayed_learning_resumes_exactly(tmp_path):
  full = run(str(tmp_path / "full"), resume=False, cfg=REPLAY)
  directory = str(tmp_path / "cut")
  first = run(directory, resume=False, cfg=REPLAY, stop_after=INTERRUPT_AFTER)
  after = run(directory, resume=True, cfg=REPLAY)
  at = first["saved"][-1]
  assert 0 < at < INTERRUPT_AFTER
  assert after["records"] == full["records"][at:]
  assert tree_equal(after["state"], full["state"])
  # Updates ran on both sides of the cut, so the draws were resumed, not redone.
  assert int(full["state"].num_updates.sum()) >= 3
  assert any(r.get("updates") for r in full["records"][at:])
