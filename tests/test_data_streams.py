"""Request streams: determinism, sharp shifts, drifting mixtures, per-category routing."""

from __future__ import annotations

import collections

import pytest

from osd_jax import data
from osd_jax.data import common


def _examples(
    domain: str, languages: tuple[str, ...], n: int
) -> dict[str, list[common.Example]]:
  def make(split: str, i: int) -> common.Example:
    language = languages[i % len(languages)]
    return common.make_example(
        id=f"{domain}-{split}-{i}",
        prompt=f"{domain} {language} query {split} {i}",
        domain=domain,
        language=language,
        source=f"fake-{domain}",
    )

  return {split: [make(split, i) for i in range(n)] for split in ("train", "eval")}


@pytest.fixture
def sources() -> dict[str, data.Source]:
  return {
      "sqlish": data.examples_source(_examples("sql", ("en",), 30)),
      "mathish": data.examples_source(_examples("math", ("en",), 30)),
      "chatty": data.examples_source(_examples("chat", ("en", "zh", "ko", "es"), 40)),
  }


def test_stream_names_document_every_kind():
  names = data.stream_names()
  assert set(names) == {"single", "shift", "mixture", "category"}
  assert all(isinstance(text, str) and text for text in names.values())


@pytest.mark.parametrize("kind", ["single", "shift", "mixture", "category"])
def test_streams_are_deterministic(sources, kind):
  domains = ["chatty"] if kind == "single" else ["sqlish", "mathish", "chatty"]
  first = data.make_stream(kind, domains, 90, seed=3, sources=sources)
  again = data.make_stream(kind, domains, 90, seed=3, sources=sources)
  other = data.make_stream(kind, domains, 90, seed=4, sources=sources)
  assert first == again
  assert [r.id for r in first] != [r.id for r in other]
  assert [r.index for r in first] == list(range(90))


def test_single_stream_draws_without_replacement_first(sources):
  stream = data.make_stream("single", ["sqlish"], 45, seed=0, sources=sources)
  assert {r.domain for r in stream} == {"sql"} and {r.dataset for r in stream} == {
      "sqlish"
  }
  assert (
      len({r.id for r in stream[:30]}) == 30
  )  # Every example once before any repeats.
  eval_stream = data.make_stream(
      "single", ["sqlish"], 10, seed=0, split="eval", sources=sources
  )
  assert all("-eval-" in r.id for r in eval_stream)


def test_shift_changes_domain_at_the_right_indices(sources):
  stream = data.make_stream(
      "shift", ["sqlish", "mathish", "chatty"], 90, seed=0, sources=sources
  )
  domains = [r.domain for r in stream]
  assert domains == ["sql"] * 30 + ["math"] * 30 + ["chat"] * 30
  changes = [i for i in range(1, len(domains)) if domains[i] != domains[i - 1]]
  assert changes == [30, 60]


def test_shift_with_segment_length_cycles(sources):
  stream = data.make_stream(
      "shift", ["sqlish", "mathish"], 50, seed=0, segment_length=20, sources=sources
  )
  assert [r.domain for r in stream] == ["sql"] * 20 + ["math"] * 20 + ["sql"] * 10


def test_a_domains_requests_do_not_depend_on_the_others(sources):
  shift = data.make_stream("shift", ["sqlish", "mathish"], 40, seed=0, sources=sources)
  single = data.make_stream("single", ["sqlish"], 20, seed=0, sources=sources)
  assert [r.id for r in shift[:20]] == [r.id for r in single]


def test_mixture_weights_drift_linearly():
  assert data.mixture_weights(2, 0.0) == [1.0, 0.0]
  assert data.mixture_weights(2, 0.25) == [0.75, 0.25]
  assert data.mixture_weights(3, 0.5) == [0.0, 1.0, 0.0]
  assert data.mixture_weights(3, 0.75) == [0.0, 0.5, 0.5]
  assert data.mixture_weights(
      2, 0.5, start=[0.8, 0.2], end=[0.2, 0.8]
  ) == pytest.approx([0.5, 0.5])
  for t in (0.0, 0.3, 1.0):
    assert sum(data.mixture_weights(4, t)) == pytest.approx(1.0)


