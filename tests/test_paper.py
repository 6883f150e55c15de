"""The paper's experiments, end to end in --quick mode on a tiny random pair."""

import dataclasses
import json
import os

from absl import flags
import numpy as np
import pytest

from experiments import paper
from experiments.paper import shift
from osd_jax.distillation import offline
from tests import tiny_models

# --quick sizes, with shapes a tiny model can take.
SETTINGS = paper.Settings.quick(prompt_len=16, max_new_tokens=8, batch_size=4,
                                update_interval=4, speedup_max_k=2,
                                timing_repeats=2)


@pytest.fixture(scope="module")
def models():
  return tiny_models.pair()


@pytest.fixture(scope="module")
def sources():
  return tiny_models.sources()


def run(name, models, sources, tmp_path):
  results = paper.run(name, *models, SETTINGS, str(tmp_path), sources=sources,
                      log=lambda _: None)
  for suffix in ("md", "png", "json"):
    assert os.path.getsize(tmp_path / f"{name}.{suffix}") > 0
  table = (tmp_path / f"{name}.md").read_text()
  return results, table


def test_main(models, sources, tmp_path):
  results, table = run("main", models, sources, tmp_path)
  assert set(results) == set(SETTINGS.domains)
  for domain, r in results.items():
    assert f"| {domain} |" in table
    assert {"before", "offline", "online"} <= set(r["eval"])
    assert all(0 <= e["alpha"] <= 1 for e in r["eval"].values())
    assert len(r["online_curve"]) == SETTINGS.num_train
    assert r["offline_loss"][-1] < r["offline_loss"][0]
  assert (tmp_path / "online_sql.jsonl").exists()


def test_shift(models, sources, tmp_path, monkeypatch):
  # Spy on what the static drafts are actually distilled on: the collected
  # rows (one per request, in stream order) and each training subset.
  collected, trained_rows = [], []

  def collect(*args, **kwargs):
    collected.append(real_collect(*args, **kwargs))
    return collected[-1]

  def train(draft, target, target_config, draft_config, data, *args, **kwargs):
    trained_rows.append(np.asarray(data.tokens))
    return real_train(draft, target, target_config, draft_config, data, *args,
                      **kwargs)

  real_collect, real_train = offline.collect, offline.train
  monkeypatch.setattr(offline, "collect", collect)
  monkeypatch.setattr(offline, "train", train)
  results, table = run("shift", models, sources, tmp_path)
  expected = ["static 0% (before)"] + [f"static {f:.0%}" for f in SETTINGS.fractions]
  assert list(results["curves"]) == expected + ["online"]
  stream_length = SETTINGS.segment_length * len(SETTINGS.domains)
  assert all(len(c) == stream_length for c in results["curves"].values())
  assert all(f"| {name} |" in table for name in results["curves"])
  assert "held-out requests" in table
  assert (tmp_path / "shift_held_out.png").stat().st_size > 0

  # The requests each static draft really trained on, found by content.
  rows = np.asarray(collected[0].tokens)
  assert len(rows) == stream_length
  online = results["curves"]["online"]
  for fraction, trained in zip(SETTINGS.fractions, trained_rows, strict=True):
    name = f"static {fraction:.0%}"
    split = results["held_out"][name]
    seen = {i for row in trained for i in np.flatnonzero((rows == row).all(1))}
    assert seen == set(split["trained"])
    held = [i for seg in split["held_out"] for i in seg]
    assert not seen & set(held), f"{name} is scored on requests it trained on"
    # Everything else is held out (the tiny stream repeats no prompt), so the
    # check above is not vacuous.
    assert len(seen) + len(held) == stream_length
    assert bool(held) == (fraction < 1.0)
    # The reported means are taken over exactly those requests.
    for group, static, ours in zip(split["held_out"] + [held], split["static"],
                                   split["online"], strict=True):
      curve = results["curves"][name]
      assert static == (pytest.approx(np.mean([curve[i] for i in group]))
                        if group else None)
      assert ours == (pytest.approx(np.mean([online[i] for i in group]))
                      if group else None)


