"""tfds builders over the paper's data sets placed in a manual directory (see `manual`)."""

from __future__ import annotations

import os
import pathlib

from osd_jax.data import common, manual
from osd_jax.data.builder import QueryBuilder


class ManualQueryBuilder(QueryBuilder, skip_registration=True):
  """Base: reads `manual_dir/<name>/` and keeps a seeded sample of each split.

  Published splits are kept (train vs dev/test); a set with one split is
  split by prompt hash. The prepared data is cached under `data_dir`: delete
  its folder after changing the manual files.
  """

  def __init__(self, *, manual_dir: str | os.PathLike | None = None, **kwargs):
    self._manual_root = pathlib.Path(
        manual_dir or common.default_manual_dir()
    ).expanduser()
    super().__init__(**kwargs)

  @property
  def manual_folder(self) -> pathlib.Path:
    """Where this data set's files must be."""
    return self._manual_root / self.name

  def _split_examples(self) -> dict[str, list[common.Example]]:
    config = self.builder_config
    splits = manual.load_manual(self.name, self._manual_root)
    with self._progress(None) as read:  # a sample of a file of unknown length
      return common.sample_splits(
          splits,
          config.num_train,
          config.num_eval,
          config.eval_percent,
          config.seed,
          on_read=read.update,
      )


class Spider(ManualQueryBuilder, skip_registration=True):
  """Spider text-to-SQL: train_spider.json (train) and dev.json (eval)."""

  name = "spider"
  DESCRIPTION = __doc__


class Gsm8k(ManualQueryBuilder, skip_registration=True):
  """GSM8K grade-school math: train.jsonl (train) and test.jsonl (eval)."""

  name = "gsm8k"
  DESCRIPTION = __doc__


class CodeSearchNetPython(ManualQueryBuilder, skip_registration=True):
  """CodeSearchNet Python, docstring to function: python_train_* (train), python_test_* (eval)."""

  name = "code_search_net_python"
  DESCRIPTION = __doc__


class FinanceAlpaca(ManualQueryBuilder, skip_registration=True):
  """gbharti/finance-alpaca instructions, split by prompt hash."""

  name = "finance_alpaca"
  DESCRIPTION = __doc__


class LmsysChat(ManualQueryBuilder, skip_registration=True):
  """LMSYS-Chat-1M first user turns with their language, split by prompt hash."""

  name = "lmsys_chat"
  DESCRIPTION = __doc__


MANUAL_BUILDERS: dict[str, type[ManualQueryBuilder]] = {
    cls.name: cls
    for cls in (Spider, Gsm8k, CodeSearchNetPython, FinanceAlpaca, LmsysChat)
}
