"""The main job end to end on the real model, tiny sizes (marked real_model).

Runs `python -m experiments.online` as a user would (four passes over one
stream: target-only, static draft, online, n-gram lookup) and checks what it
writes, and that it prints its own lines only.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.entry_points import ROOT, one_device_env

ABSL_INFO = re.compile(r"^I\d{4} ", re.M)  # absl's INFO prefix, e.g. "I1201 09:19:22"
RUNS = ("target", "static", "online", "ngram")
NUM_REQUESTS = 8


@pytest.mark.real_model
def test_main_job_writes_passes_summary_plots_and_checkpoints(tmp_path):
  out = tmp_path / "online"
  # Two segments of 4: the passes take turns, a segment each.
  cmd = [sys.executable, "-m", "experiments.online", "--stream=shift",
         "--domains=math,code", f"--num_requests={NUM_REQUESTS}", "--slots=2",
         "--warm_start=none",
         "--max_new_tokens=4", "--cache_size=128", "--steps_per_call=4",
         "--update_interval=4", "--buffer_capacity=4", "--checkpoint_every=4",
         "--window=4", f"--output_dir={out}",
         # Full-width verification: the trimmed one compiles a branch per
         # width for each pass; tests/test_online.py covers it.
         "--notrim_verify"]
  env = one_device_env(OSD_JAX_DATA_DIR=str(tmp_path / "data"))  # built afresh
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=1500)
  assert done.returncode == 0, done.stderr[-3000:]
  # No orbax INFO lines, no tfds banners or bars: the run's own lines only.
  output = done.stdout + done.stderr
  assert not ABSL_INFO.search(output), ABSL_INFO.findall(output)[:5]
  for noise in ("orbax", "Downloading and preparing", "Generating splits",
                "Shuffling", "PyTorch was not found"):
    assert noise not in output, noise
  assert re.search(r"\[online\] \d+ s of serving", done.stdout), done.stdout
  for name in ("alpha.png", "speed.png", "summary.json", "checkpoints",
               *(f"{run}.jsonl" for run in RUNS), *(f"{run}.done" for run in RUNS)):
    assert (out / name).exists(), name
  assert any(n.isdigit() for n in os.listdir(out / "checkpoints"))

  # Every request of every pass is served or refused, once.
  records = {run: [json.loads(line) for line in
                   (out / f"{run}.jsonl").read_text().splitlines()] for run in RUNS}
  for run, rows in records.items():
    assert sorted(r["request"] for r in rows) == list(range(NUM_REQUESTS)), run
    served = [r for r in rows if "error" not in r]
    assert served, run
    for r in served:
      assert 0.0 <= r["alpha"] <= 1.0 and 1 <= r["new_tokens"] <= 4
      assert min(r["queue_s"], r["ttft_s"], r["itl_s"]) >= 0.0
  assert all(r["tokens_per_target_call"] == 1.0 for r in records["target"]
             if "error" not in r)
  # The same requests are refused by every pass (too long for a slot).
  refused = {run: {r["request"] for r in rows if "error" in r}
             for run, rows in records.items()}
  assert len({frozenset(ids) for ids in refused.values()}) == 1

  summary = {s["run"]: s for s in json.loads((out / "summary.json").read_text())}
  assert set(summary) == set(RUNS)
  for s in summary.values():
    assert [seg["domain"] for seg in s["segments"]] == ["math", "code"]
  assert summary["static"]["updates"] == summary["ngram"]["updates"] == 0
  served_online = summary["online"]["requests"]
  assert 1 <= summary["online"]["updates"] <= served_online // 4
  # Speed-ups over target-only, per segment and over the last window.
  for run, s in summary.items():
    speedups = [seg["speedup"] for seg in s["segments"]]
    speedups += [s["last"]["speedup"], s["speedup"]]
    assert all(np.isfinite(x) and x > 0 for x in speedups), (run, speedups)
    if run == "target":
      np.testing.assert_allclose(speedups, 1.0)
  assert "speed-up" in done.stdout and "speed.png" in done.stdout

  # A second start without --resume must refuse to overwrite the checkpoints.
  again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
  assert again.returncode != 0
  assert "--resume" in again.stderr
