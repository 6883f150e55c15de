"""Print or execute a launch plan: a list of steps, each a list of argv commands."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Sequence

Argv = list[str]
# A step is one or more alternatives, tried in order until one exits 0,
# exactly like `a || b` in a shell ("describe || create" reuses a TPU VM).
Step = tuple[Argv, ...]


class LaunchError(RuntimeError):
  """A launch step could not start or failed; the message is for the user."""


def render(step: Step) -> str:
  """The step as one copy-pastable shell line."""
  return " || ".join(shlex.join(argv) for argv in step)


def require(tool: str, hint: str) -> None:
  """Fail with a clear message when `tool` is not on PATH."""
  if shutil.which(tool) is None:
    raise LaunchError(f"{tool} not found on PATH; {hint}")


def _call(argv: Argv, cwd: str | None, quiet: bool) -> int:
  print("+", shlex.join(argv), flush=True)
  try:
    return subprocess.run(argv, cwd=cwd, capture_output=quiet).returncode
  except FileNotFoundError:
    raise LaunchError(f"{argv[0]} not found on PATH") from None


def execute(step: Step, cwd: str | None = None) -> None:
  """Run the step's alternatives until one succeeds; the last one must."""
  *fallible, last = step
  for argv in fallible:
    # Only the last alternative's failure is an error, so hide earlier output.
    if _call(argv, cwd, quiet=True) == 0:
      print("  (succeeded; alternatives skipped)", flush=True)
      return
  if (rc := _call(last, cwd, quiet=False)) != 0:
    raise LaunchError(f"exit code {rc} from: {shlex.join(last)}")


def run_plan(steps: Sequence[Step], cleanup: Sequence[Step] = (),
             dry_run: bool = False, cwd: str | None = None) -> None:
  """Print (dry run) or execute `steps`; `cleanup` runs even if a step fails."""
  if dry_run:
    for step in (*steps, *cleanup):
      print(render(step))
    return
  try:
    for step in steps:
      execute(step, cwd)
  finally:
    for step in cleanup:
      execute(step, cwd)