def test_mixture_drifts_from_first_to_last_domain(sources):
  stream = data.make_stream(
      "mixture", ["sqlish", "mathish"], 400, seed=0, sources=sources
  )
  first, last = stream[:100], stream[-100:]
  assert sum(r.domain == "sql" for r in first) > 75
  assert sum(r.domain == "math" for r in last) > 75
  middle = stream[150:250]
  assert 25 < sum(r.domain == "sql" for r in middle) < 75


def test_category_stream_routes_by_language(sources):
  stream = data.make_stream(
      "category", ["chatty"], 400, seed=1, category_key="language", sources=sources
  )
  assert all(r.category == r.language for r in stream)
  counts = data.category_counts(stream)
  assert set(counts) == {"en", "zh", "ko", "es"}
  assert min(counts.values()) > 60  # Balanced: about 100 each.


def test_category_stream_picks_and_routes_categories(sources):
  stream = data.make_stream(
      "category",
      ["chatty", "sqlish"],
      200,
      seed=0,
      category_key="language",
      categories=["zh", "ko"],
      sources=sources,
  )
  assert {r.category for r in stream} == {"zh", "ko"} and {
      r.domain for r in stream
  } == {"chat"}
  by_domain = data.make_stream(
      "category", ["sqlish", "mathish", "chatty"], 300, seed=0, sources=sources
  )
  assert all(r.category == r.domain for r in by_domain)
  assert set(data.category_counts(by_domain)) == {"sql", "math", "chat"}


def test_category_stream_natural_frequency(sources):
  stream = data.make_stream(
      "category", ["chatty", "sqlish"], 700, seed=0, balanced=False, sources=sources
  )
  counts = collections.Counter(r.domain for r in stream)
  assert counts["chat"] > counts["sql"]  # 40 chat examples against 30 sql.


def test_stream_errors_are_clear(sources):
  with pytest.raises(ValueError, match="single, shift, mixture, category"):
    data.make_stream("zigzag", ["sqlish"], 10, sources=sources)
  with pytest.raises(ValueError, match="Unknown domains"):
    data.make_stream("shift", ["nope"], 10, sources=sources)
  with pytest.raises(ValueError, match="one domain"):
    data.make_stream("single", ["sqlish", "mathish"], 10, sources=sources)
  with pytest.raises(ValueError, match="No examples with language"):
    data.make_stream(
        "category",
        ["sqlish"],
        10,
        category_key="language",
        categories=["fr"],
        sources=sources,
    )
  with pytest.raises(ValueError, match="fields"):
    data.examples_source({"train": [{"prompt": "x"}]})


def test_shift_stream_over_real_builders(tmp_path):
  stream = data.make_stream(
      "shift", ["sql", "math"], 20, seed=0, data_dir=tmp_path, pool_size=8
  )
  assert [r.domain for r in stream] == ["sql"] * 10 + ["math"] * 10
  assert len({r.id for r in stream[:8]}) == 8 and all(
      r.language == "en" for r in stream
  )
  again = data.make_stream(
      "shift", ["sql", "math"], 20, seed=0, data_dir=tmp_path, pool_size=8
  )
  assert stream == again


def test_manual_set_as_a_stream_domain(tmp_path):
  folder = tmp_path / "manual" / "gsm8k"
  folder.mkdir(parents=True)
  for name, n, op in (("train.jsonl", 6, "+"), ("test.jsonl", 2, "*")):
    rows = [
        f'{{"question": "What is {i} {op} {i}?", "answer": "#### 0"}}\n'
        for i in range(n)
    ]
    (folder / name).write_text("".join(rows))
  stream = data.make_stream(
      "single",
      ["gsm8k"],
      6,
      seed=0,
      manual_dir=tmp_path / "manual",
      data_dir=tmp_path / "tfds",
  )
  assert sorted(r.prompt for r in stream) == sorted(
      f"What is {i} + {i}?" for i in range(6)
  )
  assert {r.domain for r in stream} == {"math"} and {r.dataset for r in stream} == {
      "gsm8k"
  }
