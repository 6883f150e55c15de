"""Orbax checkpoints through the driver: resume equals an uninterrupted run; bad ones fail.

The driver builds its step with online.make_step; here that is memoised so
all runs share one compiled step (the one test_online_drafts also uses).
"""

import dataclasses
import hashlib
import os
import shutil

import jax
import numpy as np
import pytest

from osd_jax.checkpoints.layout import CheckpointError
from osd_jax.serving import driver, online
from osd_jax.serving.checkpoint import Checkpointer
from tests.test_online import (PROMPT_LEN, VOCAB, cached_make_step, host,
                               tiny_pair, tree_equal)
from tests.test_online_drafts import BATCH, DEVICES, DRAFTS

CATEGORIES = ("a", "b")
EVERY = 4  # requests between checkpoints: after every full batch
INTERRUPT_AFTER = 11  # records, mid-stream
# orbax's asyncio helpers complain at garbage collection once closed.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")


def make_queries(num, seed=0, too_long_at=5):
  rng = np.random.default_rng(seed)
  queries = []
  for i in range(num):
    n = PROMPT_LEN + 1 if i == too_long_at else int(rng.integers(2, PROMPT_LEN + 1))
    words = " ".join(f"<{t}>" for t in rng.integers(3, VOCAB, n))
    queries.append(driver.Query(words, category=CATEGORIES[rng.integers(2)],
                                domain=f"d{i % 3}"))
  return queries


QUERIES = make_queries(22)


def run_config(cfg=DRAFTS):
  return {"online": dataclasses.asdict(cfg), "num_requests": len(QUERIES),
          "batch_size": BATCH, "devices": DEVICES, "seed": 0}


class Interrupt(Exception):
  pass


def run(directory, *, resume, queries=QUERIES, cfg=DRAFTS, stop_after=None,
        config=None):
  """(final state as numpy, records without timings) of one driver run."""
  target, draft = tiny_pair()
  mesh = online.make_mesh(DEVICES)
  records = []

  def on_request(record):
    if stop_after is not None and len(records) == stop_after:
      raise Interrupt
    records.append({k: v for k, v in record.items() if k != "batch_seconds"})

  checkpointer = Checkpointer(directory, config or run_config(cfg), resume=resume)
  try:
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(online, "make_step", cached_make_step)
      state = driver.run_stream(
          target, draft, queries, cfg, batch_size=BATCH, mesh=mesh, seed=0,
          chat=False, categories=CATEGORIES, checkpointer=checkpointer,
          checkpoint_every=EVERY, on_request=on_request)
    return host(state.replace(rng=jax.random.key_data(state.rng))), records
  except Interrupt:
    return None, records
  finally:
    checkpointer.close()


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
  state, records = run(directory, resume=False)
  return dict(directory=directory, state=state, records=records)


def test_stream_is_served_and_routed(uninterrupted):
  records = uninterrupted["records"]
  skipped = [r for r in records if r.get("skipped")]
  served = [r for r in records if not r.get("skipped")]
  assert [r["request"] for r in skipped] == [5]
  assert sorted(r["request"] for r in served) == [
      i for i in range(len(QUERIES)) if i != 5]
  assert [r["served"] for r in served] == list(range(1, len(served) + 1))
  for r in served:
    assert r["draft"] == CATEGORIES.index(QUERIES[r["request"]].category)
    assert r["category"] == CATEGORIES[r["draft"]]
  assert sum(r["loss"] is not None for r in served) >= 2  # updates ran
  assert np.all(uninterrupted["state"].num_updates >= 1)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  """The same stream, interrupted mid-way by an exception, then resumed."""
  directory = str(tmp_path_factory.mktemp("ckpt") / "run")
  state, first = run(directory, resume=False, stop_after=INTERRUPT_AFTER)
  assert state is None and len(first) == INTERRUPT_AFTER
  state, after = run(directory, resume=True)
  return dict(first=first, after=after, state=state)


def without_batch(records):
  return [{k: v for k, v in r.items() if k != "batch"} for r in records]


def test_resume_equals_uninterrupted_run(uninterrupted, resumed):
  full, after = uninterrupted["records"], resumed["after"]
  assert resumed["first"] == full[:INTERRUPT_AFTER]
  # It resumed from a checkpoint mid-stream, not from the start or the end.
  assert 0 < len(full) - len(after) <= INTERRUPT_AFTER
  assert without_batch(after) == without_batch(full[len(full) - len(after):])
  assert tree_equal(resumed["state"], uninterrupted["state"])


def test_resumed_records_keep_their_batch_numbers(uninterrupted, resumed):
  full, after = uninterrupted["records"], resumed["after"]
  assert after == full[len(full) - len(after):]


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
  bigger = dataclasses.replace(DRAFTS, buffer_capacity=2 * BATCH)
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
  """The last batch saves at the same step as the save at exit: one save, no error."""
  queries = [driver.Query("<5> <6> <7>", category=c) for c in "aaaabbbb"]
  directory = str(tmp_path / "run")
  state, records = run(directory, resume=False, queries=queries,
                       config={"short": True})
  assert state is not None and len(records) == 8
  assert sorted(int(n) for n in os.listdir(directory) if n.isdigit())[-1] == 8
  # Resuming the finished run serves nothing more and saves nothing new.
  again, more = run(directory, resume=True, queries=queries,
                    config={"short": True})
  assert more == [] and tree_equal(again, state)
