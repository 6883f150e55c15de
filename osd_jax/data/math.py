"""Math queries: GSM8K-style word problems generated offline by reasoning-gym."""

from __future__ import annotations

from typing import Iterator

from osd_jax.data import common
from osd_jax.data.builder import QueryBuilder

# reasoning-gym appends this to every question; GSM8K's questions do not have it.
_SUFFIX = " Give the result as your final answer. Do not include units."
# Candidates generated per example wanted: the hash split sends about
# eval_percent % to eval, and a few generated questions repeat.
_OVERSAMPLE = 20


def gsm_symbolic_examples(size: int, seed: int) -> Iterator[common.Example]:
  """Up to `size` GSM8K-style problems; problem i depends only on (seed, i)."""
  import reasoning_gym  # pylint: disable=import-outside-toplevel

  dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
  for index in range(size):
    item = dataset[index]
    question = item["question"]
    if question.endswith(_SUFFIX):
      question = question[: -len(_SUFFIX)]
    # The chain of thought ends in "#### <number>", the same layout as GSM8K answers.
    answer = item["metadata"].get("answer_cot") or item["answer"]
    yield common.make_example(
        id=f"gsm_symbolic-{seed}-{index}",
        prompt=question.strip(),
        domain="math",
        language="en",
        answer=answer,
        source="gsm_symbolic",
    )


class GsmSymbolicMath(QueryBuilder, skip_registration=True):
  """GSM8K-style problems from reasoning-gym's gsm_symbolic generator, hash split."""

  name = "gsm_symbolic_math"
  DESCRIPTION = __doc__
  # A generator has no natural end, so "all" means this many.
  DEFAULT_NUM_TRAIN = 9_000
  DEFAULT_NUM_EVAL = 1_000

  def _examples(self) -> Iterator[common.Example]:
    config = self.builder_config
    size = _OVERSAMPLE * (config.num_train + config.num_eval)
    return gsm_symbolic_examples(size, config.seed)
