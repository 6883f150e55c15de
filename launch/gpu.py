"""Set up and run an experiment on one machine with several GPUs.

  python -m launch.gpu --action=all --output_dir=outputs/gpu   # on the GPU machine
  python -m launch.gpu --action=all --dry_run                  # print the commands only

Same entry points as the TPU launcher; one process drives all local GPUs, so the
launcher appends `--devices=all --output_dir=...` instead of `--multihost`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from launch import shell
from launch.shell import Step
from launch.tpu import CHECKOUT, DEFAULT_COMMAND

JAX_CUDA = "jax[cuda12]==0.10.2"
PYTHON = ".venv/bin/python"


def setup() -> list[Step]:
  """Creates .venv with the project, adds the CUDA wheels and lists the GPUs."""
  return [(["bash", "scripts/setup.sh"],),
          ([".venv/bin/pip", "install", JAX_CUDA],),
          ([PYTHON, "-c", "import jax; print(jax.devices())"],)]


def run(command: str, output_dir: str, devices: str) -> list[Step]:
  """The experiment command on the venv's python, with devices and output dir."""
  argv = shlex.split(command)
  if argv and argv[0] in ("python", "python3"):
    argv[0] = PYTHON
  if not output_dir.startswith("gs://"):
    return [(argv + [f"--devices={devices}", f"--output_dir={output_dir}"],)]
  # The experiments write local files: write here, then upload the folder.
  local = "outputs/" + output_dir.rstrip("/").rsplit("/", 1)[-1]
  return [(argv + [f"--devices={devices}", f"--output_dir={local}"],),
          (["gcloud", "storage", "cp", "-r", local, output_dir.rstrip("/")],)]


def parse(argv: Sequence[str]) -> argparse.Namespace:
  """Parses the command line."""
  p = argparse.ArgumentParser(prog="python -m launch.gpu",
                              description=__doc__.split("\n")[0])
  add = p.add_argument
  add("--action", choices=("setup", "run", "all"), default="all",
      help="all = setup, run")
  add("--output_dir", default="outputs/gpu", help="local directory or gs://...")
  add("--command", default=DEFAULT_COMMAND, help="experiment command, run in the checkout")
  add("--devices", default="all", help="passed to the experiment as --devices")
  add("--dry_run", action="store_true", help="print the commands, run nothing")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  """Prints or runs the plan in the checkout root; returns the exit code."""
  args = parse(sys.argv[1:] if argv is None else argv)
  steps = []
  if args.action in ("setup", "all"):
    steps += setup()
  if args.action in ("run", "all"):
    steps += run(args.command, args.output_dir, args.devices)
  if args.dry_run:
    print(shlex.join(["cd", CHECKOUT]))  # The steps use paths relative to it.
  try:
    shell.run_plan(steps, dry_run=args.dry_run, cwd=CHECKOUT)
  except shell.LaunchError as e:
    print(f"launch.gpu: error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
