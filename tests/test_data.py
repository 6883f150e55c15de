"""Built-in query data sets: fields, sizes, disjoint splits, SQL gold queries, language labels."""

from __future__ import annotations

import json
import pathlib

import pytest

from osd_jax import data
from osd_jax.data import common, sql_schemas

SMALL_TRAIN, SMALL_EVAL = 12, 4


# --- Built-in builders -----------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def prepared(data_dir) -> dict[str, dict[str, list[common.Example]]]:
  """Each built-in builder prepared once at a small size, both splits read back."""
  from osd_jax.data.builder import read_split

  out = {}
  for name in data.sources.BUILTIN_NAMES:
    builder = data.builder_class(name)(
        num_train=SMALL_TRAIN, num_eval=SMALL_EVAL, data_dir=data_dir
    )
    out[name] = {
        split: read_split(builder, split) for split in (common.TRAIN, common.EVAL)
    }
  return out


@pytest.mark.parametrize("name", ["chat", "math", "code", "sql"])
def test_builder_fields_and_counts(prepared, name):
  splits = prepared[name]
  assert len(splits["train"]) == SMALL_TRAIN and len(splits["eval"]) == SMALL_EVAL
  for example in splits["train"] + splits["eval"]:
    assert set(example) == set(common.FIELDS)
    assert all(isinstance(v, str) for v in example.values())
    assert example["prompt"].strip() and example["id"]
    assert example["domain"] == name
    assert example["language"] == "unknown" or 2 <= len(example["language"]) <= 3


@pytest.mark.parametrize("name", ["chat", "math", "code", "sql"])
def test_builder_splits_are_disjoint(prepared, name):
  train, eval_ = prepared[name]["train"], prepared[name]["eval"]
  assert not {e["id"] for e in train} & {e["id"] for e in eval_}
  assert not {e["prompt"] for e in train} & {e["prompt"] for e in eval_}
  # The split is a function of the prompt text alone.
  assert all(common.is_eval(e["prompt"], 10) for e in eval_)
  assert not any(common.is_eval(e["prompt"], 10) for e in train)


def test_code_mixes_humaneval_and_stdlib(prepared):
  sources = {e["source"] for split in prepared["code"].values() for e in split}
  assert sources == {"humaneval", "stdlib"}


def test_builder_is_deterministic_and_seeded(tmp_path, prepared):
  from osd_jax.data.builder import read_split
  from osd_jax.data.sql import SqliteText2Sql

  again = read_split(
      SqliteText2Sql(num_train=SMALL_TRAIN, num_eval=SMALL_EVAL, data_dir=tmp_path),
      "train",
  )
  assert sorted(e["id"] for e in again) == sorted(
      e["id"] for e in prepared["sql"]["train"]
  )
  reseeded = SqliteText2Sql(
      num_train=SMALL_TRAIN, num_eval=SMALL_EVAL, seed=1, data_dir=tmp_path
  )
  other = read_split(reseeded, "train")
  assert {e["prompt"] for e in other} != {e["prompt"] for e in again}


def test_sql_gold_queries_execute():
  from osd_jax.data import sql

  schemas = {s.name: s for s in sql_schemas.default_schemas()}
  connections = {
      n: sql_schemas.create_database(s, sql_schemas.generate_rows(s, 0))
      for n, s in schemas.items()
  }
  examples = list(sql.sql_examples(600, seed=0))
  assert len(examples) == 600  # Every template fits every schema.
  non_empty = 0
  for example in examples:
    schema_name = example["source"].split(":", 1)[1]
    assert schema_name in schemas and schemas[schema_name].ddl() in example["prompt"]
    result = sql.run_gold(connections[schema_name], example["answer"])
    non_empty += bool(result) and result != [(None,)]
  assert non_empty >= 0.9 * len(
      examples
  )  # Filter values come from the rows, so most select something.


def test_sql_builder_answers_run_on_their_schema(prepared):
  schemas = {s.name: s for s in sql_schemas.default_schemas()}
  for example in prepared["sql"]["train"] + prepared["sql"]["eval"]:
    schema = schemas[example["source"].split(":", 1)[1]]
    with sql_schemas.create_database(
        schema, sql_schemas.generate_rows(schema, 0)
    ) as connection:
      connection.execute(example["answer"]).fetchall()


def test_chat_reader_survives_a_truncated_file():
  from osd_jax.data.chat import first_user_turns, read_sharegpt_records

  text = json.dumps(
      [
          {
              "id": "a_0",
              "conversations": [
                  {"from": "human", "value": "What is JAX?"},
                  {"from": "gpt", "value": "A library."},
              ],
          },
          {"id": "b_0", "conversations": [{"from": "gpt", "value": "Hello"}]},
          {
              "id": "c_0",
              "conversations": [
                  {"from": "human", "value": "这个函数是做什么的？请解释一下"}
              ],
          },
      ],
      ensure_ascii=False,
  )
  records = read_sharegpt_records(
      text[:-40]
  )  # Cut inside the last record, as the package file is.
  assert [r["id"] for r in records] == ["a_0", "b_0"]
  examples = list(first_user_turns(read_sharegpt_records(text)))
  assert [(e["prompt"], e["language"], e["answer"]) for e in examples] == [
      ("What is JAX?", "en", "A library."),
      ("这个函数是做什么的？请解释一下", "zh", ""),
  ]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("How do I reverse a list in Python?", "en"),
        ("¿Cómo puedo mejorar mi currículum para una entrevista de trabajo?", "es"),
        (
            "Peux-tu m'expliquer comment fonctionne la photosynthèse dans les plantes ?",
            "fr",
        ),
        (
            "Wie kann ich die Leistung meiner Datenbank verbessern und was ist ein Index?",
            "de",
        ),
        ("请帮我写一封求职信", "zh"),
        ("このコードのバグを見つけてください", "ja"),
        ("이 코드에서 무엇이 잘못되었나요?", "ko"),
        ("Как работает градиентный спуск?", "ru"),
        ("x = np.zeros((3, 4)); y = x @ x.T", "unknown"),
        ("Hi", "unknown"),
    ],
)
def test_detect_language(text, expected):
  assert data.detect_language(text) == expected


def test_language_code():
  assert data.language_code("English") == "en"
  assert data.language_code("Portuguese") == "pt"
  assert data.language_code("zh") == "zh"
  assert (
      data.language_code("Klingon") == "unknown"
      and data.language_code(None) == "unknown"
  )
