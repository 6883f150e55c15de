"""The paper's own data sets, read from files a user places in a manual directory.

Layout under the manual directory (argument `manual_dir`, else
$OSD_JAX_MANUAL_DIR, else ~/.cache/osd_jax/manual):

  spider/                  train_spider.json, dev.json [, tables.json]
  gsm8k/                   train.jsonl, test.jsonl
  code_search_net_python/  python_train_*.jsonl[.gz], python_test_*.jsonl[.gz] (any depth)
  finance_alpaca/          Cleaned_date.json
  lmsys_chat/              *.parquet or *.jsonl[.gz] (any depth)

Each loader returns examples per split ("train", "eval"), or under "all"
when the published set has one split; the builders then split those by hash.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pathlib
from typing import Callable, Iterator

from osd_jax.data import common
from osd_jax.data.language import language_code
from osd_jax.data.sql_schemas import format_prompt as sql_prompt
from osd_jax.errors import UserError

Splits = dict[str, Iterator[common.Example]]


class ManualDataError(UserError, FileNotFoundError):
  """A manual data file is missing; the message says which file goes where."""


@dataclasses.dataclass(frozen=True)
class ManualSpec:
  """How to find and read one manually placed data set."""

  name: str  # Also the sub-folder of the manual directory.
  domain: str
  instructions: str  # Where to get the files; {folder} is filled in.
  load: Callable[[pathlib.Path], Splits]


def _missing(spec_name: str, folder: pathlib.Path, what: str) -> ManualDataError:
  spec = SPECS[spec_name]
  return ManualDataError(
      f"{spec_name}: {what} not found in {folder}.\n"
      + spec.instructions.format(folder=folder)
      + f"\nThe manual directory is the `manual_dir` argument or ${common.MANUAL_DIR_ENV}"
      f" (default {common.default_manual_dir()}); {spec_name} files go in its '{spec_name}/' folder."
  )


def _require(
    spec_name: str, folder: pathlib.Path, names: tuple[str, ...]
) -> list[pathlib.Path]:
  """The named files in `folder`, or an error naming the first one missing."""
  for name in names:
    if not (folder / name).is_file():
      raise _missing(spec_name, folder, name)
  return [folder / name for name in names]


def _glob(
    spec_name: str, folder: pathlib.Path, patterns: tuple[str, ...], what: str
) -> list[pathlib.Path]:
  """Files under `folder` (any depth) matching one of `patterns`, sorted; an error if none."""
  found = sorted(
      {p for pattern in patterns for p in folder.rglob(pattern) if p.is_file()}
  )
  if not found:
    raise _missing(spec_name, folder, f"{what} (searched at any depth)")
  return found


def _read_jsonl(path: pathlib.Path) -> Iterator[dict]:
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", encoding="utf-8") as f:
    for line in f:
      if line.strip():
        yield json.loads(line)


def _read_json(path: pathlib.Path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# --- Spider ---------------------------------------------------------------


def spider_schemas(tables_json: pathlib.Path) -> dict[str, str]:
  """CREATE TABLE text per db_id, from Spider's tables.json."""
  schemas = {}
  for db in _read_json(tables_json):
    columns: dict[int, list[str]] = {
        i: [] for i in range(len(db["table_names_original"]))
    }
    for (table, column), kind in zip(db["column_names_original"], db["column_types"]):
      if table >= 0:  # Entry -1 is Spider's "*" pseudo-column.
        columns[table].append(f"{column} {kind}")
    schemas[db["db_id"]] = "\n".join(
        f"CREATE TABLE {name} ({', '.join(columns[i])});"
        for i, name in enumerate(db["table_names_original"])
    )
  return schemas


def _spider_examples(
    path: pathlib.Path, split: str, schemas: dict[str, str]
) -> Iterator[common.Example]:
  for index, item in enumerate(_read_json(path)):
    schema = schemas.get(item["db_id"], f"-- database: {item['db_id']}")
    yield common.make_example(
        id=f"spider-{split}-{index}",
        prompt=sql_prompt(schema, item["question"]),
        domain="sql",
        language="en",
        answer=item["query"],
        source=f"spider:{item['db_id']}",
    )


def load_spider(folder: pathlib.Path) -> Splits:
  """Spider train_spider.json -> train, dev.json -> eval; tables.json adds schemas to prompts."""
  train, dev = _require("spider", folder, ("train_spider.json", "dev.json"))
  tables = folder / "tables.json"
  schemas = spider_schemas(tables) if tables.is_file() else {}
  return {
      common.TRAIN: _spider_examples(train, "train", schemas),
      common.EVAL: _spider_examples(dev, "dev", schemas),
  }


# --- GSM8K ----------------------------------------------------------------


def _gsm8k_examples(path: pathlib.Path, split: str) -> Iterator[common.Example]:
  for index, item in enumerate(_read_jsonl(path)):
    yield common.make_example(
        id=f"gsm8k-{split}-{index}",
        prompt=item["question"].strip(),
        domain="math",
        language="en",
        answer=item["answer"],
        source="gsm8k",
    )


def load_gsm8k(folder: pathlib.Path) -> Splits:
  """GSM8K train.jsonl -> train, test.jsonl -> eval (fields "question", "answer")."""
  train, test = _require("gsm8k", folder, ("train.jsonl", "test.jsonl"))
  return {
      common.TRAIN: _gsm8k_examples(train, "train"),
      common.EVAL: _gsm8k_examples(test, "test"),
  }


# --- CodeSearchNet Python -------------------------------------------------


