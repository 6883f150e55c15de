"""How every entry point starts: `cli.run(main)` in place of `absl.app.run(main)`.

- Quiet by default: the run's own lines, warnings and summary. absl's
  `-v 0` / `--verbosity=0` brings the libraries' INFO logs back (orbax,
  tensorflow-datasets, ...).
- A user error (a bad path, file or setting) ends in one line,
  `error: <message>`, and exit status 1; a bug keeps its traceback.
"""

import logging
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterable
from typing import NoReturn

from absl import app, flags

import experiments
import osd_jax
from osd_jax.errors import UserError

# absl's own logger is quieted through --verbosity; these log through Python's
# logging and would otherwise follow whatever level the root logger has.
_LIBRARY_LOGGERS = ("orbax", "tensorflow_datasets", "array_record", "etils",
                    "jax", "flax", "transformers", "matplotlib")
_HELP = "--helpshort lists the flags"
_PROJECT_DIRS = tuple(os.path.dirname(package.__file__) + os.sep
                      for package in (osd_jax, experiments))


def run(main: Callable[[list[str]], object]) -> None:
  """Parses flags, quiets the libraries unless -v was given, and runs `main`."""
  app.run(_reporting_user_errors(main), flags_parser=_parse_quietly)


def _parse_quietly(argv: list[str]) -> list[str]:
  """absl's flag parsing, then WARNING as the log level unless -v was given."""
  try:
    args = flags.FLAGS(argv)
  except flags.Error as error:  # absl's own parser prints two lines here
    _exit(f"{error} ({_HELP})", 1)
  if flags.FLAGS["verbosity"].using_default_value:
    # absl's own default: app.run would raise it to INFO after parsing,
    # which is what floods the output with orbax and tfds INFO lines.
    flags.FLAGS.verbosity = -1  # WARNING
    for name in _LIBRARY_LOGGERS:
      if name not in flags.FLAGS.logger_levels:  # the user's choice wins
        logging.getLogger(name).setLevel(logging.WARNING)
    # transformers announces on import that torch is absent; osd-jax never
    # needs torch. The project imports transformers only after this point.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  return args


def _reporting_user_errors(main: Callable[[list[str]], object]):
  """`main`, with user errors printed on one line instead of a traceback."""

  def guarded(argv: list[str]) -> object:
    try:
      return main(argv)
    except app.UsageError as error:
      _exit(f"{error} ({_HELP})", error.exitcode)
    except Exception as error:  # pylint: disable=broad-except
      if not is_user_error(error):
        raise
      _exit(str(error), 1)
  return guarded


def is_user_error(error: BaseException) -> bool:
  """True for a UserError, or a ValueError that osd-jax's own checks raised.

  The library rejects bad input with UserError (CheckpointError,
  ManualDataError) or, in older code, ValueError. A ValueError counts only
  where a `raise` statement in osd_jax/ or experiments/ threw it. One thrown
  inside a dependency (jax's shape checks, numpy) or by Python itself in our
  code (a failed unpacking) means a bug, and keeps its traceback.
  """
  if isinstance(error, UserError):
    return True
  if not isinstance(error, ValueError) or error.__traceback__ is None:
    return False
  where = traceback.extract_tb(error.__traceback__)[-1]
  return (where.filename.startswith(_PROJECT_DIRS)
          and (where.line or "").startswith("raise"))


def refuse_unread(module: types.ModuleType, reads: Iterable[str], why: str) -> None:
  """Ends the run with a usage error if the command line set a flag of
  `module` (a flag module shared by several entry points) that is not in
  `reads`, the ones this entry point uses: a flag is never accepted and
  ignored. Call it first thing in `main`."""
  reads = set(reads)
  given = sorted(flag.name for flag in flags.FLAGS.get_flags_for_module(module.__name__)
                 if not flag.using_default_value and flag.name not in reads)
  if given:
    names = ", ".join("--" + name for name in given)
    verb = "has" if len(given) == 1 else "have"
    raise app.UsageError(f"{names} {verb} no effect here: {why}")


def require_positive_ints(*list_flags: flags.FlagHolder) -> None:
  """Validates list flags whose items are whole numbers >= 1 (batch sizes,
  values of k, ...): a typo ends in one line, not a traceback mid-run."""
  for holder in list_flags:
    flags.register_validator(
        holder, lambda items: all(i.isdigit() and int(i) >= 1 for i in items),
        f"--{holder.name} takes positive integers.")


def device_count(value: str) -> int | None:
  """A --devices value: None for 'all', else a count of at least 1."""
  if value == "all":
    return None
  if not value.isdigit() or int(value) < 1:
    raise app.UsageError(f"--devices is 'all' or a number of devices, got {value!r}.")
  return int(value)


def _exit(message: str, status: int) -> NoReturn:
  print("error: " + " ".join(message.split()), file=sys.stderr)
  sys.exit(status)
