"""The paper's data sets from a manual directory: tiny files in each published format."""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from osd_jax import data
from osd_jax.data import common, manual


def _write_jsonl(path: pathlib.Path, records: list[dict]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
  if path.suffix == ".gz":
    with gzip.open(path, "wt", encoding="utf-8") as f:
      f.write(lines)
  else:
    path.write_text(lines, encoding="utf-8")


def _write_json(path: pathlib.Path, value) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")


def _write_spider(folder: pathlib.Path) -> None:
  def item(question: str, db: str, query: str) -> dict:
    # Spider records carry more fields (query_toks, sql, ...); loaders must ignore them.
    return {
        "db_id": db,
        "query": query,
        "question": question,
        "query_toks": query.split(),
        "sql": {},
    }

  _write_json(
      folder / "train_spider.json",
      [
          item(
              "How many heads of the departments are older than 56 ?",
              "department_management",
              "SELECT count(*) FROM head WHERE age > 56",
          ),
          item(
              "List the name of all singers.",
              "concert_singer",
              "SELECT name FROM singer",
          ),
          item(
              "How many singers are there?",
              "concert_singer",
              "SELECT count(*) FROM singer",
          ),
      ],
  )
  _write_json(
      folder / "dev.json",
      [
          item(
              "What is the average age of all singers?",
              "concert_singer",
              "SELECT avg(age) FROM singer",
          ),
      ],
  )
  _write_json(
      folder / "tables.json",
      [
          {
              "db_id": "concert_singer",
              "table_names_original": ["singer"],
              "table_names": ["singer"],
              "column_names_original": [
                  [-1, "*"],
                  [0, "Singer_ID"],
                  [0, "Name"],
                  [0, "Age"],
              ],
              "column_names": [[-1, "*"], [0, "singer id"], [0, "name"], [0, "age"]],
              "column_types": ["text", "number", "text", "number"],
              "primary_keys": [1],
              "foreign_keys": [],
          }
      ],
  )


def _write_gsm8k(folder: pathlib.Path) -> None:
  _write_jsonl(
      folder / "train.jsonl",
      [
          {
              "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
              "clips in May. How many clips did Natalia sell altogether in April and May?",
              "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
          },
          {
              "question": "Weng earns $12 an hour for babysitting. How much did she earn for 50 minutes?",
              "answer": "12/60*50 = <<12/60*50=10>>10\n#### 10",
          },
      ],
  )
  _write_jsonl(
      folder / "test.jsonl",
      [
          {
              "question": "Janet's ducks lay 16 eggs per day. She eats three. How many are left?",
              "answer": "16 - 3 = <<16-3=13>>13\n#### 13",
          },
      ],
  )


def _csn(func_name: str, docstring: str, partition: str) -> dict:
  code = f'def {func_name}(x):\n    """{docstring}"""\n    return x\n'
  return {
      "repo": "owner/repo",
      "path": "pkg/mod.py",
      "func_name": func_name,
      "original_string": code,
      "language": "python",
      "code": code,
      "code_tokens": code.split(),
      "docstring": docstring,
      "docstring_tokens": docstring.split(),
      "sha": "0" * 40,
      "url": "https://github.com/owner/repo/blob/0/pkg/mod.py#L1-L3",
      "partition": partition,
  }


def _write_csn(folder: pathlib.Path) -> None:
  root = folder / "python" / "final" / "jsonl"
  _write_jsonl(
      root / "train" / "python_train_0.jsonl.gz",
      [
          _csn("identity", "Return the argument unchanged.", "train"),
          _csn("no_doc", "", "train"),  # No docstring: no prompt to make.
          _csn("same", "Return x as it is.", "train"),
      ],
  )
  _write_jsonl(
      root / "test" / "python_test_0.jsonl.gz",
      [_csn("echo", "Echo the input back.", "test")],
  )


def _write_finance(folder: pathlib.Path) -> None:
  records = [
      {"instruction": f"What is a {term}?", "input": "", "output": f"A {term} is ..."}
      for term in (
          "bond",
          "stock",
          "dividend",
          "mutual fund",
          "hedge fund",
          "ETF",
          "option",
          "future",
          "swap",
          "index fund",
          "annuity",
          "REIT",
          "yield curve",
          "margin call",
          "short sale",
          "balance sheet",
          "cash flow",
          "credit score",
          "mortgage",
          "401(k)",
      )
  ]
  records.append(
      {
          "instruction": "Summarise this news.",
          "input": "Rates rose by 0.25%.",
          "output": "Rates up.",
      }
  )
  _write_json(folder / "Cleaned_date.json", records)


def _lmsys_record(index: int, text: str, language: str) -> dict:
  return {
      "conversation_id": f"conv{index}",
      "model": "vicuna-13b",
      "turn": 1,
      "language": language,
      "conversation": [
          {"content": text, "role": "user"},
          {"content": "Sure.", "role": "assistant"},
      ],
      "openai_moderation": [],
      "redacted": False,
  }


LMSYS_TEXTS = [
    ("What is the capital of France?", "English"),
    ("你好，请介绍一下你自己", "Chinese"),
    ("¿Qué es la fotosíntesis?", "Spanish"),
    ("Write a haiku about rain.", "English"),
    ("Explique la relativité.", "French"),
    ("Tell me a joke.", "English"),
]


def _write_lmsys(folder: pathlib.Path) -> None:
  records = [
      _lmsys_record(i, text, language) for i, (text, language) in enumerate(LMSYS_TEXTS)
  ]
  _write_jsonl(folder / "part0.jsonl", records[:3])
  import pyarrow as pa
  import pyarrow.parquet as pq

  folder.joinpath("data").mkdir(parents=True, exist_ok=True)
  pq.write_table(
      pa.Table.from_pylist(records[3:]),
      folder / "data" / "train-00000-of-00001.parquet",
  )


WRITERS = {
    "spider": _write_spider,
    "gsm8k": _write_gsm8k,
    "code_search_net_python": _write_csn,
    "finance_alpaca": _write_finance,
    "lmsys_chat": _write_lmsys,
}
DOMAINS = {
    "spider": "sql",
    "gsm8k": "math",
    "code_search_net_python": "code",
    "finance_alpaca": "finance",
    "lmsys_chat": "chat",
}


@pytest.fixture(scope="module")
def manual_dir(tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("manual")
  for name, write in WRITERS.items():
    write(root / name)
  return root


def _all(splits: manual.Splits) -> dict[str, list[common.Example]]:
  return {split: list(examples) for split, examples in splits.items()}


def test_spider_loader(manual_dir):
  splits = _all(data.load_manual("spider", manual_dir))
  assert [len(splits["train"]), len(splits["eval"])] == [3, 1]
  first = splits["train"][0]
  assert first["answer"] == "SELECT count(*) FROM head WHERE age > 56"
  assert first["domain"] == "sql" and first["source"] == "spider:department_management"
  # tables.json provides the schema of concert_singer; the other database is only named.
  assert (
      "CREATE TABLE singer (Singer_ID number, Name text, Age number);"
      in splits["eval"][0]["prompt"]
  )
  assert "What is the average age of all singers?" in splits["eval"][0]["prompt"]


def test_gsm8k_loader(manual_dir):
  splits = _all(data.load_manual("gsm8k", manual_dir))
  assert [len(splits["train"]), len(splits["eval"])] == [2, 1]
  assert splits["train"][0]["answer"].endswith("#### 72")
  assert splits["eval"][0]["prompt"].startswith("Janet's ducks")


def test_code_search_net_loader(manual_dir):
  splits = _all(data.load_manual("code_search_net_python", manual_dir))
  assert [e["id"].split("-")[1] for e in splits["train"]] == [
      "python_train_0",
      "python_train_0",
  ]
  prompt = splits["train"][0]["prompt"]
  assert "`identity`" in prompt and "Return the argument unchanged." in prompt
  assert splits["train"][0]["answer"].startswith("def identity(x):")
  assert len(splits["eval"]) == 1 and splits["eval"][0]["domain"] == "code"


def test_finance_alpaca_loader(manual_dir):
  examples = list(data.load_manual("finance_alpaca", manual_dir)[common.ALL])
  assert len(examples) == 21 and {e["domain"] for e in examples} == {"finance"}
  assert examples[-1]["prompt"] == "Summarise this news.\n\nRates rose by 0.25%."


def test_lmsys_loader_reads_jsonl_and_parquet(manual_dir):
  examples = list(data.load_manual("lmsys_chat", manual_dir)[common.ALL])
  assert sorted(e["prompt"] for e in examples) == sorted(t for t, _ in LMSYS_TEXTS)
  languages = {e["prompt"]: e["language"] for e in examples}
  assert (
      languages["你好，请介绍一下你自己"] == "zh"
      and languages["Tell me a joke."] == "en"
  )
  assert {e["answer"] for e in examples} == {"Sure."}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_manual_builder_prepares_disjoint_splits(manual_dir, tmp_path, name):
  from osd_jax.data.builder import read_split

  # Half to eval, so that the hash split of a few records leaves both sides non-empty.
  builder = data.builder_class(name)(
      manual_dir=manual_dir, data_dir=tmp_path, eval_percent=50
  )
  splits = {s: read_split(builder, s) for s in ("train", "eval")}
  assert splits["train"] and {
      e["domain"] for e in splits["train"] + splits["eval"]
  } == {DOMAINS[name]}
  assert not {e["prompt"] for e in splits["train"]} & {
      e["prompt"] for e in splits["eval"]
  }
  assert all(set(e) == set(common.FIELDS) for e in splits["train"])


def test_manual_builder_sample_is_seeded(manual_dir, tmp_path):
  from osd_jax.data.builder import read_split
  from osd_jax.data.manual_builders import FinanceAlpaca

  def sample(seed: int) -> list[str]:
    builder = FinanceAlpaca(
        manual_dir=manual_dir, data_dir=tmp_path, num_train=5, num_eval=1, seed=seed
    )
    return sorted(e["id"] for e in read_split(builder, "train"))

  assert sample(0) == sample(0) and len(sample(0)) == 5
  assert any(sample(s) != sample(0) for s in (1, 2, 3))


@pytest.mark.parametrize(
    "name, expected_file",
    [
        ("spider", "train_spider.json"),
        ("gsm8k", "train.jsonl"),
        ("code_search_net_python", "python_train_"),
        ("finance_alpaca", "Cleaned_date.json"),
        ("lmsys_chat", ".parquet"),
    ],
)
def test_missing_manual_file_says_what_goes_where(tmp_path, name, expected_file):
  wrong = tmp_path / "not_the_manual_dir"
  with pytest.raises(data.ManualDataError) as error:
    data.load_manual(name, wrong)
  message = str(error.value)
  assert expected_file in message and str(wrong / name) in message
  assert "OSD_JAX_MANUAL_DIR" in message


def test_missing_manual_file_through_the_builder(tmp_path):
  from osd_jax.data.manual_builders import Gsm8k

  (tmp_path / "manual" / "gsm8k").mkdir(parents=True)
  (tmp_path / "manual" / "gsm8k" / "train.jsonl").write_text("")
  builder = Gsm8k(manual_dir=tmp_path / "manual", data_dir=tmp_path / "tfds")
  with pytest.raises(data.ManualDataError, match=r"test\.jsonl not found in .*gsm8k"):
    builder.download_and_prepare()


def test_too_small_a_source_says_so(manual_dir, tmp_path):
  from osd_jax.data.manual_builders import LmsysChat

  with pytest.raises(ValueError, match="too small"):
    LmsysChat(
        manual_dir=manual_dir, data_dir=tmp_path, eval_percent=0
    ).download_and_prepare()


def test_unknown_manual_name():
  with pytest.raises(ValueError, match="spider"):
    data.load_manual("not_a_dataset", "/tmp")
