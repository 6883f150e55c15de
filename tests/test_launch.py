"""The launchers' plans: exact gcloud lines from --dry_run, and how they execute."""

import os
import shlex
import subprocess
import sys
import tempfile

import pytest

from launch import gpu, tpu
from launch.shell import render

ROOT = tpu.CHECKOUT
GCLOUD = "gcloud compute tpus tpu-vm"


def dry_run(capsys, *argv: str) -> list[str]:
  assert tpu.main([*argv, "--dry_run"]) == 0
  return capsys.readouterr().out.splitlines()


def test_dry_run_all_prints_exact_commands(capsys):
  lines = dry_run(capsys, "--name=osd", "--zone=us-west4-a", "--project=proj",
                  "--accelerator_type=v5litepod-8", "--output_dir=gs://bucket/run1")
  where = "--zone=us-west4-a --project=proj"
  tarball = os.path.join(tempfile.gettempdir(), "osd.tar.gz")
  assert lines == [
      f"{GCLOUD} describe osd {where} || {GCLOUD} create osd"
      f" --accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite {where}",
      shlex.join(["bash", "-c", f"set -o pipefail; git -C {ROOT} ls-files -z -co"
                  f" --exclude-standard | tar -C {ROOT} --null -T - -czf {tarball}"]),
      f"{GCLOUD} scp {tarball} osd:osd-jax.tar.gz --worker=all {where}",
      f"{GCLOUD} ssh osd --worker=all --command 'mkdir -p osd-jax"
      " && tar -xzf osd-jax.tar.gz -C osd-jax && cd osd-jax && bash scripts/setup.sh"
      ' && .venv/bin/pip install "jax[tpu]==0.10.2"'
      ' && .venv/bin/python -c "import jax; print(jax.device_count())"\'' f" {where}",
      f"{GCLOUD} ssh osd --worker=all --command 'cd osd-jax && . .venv/bin/activate"
      " && python -m experiments.online --output_dir=outputs/run1 --multihost'"
      f" {where}",
      f"{GCLOUD} ssh osd --worker=0 --command 'cd osd-jax && gcloud storage cp -r"
      f" outputs/run1 gs://bucket/run1' {where}",
  ]


def test_flags_reach_every_gcloud_command(capsys):
  lines = dry_run(capsys, "--name=big", "--zone=us-central2-b", "--project=p1",
                  "--accelerator_type=v4-32", "--version=my-image", "--spot",
                  "--preemptible", "--delete",
                  "--command=python -m experiments.online --k=4")
  gcloud_lines = [line for line in lines if line.startswith("gcloud")]
  assert len(gcloud_lines) == 6  # create, scp, setup, run, scp back, delete.
  for line in gcloud_lines:
    assert line.count("--zone=us-central2-b --project=p1") == line.count("gcloud")
  assert ("create big --accelerator-type=v4-32 --version=my-image --spot"
          " --preemptible") in lines[0]
  assert "python -m experiments.online --k=4 --output_dir=outputs/big --multihost" in lines[4]


def test_default_version_follows_accelerator_type():
  assert tpu.default_version("v5litepod-8") == "v2-alpha-tpuv5-lite"
  assert tpu.default_version("v5p-16") == "v2-alpha-tpuv5"
  assert tpu.default_version("v6e-8") == "v2-alpha-tpuv6e"
  assert tpu.default_version("v4-32") == "tpu-ubuntu2204-base"


def test_every_worker_gets_the_code_and_runs_the_job(capsys):
  lines = dry_run(capsys, "--output_dir=gs://b/x")
  remote = [line for line in lines if " scp " in line or " ssh " in line]
  assert len(remote) == 4
  assert all("--worker=all" in line for line in remote[:3])
  assert "--worker=0" in remote[3]


