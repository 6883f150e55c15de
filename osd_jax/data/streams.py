"""Request streams over the query data sets: one domain, sharp shifts, drifting mixtures, categories.

    stream = make_stream("shift", ["sql", "math", "code"], num_requests=3000, seed=0)

gives 1,000 SQL requests, then 1,000 math, then 1,000 code. Each request
carries a category label (its domain or its language) for per-category drafts.
Everything is a pure function of the arguments and the seed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from typing import Mapping, Sequence

from osd_jax.data import common
from osd_jax.data.sources import Source, default_sources

CATEGORY_KEYS = ("domain", "language", "source")


@dataclasses.dataclass(frozen=True)
class Request:
  """One query in a stream."""

  index: int  # Position in the stream.
  prompt: str
  domain: str  # Example's domain: chat | math | code | sql | finance.
  language: str  # ISO code or "unknown".
  category: str  # The routing label: the example's domain, language or source.
  dataset: str  # The source name it was drawn from, e.g. "sql" or "spider".
  id: str  # The example's id within its data set.
  answer: str = ""  # Reference answer, when the data set has one.


def stream_names() -> dict[str, str]:
  """Valid stream kinds, each with what it produces."""
  return {
      "single": "one domain only: `domains` has one name; requests in seeded random order.",
      "shift": (
          "sharp shifts: domains[0] for `segment_length` requests (default "
          "num_requests / len(domains)), then domains[1], ...; cycles when the stream is longer."
      ),
      "mixture": (
          "gradual drift: request i draws its domain from weights that move linearly from "
          "`start_weights` to `end_weights` (default: from all domains[0] through each domain "
          "in turn to all domains[-1])."
      ),
      "category": (
          "per-category traffic: every example of `domains` is grouped by `category_key` "
          "(domain or language; `categories` picks and orders them); each request picks a "
          "category uniformly (or by natural frequency with balanced=False)."
      ),
  }


class _Pool:
  """Draws examples without replacement in seeded order, reshuffling when exhausted."""

  def __init__(
      self, examples: Sequence[tuple[str, common.Example]], rng: random.Random
  ):
    if not examples:
      raise ValueError("cannot draw from an empty pool")
    self.examples, self.rng, self.order = list(examples), rng, []

  def draw(self) -> tuple[str, common.Example]:
    if not self.order:
      self.order = list(range(len(self.examples)))
      self.rng.shuffle(self.order)
    return self.examples[self.order.pop()]


def _segment_domains(
    domains: Sequence[str], num_requests: int, segment_length: int | None
) -> list[str]:
  length = segment_length or math.ceil(num_requests / len(domains))
  return [domains[(i // length) % len(domains)] for i in range(num_requests)]


def mixture_weights(num_domains: int, t: float, start=None, end=None) -> list[float]:
  """Domain weights at stream position t in [0, 1]; see stream_names()["mixture"]."""
  if start is not None or end is not None:
    start = start if start is not None else [1.0] + [0.0] * (num_domains - 1)
    end = end if end is not None else [0.0] * (num_domains - 1) + [1.0]
    if len(start) != num_domains or len(end) != num_domains:
      raise ValueError("start_weights and end_weights need one weight per domain")
    weights = [(1 - t) * a + t * b for a, b in zip(start, end)]
  else:
    weights = [0.0] * num_domains
    position = t * (num_domains - 1)
    low = min(int(position), num_domains - 1)
    weights[low] = 1.0 - (position - low)
    if low + 1 < num_domains:
      weights[low + 1] = position - low
  total = sum(weights)
  if total <= 0:
    raise ValueError(f"mixture weights must have a positive sum, got {weights}")
  return [w / total for w in weights]


def _mixture_domains(domains, num_requests, rng, start, end) -> list[str]:
  chosen = []
  for i in range(num_requests):
    t = i / (num_requests - 1) if num_requests > 1 else 0.0
    chosen.append(
        rng.choices(domains, weights=mixture_weights(len(domains), t, start, end))[0]
    )
  return chosen


def _request(
    index: int, dataset: str, example: common.Example, category_key: str
) -> Request:
  category = dataset if category_key == "source" else example[category_key]
  return Request(
      index=index,
      prompt=example["prompt"],
      domain=example["domain"],
      language=example["language"],
      category=category,
      dataset=dataset,
      id=example["id"],
      answer=example.get("answer", ""),
  )


def _category_stream(
    examples, num_requests, seed, category_key, categories, balanced
) -> list[Request]:
  rng = random.Random(seed)
  groups: dict[str, list[tuple[str, common.Example]]] = {}
  for dataset, example in examples:
    label = dataset if category_key == "source" else example[category_key]
    groups.setdefault(label, []).append((dataset, example))
  if categories is None:
    categories = sorted(groups)
  empty = [c for c in categories if c not in groups]
  if empty:
    raise ValueError(
        f"No examples with {category_key} in {empty}; found: {sorted(groups)}"
    )
  if balanced:
    pools = {
        c: _Pool(groups[c], random.Random(f"{seed}-category-{c}")) for c in categories
    }
    picks = [pools[rng.choice(categories)].draw() for _ in range(num_requests)]
  else:
    pool = _Pool([item for c in categories for item in groups[c]], rng)
    picks = [pool.draw() for _ in range(num_requests)]
  return [
      _request(i, dataset, example, category_key)
      for i, (dataset, example) in enumerate(picks)
  ]


def make_stream(
    kind: str,
    domains: Sequence[str],
    num_requests: int,
    seed: int = 0,
    split: str = common.TRAIN,
    *,
    category_key: str = "domain",
    categories: Sequence[str] | None = None,
    balanced: bool = True,
    segment_length: int | None = None,
    start_weights: Sequence[float] | None = None,
    end_weights: Sequence[float] | None = None,
    sources: Mapping[str, Source] | None = None,
    data_dir: str | os.PathLike | None = None,
    manual_dir: str | os.PathLike | None = None,
    pool_size: int | None = None,
    data_seed: int = 0,
) -> list[Request]:
  """A deterministic stream of `num_requests` requests; `kind` is one of stream_names().

  `domains` are source names: "chat", "math", "code", "sql", a manual set
  ("spider", "gsm8k", "code_search_net_python", "finance_alpaca" or
  "finance", "lmsys_chat"), or a key of `sources`, which adds to or
  overrides the defaults (see `sources.builder_source`, `examples_source`).
  `pool_size` caps how many examples per split each default source prepares;
  `data_seed` picks which examples those are (kept apart from `seed`, which
  only orders the stream, so streams of several seeds share one data set).
  """
  if kind not in stream_names():
    raise ValueError(
        f"Unknown stream kind {kind!r}; valid: {', '.join(stream_names())}"
    )
  if category_key not in CATEGORY_KEYS:
    raise ValueError(
        f"category_key must be one of {CATEGORY_KEYS}, got {category_key!r}"
    )
  if not domains:
    raise ValueError("domains must name at least one source")
  if kind == "single" and len(domains) != 1:
    raise ValueError(f"a 'single' stream takes one domain, got {list(domains)}")
  available = dict(
      default_sources(
          data_dir=data_dir, manual_dir=manual_dir, pool_size=pool_size, seed=data_seed
      )
  )
  available.update(sources or {})
  unknown = [d for d in domains if d not in available]
  if unknown:
    raise ValueError(
        f"Unknown domains {unknown}; known: {', '.join(sorted(available))}"
    )

  examples = {d: [(d, e) for e in available[d](split)] for d in dict.fromkeys(domains)}
  if kind == "category":
    everything = [item for d in examples for item in examples[d]]
    return _category_stream(
        everything, num_requests, seed, category_key, categories, balanced
    )
  rng = random.Random(seed)
  if kind == "mixture":
    chosen = _mixture_domains(
        list(domains), num_requests, rng, start_weights, end_weights
    )
  else:  # "single" is a shift with one segment.
    chosen = _segment_domains(domains, num_requests, segment_length)
  # One pool per domain with its own seeded order, so a domain's requests do
  # not depend on how the other domains interleave.
  pools = {d: _Pool(examples[d], random.Random(f"{seed}-{d}")) for d in examples}
  return [
      _request(i, d, pools[d].draw()[1], category_key) for i, d in enumerate(chosen)
  ]


def category_counts(stream: Sequence[Request]) -> dict[str, int]:
  """How many requests each category received, for reports and routing checks."""
  counts: dict[str, int] = {}
  for request in stream:
    counts[request.category] = counts.get(request.category, 0) + 1
  return counts
