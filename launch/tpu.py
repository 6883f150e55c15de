"""Create, set up, run on and delete a Cloud TPU VM slice with gcloud.

  python -m launch.tpu --action=all --name=osd --zone=us-west4-a \\
      --accelerator_type=v5litepod-8 --output_dir=gs://BUCKET/osd --delete
  python -m launch.tpu --action=all ... --dry_run   # print the commands only

Every worker of the slice runs the same command (one JAX process per host);
the launcher appends `--output_dir=... --multihost` to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import posixpath
import re
import shlex
import sys
import tempfile
from collections.abc import Sequence

from launch import shell
from launch.shell import Argv, Step

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_TPU = "jax[tpu]==0.10.2"
DEFAULT_COMMAND = "python -m experiments.online"
ACTIONS = ("create", "setup", "run", "delete", "all")
# Runtime image per TPU generation (cloud.google.com/tpu/docs/runtimes).
_VERSIONS = {"v6e": "v2-alpha-tpuv6e", "v5p": "v2-alpha-tpuv5",
             "v5litepod": "v2-alpha-tpuv5-lite", "v5e": "v2-alpha-tpuv5-lite"}
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # Cloud TPU node names.


@dataclasses.dataclass(frozen=True)
class TpuJob:
  """Where the slice lives, what runs on it and where its outputs go."""
  name: str
  zone: str
  accelerator_type: str
  version: str
  output_dir: str  # a local dir is copied back; gs://... is uploaded by worker 0.
  command: str = DEFAULT_COMMAND
  project: str = ""  # "" = gcloud's configured project.
  spot: bool = False
  preemptible: bool = False
  remote_dir: str = "osd-jax"  # The checkout, in each worker's home directory.
  tarball: str = os.path.join(tempfile.gettempdir(), "osd-jax.tar.gz")
  checkout: str = CHECKOUT


def default_version(accelerator_type: str) -> str:
  """The TPU software version for an accelerator type such as v5litepod-8."""
  return _VERSIONS.get(accelerator_type.split("-")[0], "tpu-ubuntu2204-base")


def is_gcs(path: str) -> bool:
  """Whether the results go to a gs:// URL (copied there from worker 0)."""
  return path.startswith("gs://")


def remote_output(job: TpuJob) -> str:
  """The local --output_dir the workers write to (relative to the checkout).

  The experiments write with plain file calls, so even for a gs:// destination
  they write locally and worker 0 (the only writer) copies the folder up.
  """
  return posixpath.join("outputs", posixpath.basename(job.output_dir.rstrip("/")))


def gcloud(job: TpuJob, verb: str, *args: str) -> Argv:
  """A `gcloud compute tpus tpu-vm VERB` command for this job's slice."""
  project = [f"--project={job.project}"] if job.project else []
  return ["gcloud", "compute", "tpus", "tpu-vm", verb, *args,
          f"--zone={job.zone}", *project]


def on_workers(job: TpuJob, script: str, worker: str = "all") -> Argv:
  """Runs a shell `script` over ssh on the slice's workers, all at once."""
  return gcloud(job, "ssh", job.name, f"--worker={worker}", "--command", script)


def create(job: TpuJob) -> list[Step]:
  """Reuses the slice if it exists, else creates it."""
  flags = [f"--accelerator-type={job.accelerator_type}", f"--version={job.version}"]
  flags += ["--spot"] * job.spot + ["--preemptible"] * job.preemptible
  return [(gcloud(job, "describe", job.name), gcloud(job, "create", job.name, *flags))]


def setup(job: TpuJob) -> list[Step]:
  """Copies this checkout (tracked and unignored files) to all workers, installs it."""
  src, tarball = shlex.quote(job.checkout), shlex.quote(job.tarball)
  pack = (f"set -o pipefail; git -C {src} ls-files -z -co --exclude-standard"
          f" | tar -C {src} --null -T - -czf {tarball}")
  d = shlex.quote(job.remote_dir)
  install = (f"mkdir -p {d} && tar -xzf osd-jax.tar.gz -C {d} && cd {d}"
             f' && bash scripts/setup.sh && .venv/bin/pip install "{JAX_TPU}"'
             ' && .venv/bin/python -c "import jax; print(jax.device_count())"')
  copy = gcloud(job, "scp", job.tarball, f"{job.name}:osd-jax.tar.gz", "--worker=all")
  return [(["bash", "-c", pack],), (copy,), (on_workers(job, install),)]


