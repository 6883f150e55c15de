"""Named sources of examples for streams: the builders, the manual sets, or your own lists."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from osd_jax.data import common

if (
    TYPE_CHECKING
):  # The builders import tensorflow-datasets; streams over your own lists need not.
  from osd_jax.data.builder import QueryBuilder

# A source maps a split name ("train" or "eval") to that split's examples.
Source = Callable[[str], Sequence[common.Example]]

BUILTIN_NAMES = ("chat", "math", "code", "sql")
MANUAL_NAMES = (
    "spider",
    "gsm8k",
    "code_search_net_python",
    "finance_alpaca",
    "lmsys_chat",
)
# Domains that only a manual set provides.
ALIASES = {"finance": "finance_alpaca"}


def builder_class(name: str) -> type["QueryBuilder"]:
  """The builder class behind a source name; imported only when asked for."""
  # pylint: disable=import-outside-toplevel
  name = ALIASES.get(name, name)
  if name == "chat":
    from osd_jax.data.chat import ShareGptChat

    return ShareGptChat
  if name == "math":
    from osd_jax.data.math import GsmSymbolicMath

    return GsmSymbolicMath
  if name == "code":
    from osd_jax.data.code import PythonCode

    return PythonCode
  if name == "sql":
    from osd_jax.data.sql import SqliteText2Sql

    return SqliteText2Sql
  if name in MANUAL_NAMES:
    from osd_jax.data.manual_builders import MANUAL_BUILDERS

    return MANUAL_BUILDERS[name]
  raise ValueError(f"Unknown source {name!r}; known: {', '.join(source_names())}")


def source_names() -> tuple[str, ...]:
  """Every name `default_sources` knows."""
  return BUILTIN_NAMES + MANUAL_NAMES + tuple(ALIASES)


def builder_source(builder: "type[QueryBuilder] | str", **builder_kwargs) -> Source:
  """A source that prepares `builder(**builder_kwargs)` on first use and reads a split.

  `builder` is a builder class or a source name; a name is resolved only when
  read, so listing the default sources imports no builder.
  """
  cache: dict[str, list[common.Example]] = {}

  def read(split: str) -> list[common.Example]:
    from osd_jax.data.builder import read_split  # pylint: disable=import-outside-toplevel

    if split not in cache:
      cls = builder_class(builder) if isinstance(builder, str) else builder
      cache[split] = read_split(cls(**builder_kwargs), split)
    return cache[split]

  return read


def examples_source(splits: Mapping[str, Sequence[common.Example]]) -> Source:
  """A source over examples already in memory, e.g. {"train": [...], "eval": [...]}."""
  missing = [
      e for examples in splits.values() for e in examples if set(common.FIELDS) - set(e)
  ]
  if missing:
    raise ValueError(
        f"Examples need the fields {common.FIELDS}; this one lacks some: {missing[0]}"
    )
  return lambda split: list(splits[split])


def default_sources(
    *,
    data_dir: str | os.PathLike | None = None,
    manual_dir: str | os.PathLike | None = None,
    pool_size: int | None = None,
    seed: int = 0,
) -> dict[str, Source]:
  """A source per known name; `pool_size` caps each split (None: each builder's default)."""
  sources = {}
  for name in source_names():
    kwargs = {
        "data_dir": data_dir,
        "num_train": pool_size,
        "num_eval": pool_size,
        "seed": seed,
    }
    if ALIASES.get(name, name) in MANUAL_NAMES:
      kwargs["manual_dir"] = manual_dir
    sources[name] = builder_source(name, **kwargs)
  return sources
