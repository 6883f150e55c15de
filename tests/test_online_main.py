"""The main job end to end on the real model, tiny sizes (marked real_model).

Runs `python -m experiments.online` as a user would and checks what it writes.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.real_model
def test_main_job_writes_curves_summary_and_checkpoints(tmp_path):
  out = tmp_path / "online"
  cmd = [sys.executable, "-m", "experiments.online", "--stream=single",
         "--domains=math", "--num_requests=8", "--batch_size=4",
         "--max_new_tokens=4", "--prompt_len=128", "--update_interval=4",
         "--buffer_capacity=4", "--checkpoint_every=4", "--window=4",
         "--progress_every=4",
         f"--output_dir={out}"]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one device, as a user's CPU run
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  for name in ("alpha.png", "summary.json", "online.jsonl", "static.jsonl",
               "static.done", "checkpoints"):
    assert (out / name).exists(), name
  summary = {s["run"]: s for s in json.loads((out / "summary.json").read_text())}
  assert summary["static"]["updates"] == 0
  assert summary["online"]["updates"] == summary["online"]["requests"] // 4 > 0
  records = [json.loads(line) for line in (out / "online.jsonl").read_text().splitlines()]
  served = [r for r in records if not r.get("skipped")]
  assert all(0.0 <= r["alpha"] <= 1.0 for r in served)
  assert "rolling alpha" in done.stdout

  # A second start without --resume must refuse to overwrite the checkpoints.
  again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
  assert again.returncode != 0
  assert "--resume" in again.stderr