def test_shift_split_holds_out_repeated_prompts():
  prompts = [[5, 6], [7, 8], [5, 6], [9, 9], [3, 4], [3, 4], [1, 2]]
  trained, held = shift.split([[0, 1, 2, 3], [4, 5, 6]], prompts, 0.5)
  assert trained == [0, 1, 4, 5]
  # Request 2 repeats trained request 0's prompt, and 5 (trained) repeats 4.
  assert held == [[3], [6]]
  assert shift.split([[0, 1], [2]], [[1, 1], [2, 2], [3, 3]], 1.0) == ([0, 1, 2], [[], []])
  # At least one request per segment trains, however small the fraction.
  assert shift.split([[0, 1, 2]], [[1], [2], [3]], 0.1) == ([0], [[1, 2]])


def test_shift_refuses_short_segments(models, sources, tmp_path):
  # Prompts of 3-9 words and 2 chat markers: few fit 6 tokens, so a segment
  # would be shorter than --segment_length says.
  settings = dataclasses.replace(SETTINGS, prompt_len=6)
  with pytest.raises(ValueError, match="segment_length=16"):
    paper.run("shift", *models, settings, str(tmp_path), sources=sources,
              log=lambda _: None)


def test_categories(models, sources, tmp_path):
  results, table = run("categories", models, sources, tmp_path)
  rows = {row[0]: row for row in results["rows"]}
  assert set(rows) == set(SETTINGS.categories) | {"all"}
  assert sum(rows[c][1] for c in SETTINGS.categories) == rows["all"][1]
  assert all(0 <= x <= 1 for row in rows.values() for x in row[2:])
  # Per-category drafts logged which draft served each request.
  records = [json.loads(line) for line in
             (tmp_path / "online_per_category.jsonl").read_text().splitlines()]
  assert {r["draft"] for r in records} == {0, 1}
  assert "| en |" in table


def test_speedup(models, sources, tmp_path):
  results, table = run("speedup", models, sources, tmp_path)
  costs = results["costs"]
  assert costs["c"] > 0 and set(costs["v"]) == {1, 2, SETTINGS.k}
  assert len(results["rows"]) == 3 * len(SETTINGS.domains)
  assert all(row[-1] > 0 for row in results["rows"])
  assert "measured wall-clock" in table


def test_predicted_speedup():
  assert paper.predicted_speedup(0.0, 4, 0.1, 1.5) == pytest.approx(1 / 1.9)
  assert paper.predicted_speedup(0.5, 1, 0.0) == pytest.approx(1.5)
  # The prototype's cost model: at alpha 0.6, c 0.01/0.02/0.05/0.1 -> k 7/6/4/3.
  assert [paper.best_k(0.6, c)[0] for c in (0.01, 0.02, 0.05, 0.1)] == [7, 6, 4, 3]


def test_settings_from_flags():
  values = flags.FlagValues()
  paper.define_flags(values)
  values(["paper", "--quick", "--num_eval=5", "--fractions=0.25,1",
          "--segment_length=300", "--experiment=shift"])
  settings = paper.settings_from_flags(values)
  assert settings == paper.Settings.quick(num_eval=5, fractions=(0.25, 1.0),
                                          segment_length=300)
  values = flags.FlagValues()
  paper.define_flags(values)
  values(["paper", "--categories=en,fr", "--category_key=domain"])
  assert paper.settings_from_flags(values) == paper.Settings(
      categories=("en", "fr"), category_key="domain")


def test_bad_settings():
  with pytest.raises(ValueError, match="loss"):
    paper.Settings(loss="l2")
  with pytest.raises(ValueError, match="fractions"):
    paper.Settings(fractions=(0.0, 1.0))
  with pytest.raises(ValueError, match="Unknown experiment"):
    paper.run("ablation", None, None, SETTINGS, "/tmp/unused")