def run(job: TpuJob) -> list[Step]:
  """Runs the command on all workers; a local output dir is fetched from worker 0."""
  out = shlex.quote(remote_output(job))
  script = (f"cd {shlex.quote(job.remote_dir)} && . .venv/bin/activate"
            f" && {job.command} --output_dir={out} --multihost")
  steps = [(on_workers(job, script),)]
  if is_gcs(job.output_dir):
    upload = (f"cd {shlex.quote(job.remote_dir)} && gcloud storage cp -r"
              f" {out} {shlex.quote(job.output_dir.rstrip('/'))}")
    steps += [(on_workers(job, upload, worker="0"),)]
  else:
    # Only process 0 writes outputs, so worker 0 holds all of them.
    parent = os.path.dirname(os.path.normpath(job.output_dir)) or "."
    source = f"{job.name}:{posixpath.join(job.remote_dir, remote_output(job))}"
    steps += [(["mkdir", "-p", parent],),
              (gcloud(job, "scp", source, parent, "--recurse", "--worker=0"),)]
  return steps


def delete(job: TpuJob) -> list[Step]:
  """Deletes the slice without a prompt."""
  return [(gcloud(job, "delete", job.name, "--quiet"),)]


def plan(job: TpuJob, action: str, tear_down: bool) -> tuple[list[Step], list[Step]]:
  """The steps of an action, and clean-up steps (the delete, only when asked)."""
  if action == "delete":
    return delete(job), []
  builders = {"create": [create], "setup": [setup], "run": [run],
              "all": [create, setup, run]}[action]
  steps = [step for build in builders for step in build(job)]
  return steps, delete(job) if tear_down else []


def parse(argv: Sequence[str]) -> tuple[TpuJob, argparse.Namespace]:
  """Parses the command line into a job and the remaining options."""
  p = argparse.ArgumentParser(prog="python -m launch.tpu",
                              description=__doc__.split("\n")[0])
  add = p.add_argument
  add("--action", choices=ACTIONS, default="all", help="all = create, setup, run")
  add("--name", default="osd-jax", help="TPU VM name")
  add("--zone", default="us-west4-a")
  add("--project", default="", help="default: gcloud's configured project")
  add("--accelerator_type", default="v5litepod-8", help="e.g. v5litepod-8, v4-32")
  add("--version", default="", help="TPU software version; default: by type")
  add("--output_dir", default="", help="gs://... or local; default: outputs/NAME")
  add("--command", default=DEFAULT_COMMAND, help="experiment command, run in the checkout")
  add("--spot", action="store_true", help="create a Spot VM")
  add("--preemptible", action="store_true", help="create a preemptible VM")
  add("--delete", action="store_true", help="delete the VM at the end, even on failure")
  add("--dry_run", action="store_true", help="print the commands, run nothing")
  a = p.parse_args(argv)
  if not _NAME.fullmatch(a.name):
    p.error(f"--name={a.name!r}: use lowercase letters, digits and '-'")
  job = TpuJob(name=a.name, zone=a.zone, project=a.project,
               accelerator_type=a.accelerator_type,
               version=a.version or default_version(a.accelerator_type),
               output_dir=a.output_dir or posixpath.join("outputs", a.name),
               command=a.command, spot=a.spot, preemptible=a.preemptible,
               tarball=os.path.join(tempfile.gettempdir(), f"{a.name}.tar.gz"))
  return job, a


def main(argv: Sequence[str] | None = None) -> int:
  """Prints or runs the plan; returns the process exit code."""
  job, args = parse(sys.argv[1:] if argv is None else argv)
  steps, cleanup = plan(job, args.action, args.delete)
  try:
    if not args.dry_run:
      shell.require("gcloud", "install the Google Cloud CLI"
                    " (https://cloud.google.com/sdk/docs/install) or pass --dry_run")
    shell.run_plan(steps, cleanup, dry_run=args.dry_run)
  except shell.LaunchError as e:
    print(f"launch.tpu: error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
