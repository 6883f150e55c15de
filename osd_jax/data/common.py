"""What every query data set shares: example fields, directories, the train/eval split.

Each example is a dict of strings:
  id        unique within its data set
  prompt    the user's query, as the target model would be asked it
  answer    a reference answer ("" when the source has none)
  domain    chat | math | code | sql | finance
  language  ISO 639-1 code of the natural language, or "unknown"
  source    where it came from (e.g. "sharegpt", "humaneval", "sqlite:school")

No tensorflow-datasets here, so that streams over in-memory examples do not import it.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import random
from typing import Callable, Iterable, Iterator, Mapping

TRAIN, EVAL = "train", "eval"
ALL = "all"  # A source with a single published split; builders split it by hash.
SPLITS = (TRAIN, EVAL)
FIELDS = ("id", "prompt", "answer", "domain", "language", "source")
DATA_DIR_ENV = "OSD_JAX_DATA_DIR"
MANUAL_DIR_ENV = "OSD_JAX_MANUAL_DIR"
Example = dict[str, str]


def default_data_dir() -> pathlib.Path:
  """Where prepared data sets go: $OSD_JAX_DATA_DIR or ~/.cache/osd_jax/tfds."""
  return pathlib.Path(
      os.environ.get(DATA_DIR_ENV) or "~/.cache/osd_jax/tfds"
  ).expanduser()


def default_manual_dir() -> pathlib.Path:
  """Where users put the paper's data files: $OSD_JAX_MANUAL_DIR or ~/.cache/osd_jax/manual."""
  return pathlib.Path(
      os.environ.get(MANUAL_DIR_ENV) or "~/.cache/osd_jax/manual"
  ).expanduser()


def make_example(
    id: str,  # pylint: disable=redefined-builtin
    prompt: str,
    domain: str,
    language: str = "unknown",
    answer: str = "",
    source: str = "",
) -> Example:
  """One example with every field present, as the builders store it."""
  return {
      "id": id,
      "prompt": prompt,
      "answer": answer,
      "domain": domain,
      "language": language,
      "source": source,
  }


def _split_key(prompt: str) -> int:
  # Whitespace and case do not make a different query; normalising them keeps
  # near-identical prompts on one side of the split. An 8-byte digest keeps
  # the set of seen prompts small for a million-record source.
  text = " ".join(prompt.lower().split())
  return (
      int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
      if text
      else 0
  )


def is_eval(prompt: str, eval_percent: int) -> bool:
  """Whether `prompt` belongs to the eval split: a hash of its text, not of its position."""
  return _split_key(prompt) % 100 < eval_percent


def _unique(
    examples: Iterable[Example], seen: set[int] | None = None
) -> Iterator[tuple[int, Example]]:
  """(prompt key, example) for each example whose prompt is non-empty and not in `seen` yet."""
  seen = set() if seen is None else seen
  for example in examples:
    key = _split_key(example["prompt"])
    if key and key not in seen:
      seen.add(key)
      yield key, example


def _full(counts: dict[str, int], quota: dict[str, int | None]) -> bool:
  return all(quota[s] is not None and counts[s] >= quota[s] for s in SPLITS)


def fill_splits(
    examples: Iterable[Example],
    num_train: int | None,
    num_eval: int | None,
    eval_percent: int,
    on_kept: Callable[[], object] = lambda: None,
) -> dict[str, list[Example]]:
  """Route examples to train/eval by prompt hash, first come first served, until both are full.

  For sources already in random order; it stops reading once the quotas fill.
  Duplicate prompts are dropped, so the splits share no prompt. An example
  whose split is full is skipped rather than moved, so the eval set does not
  depend on the train size. `on_kept` is called for every example kept.
  """
  quota = {TRAIN: num_train, EVAL: num_eval}
  out: dict[str, list[Example]] = {TRAIN: [], EVAL: []}
  for key, example in _unique(examples):
    if _full({s: len(out[s]) for s in SPLITS}, quota):
      break
    split = EVAL if key % 100 < eval_percent else TRAIN
    if quota[split] is None or len(out[split]) < quota[split]:
      out[split].append(example)
      on_kept()
  return out


class _Reservoir:
  """A uniform sample of `limit` items from a stream (all when None), kept in stream order."""

  def __init__(self, limit: int | None, rng: random.Random):
    self.limit, self.rng, self.seen, self.items = limit, rng, 0, []

  def add(self, item: Example) -> None:
    if self.limit is None or len(self.items) < self.limit:
      self.items.append((self.seen, item))
    else:  # Algorithm R: item number n replaces a kept one with probability limit / n.
      slot = self.rng.randrange(self.seen + 1)
      if slot < self.limit:
        self.items[slot] = (self.seen, item)
    self.seen += 1

  def result(self) -> list[Example]:
    return [item for _, item in sorted(self.items, key=lambda pair: pair[0])]


def sample_splits(
    splits: Mapping[str, Iterable[Example]],
    num_train: int | None,
    num_eval: int | None,
    eval_percent: int,
    seed: int,
    on_read: Callable[[], object] = lambda: None,
) -> dict[str, list[Example]]:
  """A seeded uniform sample per split, for sources in a meaningful order (Spider is grouped by database).

  `splits` has "train" and "eval", or "all", which is split by prompt hash.
  Reads every example once, calling `on_read` for each; keeps only the samples
  in memory.
  """
  rng = random.Random(seed)
  reservoirs = {TRAIN: _Reservoir(num_train, rng), EVAL: _Reservoir(num_eval, rng)}
  if ALL in splits:
    for key, example in _unique(splits[ALL]):
      on_read()
      reservoirs[EVAL if key % 100 < eval_percent else TRAIN].add(example)
  else:
    seen: set[int] = (
        set()
    )  # Shared, so a prompt in both published splits stays in train only.
    for split in SPLITS:
      for _, example in _unique(splits[split], seen):
        on_read()
        reservoirs[split].add(example)
  return {split: reservoir.result() for split, reservoir in reservoirs.items()}
