"""Every `python -m experiments...` line in README's code blocks (and in the
entry points' usage docstrings) parses with the flags its entry point defines, so a renamed or retyped flag fails here.
Nothing runs: each entry point starts (in its own process, as flags are
process-wide) and parses each of its command lines instead of running."""

import ast
import collections
import glob
import json
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs the entry point as `python -m` does, its cli.run(main) replaced by
# parsing each line: flags defined under `if __name__ == "__main__"` count.
_PARSE = """
import json, runpy, sys
from absl import flags
from experiments import cli
module, lines = sys.argv[1], json.loads(sys.argv[2])
errors = []

def parse_only(main):
  for argv in lines:
    flags.FLAGS.unparse_flags()
    try:
      flags.FLAGS([module] + argv)
      errors.append(None)
    except flags.Error as e:
      errors.append(str(e))

cli.run = parse_only
runpy.run_module(module, run_name="__main__", alter_sys=True)
print(json.dumps(errors))
"""


def readme_commands(text: str) -> list[tuple[str, list[str]]]:
  """(module, flags) of each `-m experiments.X` line in the fenced blocks."""
  commands = []
  for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
    for line in block.replace("\\\n", " ").splitlines():
      if "-m experiments." not in line:
        continue
      words = shlex.split(line, comments=True)
      if "-m" in words and re.fullmatch(r"experiments(\.\w+)+",
                                        words[words.index("-m") + 1]):
        at = words.index("-m") + 1
        commands.append((words[at], words[at + 1:]))
  return commands


def parse_errors(commands: list[tuple[str, list[str]]]) -> dict[tuple, str | None]:
  """{(module, flags): None or the flag parser's error}, one process per module."""
  by_module = collections.defaultdict(list)
  for module, argv in commands:
    by_module[module].append(argv)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  running = {module: subprocess.Popen(
      [sys.executable, "-c", _PARSE, module, json.dumps(lines)], cwd=ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for module, lines in by_module.items()}
  out = {}
  for module, process in running.items():
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, f"{module} did not import:\n{stderr[-3000:]}"
    errors = json.loads(stdout.strip().splitlines()[-1])
    for argv, error in zip(by_module[module], errors):
      out[(module, tuple(argv))] = error
  return out


def docstring_commands() -> list[tuple[str, list[str]]]:
  """The same, from the usage lines in the entry points' docstrings."""
  commands = []
  for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "**", "*.py"),
                               recursive=True)):
    with open(path) as f:
      doc = ast.get_docstring(ast.parse(f.read())) or ""
    commands += readme_commands(f"```\n{doc}\n```\n")
  return commands


def test_every_readme_and_usage_command_line_parses():
  with open(os.path.join(ROOT, "README.md")) as f:
    commands = readme_commands(f.read()) + docstring_commands()
  modules = {module for module, _ in commands}
  assert {"experiments.generate", "experiments.online", "experiments.serve"} <= modules
  # Two stand-ins that must fail, so a parser that accepts anything fails here.
  renamed = ("experiments.serve", ["--cache-size=1024"])
  out_of_range = ("experiments.serve", ["--top_p=0"])
  errors = parse_errors(commands + [renamed, out_of_range])
  assert errors.pop((renamed[0], tuple(renamed[1])))
  assert "above 0" in errors.pop((out_of_range[0], tuple(out_of_range[1])))
  failed = {f"{module} {' '.join(argv)}": error for (module, argv), error in errors.items()
            if error}
  assert not failed, failed


def test_lines_are_read_as_a_shell_reads_them():
  text = ("```\nPYTHONPATH=. .venv/bin/python -m experiments.serve --port=8000 \\\n"
          "    --prompt=\"Write a haiku\"   # a comment\nmake test\n```\n"
          "python -m experiments.online --outside_a_block\n")
  assert readme_commands(text) == [("experiments.serve",
                                    ["--port=8000", "--prompt=Write a haiku"])]