def test_gcs_output_is_written_locally_then_uploaded_by_worker_0(capsys):
  lines = dry_run(capsys, "--action=run", "--output_dir=gs://bucket/a/b")
  assert len(lines) == 2 and "--output_dir=outputs/b --multihost" in lines[0]
  assert "--worker=0" in lines[1]
  assert "gcloud storage cp -r outputs/b gs://bucket/a/b" in lines[1]


def test_local_output_is_copied_back_from_worker_0(capsys):
  lines = dry_run(capsys, "--action=run", "--name=n", "--output_dir=/tmp/res/run1/")
  assert "--output_dir=outputs/run1 --multihost" in lines[0]
  assert lines[1:] == [
      "mkdir -p /tmp/res",
      f"{GCLOUD} scp n:osd-jax/outputs/run1 /tmp/res --recurse --worker=0"
      " --zone=us-west4-a"]


@pytest.mark.parametrize("action", ["create", "setup", "run", "all"])
def test_delete_only_when_asked(capsys, action):
  assert not any(" delete " in line for line in dry_run(capsys, f"--action={action}"))
  lines = dry_run(capsys, f"--action={action}", "--delete")
  assert lines[-1] == f"{GCLOUD} delete osd-jax --quiet --zone=us-west4-a"
  assert sum(" delete " in line for line in lines) == 1


def test_delete_action_only_deletes(capsys):
  assert dry_run(capsys, "--action=delete", "--name=x") == [
      f"{GCLOUD} delete x --quiet --zone=us-west4-a"]


def test_bad_name_is_a_usage_error():
  with pytest.raises(SystemExit) as e:
    tpu.main(["--name=Bad_Name", "--dry_run"])
  assert e.value.code == 2


def test_without_gcloud_fails_with_a_clear_error(tmp_path):
  env = {**os.environ, "PATH": str(tmp_path)}  # An empty directory: no gcloud.
  result = subprocess.run([sys.executable, "-m", "launch.tpu", "--action=all"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
  assert result.returncode == 1
  assert "gcloud not found on PATH" in result.stderr
  assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.fixture
def fake_gcloud(tmp_path, monkeypatch):
  """A gcloud on PATH that logs its verb; it fails for the verb in $FAIL."""
  log = tmp_path / "calls"
  script = tmp_path / "gcloud"
  script.write_text(f'#!/bin/sh\necho "$4" >> {log}\n[ "$4" != "$FAIL" ]\n')
  script.chmod(0o755)
  monkeypatch.setenv("PATH", str(tmp_path))
  return lambda: log.read_text().split()


def test_existing_vm_is_reused(fake_gcloud, capsys):
  assert tpu.main(["--action=create"]) == 0
  assert fake_gcloud() == ["describe"]


def test_missing_vm_is_created(fake_gcloud, monkeypatch, capsys):
  monkeypatch.setenv("FAIL", "describe")
  assert tpu.main(["--action=create"]) == 0
  assert fake_gcloud() == ["describe", "create"]


def test_failed_run_still_deletes_when_asked(fake_gcloud, monkeypatch, capsys):
  monkeypatch.setenv("FAIL", "ssh")
  assert tpu.main(["--action=run", "--output_dir=gs://b/x", "--delete"]) == 1
  assert fake_gcloud() == ["ssh", "delete"]
  assert "launch.tpu: error: exit code 1 from: gcloud" in capsys.readouterr().err


def test_gpu_dry_run(capsys):
  assert gpu.main(["--dry_run", "--output_dir=gs://b/g",
                   "--command=python -m experiments.online --k=4"]) == 0
  assert capsys.readouterr().out.splitlines() == [
      f"cd {ROOT}",
      "bash scripts/setup.sh",
      ".venv/bin/pip install 'jax[cuda12]==0.10.2'",
      ".venv/bin/python -c 'import jax; print(jax.devices())'",
      ".venv/bin/python -m experiments.online --k=4 --devices=all --output_dir=outputs/g",
      "gcloud storage cp -r outputs/g gs://b/g",
  ]


def test_step_renders_alternatives_as_shell_or():
  assert render((["a", "b c"], ["d"])) == "a 'b c' || d"