def _csn_examples(paths: list[pathlib.Path]) -> Iterator[common.Example]:
  for path in paths:
    for index, item in enumerate(_read_jsonl(path)):
      docstring = (item.get("docstring") or "").strip()
      if not docstring:
        continue
      name = item.get("func_name", "")
      yield common.make_example(
          id=f"csn-{path.name.split('.')[0]}-{index}",
          prompt=f"Write a Python function `{name}` that does the following:\n\n{docstring}",
          domain="code",
          language="en",
          answer=item.get("code") or item.get("original_string", ""),
          source=f"code_search_net:{item.get('repo', '')}",
      )


def load_code_search_net(folder: pathlib.Path) -> Splits:
  """CodeSearchNet python_train_*.jsonl[.gz] -> train, python_test_*.jsonl[.gz] -> eval."""
  train = _glob(
      "code_search_net_python",
      folder,
      ("python_train_*.jsonl", "python_train_*.jsonl.gz"),
      "python_train_*.jsonl.gz",
  )
  test = _glob(
      "code_search_net_python",
      folder,
      ("python_test_*.jsonl", "python_test_*.jsonl.gz"),
      "python_test_*.jsonl.gz",
  )
  return {common.TRAIN: _csn_examples(train), common.EVAL: _csn_examples(test)}


# --- Alpaca finance ------------------------------------------------------


def load_finance_alpaca(folder: pathlib.Path) -> Splits:
  """gbharti/finance-alpaca Cleaned_date.json: a list of {instruction, input, output}."""
  (path,) = _require("finance_alpaca", folder, ("Cleaned_date.json",))

  def examples() -> Iterator[common.Example]:
    for index, item in enumerate(_read_json(path)):
      extra = (item.get("input") or "").strip()
      prompt = item["instruction"].strip() + (f"\n\n{extra}" if extra else "")
      yield common.make_example(
          id=f"finance_alpaca-{index}",
          prompt=prompt,
          domain="finance",
          language="en",
          answer=item.get("output", ""),
          source="finance_alpaca",
      )

  return {common.ALL: examples()}


# --- LMSYS-Chat-1M --------------------------------------------------------


def _lmsys_records(path: pathlib.Path) -> Iterator[dict]:
  if path.suffix != ".parquet":
    yield from _read_jsonl(path)
    return
  try:
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(
        f"Reading {path} needs pyarrow (pip install pyarrow); or convert the parquet files to "
        'jsonl with one {"conversation": [...], "language": ...} object per line.'
    ) from error
  for batch in pq.ParquetFile(path).iter_batches(
      columns=["conversation_id", "conversation", "language"]
  ):
    yield from batch.to_pylist()


def load_lmsys_chat(folder: pathlib.Path) -> Splits:
  """LMSYS-Chat-1M parquet or jsonl: first user turn, with its "language" field as an ISO code."""
  paths = _glob(
      "lmsys_chat",
      folder,
      ("*.parquet", "*.jsonl", "*.jsonl.gz"),
      "*.parquet or *.jsonl",
  )

  def examples() -> Iterator[common.Example]:
    for path in paths:
      for index, item in enumerate(_lmsys_records(path)):
        turns = item.get("conversation") or []
        if not turns or turns[0].get("role") != "user":
          continue
        reply = turns[1].get("content", "") if len(turns) > 1 else ""
        yield common.make_example(
            id=str(item.get("conversation_id") or f"lmsys-{path.name}-{index}"),
            prompt=(turns[0].get("content") or "").strip(),
            domain="chat",
            language=language_code(item.get("language")),
            answer=reply or "",
            source="lmsys_chat",
        )

  return {common.ALL: examples()}


SPECS: dict[str, ManualSpec] = {
    spec.name: spec
    for spec in (
        ManualSpec(
            "spider",
            "sql",
            (
                "Download Spider from https://yale-lily.github.io/spider (spider.zip), unzip it, and copy "
                "train_spider.json and dev.json (and tables.json, to show each database's schema in the "
                "prompt) into {folder}/."
            ),
            load_spider,
        ),
        ManualSpec(
            "gsm8k",
            "math",
            (
                "Copy train.jsonl and test.jsonl from https://github.com/openai/grade-school-math "
                "(grade_school_math/data/) into {folder}/."
            ),
            load_gsm8k,
        ),
        ManualSpec(
            "code_search_net_python",
            "code",
            (
                "Download python.zip of CodeSearchNet (https://github.com/github/CodeSearchNet) and unzip it "
                "into {folder}/, so that files like python/final/jsonl/train/python_train_0.jsonl.gz and "
                "python/final/jsonl/test/python_test_0.jsonl.gz lie under it."
            ),
            load_code_search_net,
        ),
        ManualSpec(
            "finance_alpaca",
            "finance",
            (
                "Download Cleaned_date.json from https://huggingface.co/datasets/gbharti/finance-alpaca "
                "and put it at {folder}/Cleaned_date.json."
            ),
            load_finance_alpaca,
        ),
        ManualSpec(
            "lmsys_chat",
            "chat",
            (
                "Download the parquet files of https://huggingface.co/datasets/lmsys/lmsys-chat-1m "
                "(data/train-*.parquet; or the same records as .jsonl) into {folder}/."
            ),
            load_lmsys_chat,
        ),
    )
}


def load_manual(name: str, manual_dir: str | os.PathLike | None = None) -> Splits:
  """Examples per split of a manually placed data set; a clear error when its files are missing."""
  if name not in SPECS:
    raise ValueError(f"Unknown manual data set {name!r}; known: {', '.join(SPECS)}")
  folder = pathlib.Path(manual_dir or common.default_manual_dir()).expanduser() / name
  return SPECS[name].load(folder)
