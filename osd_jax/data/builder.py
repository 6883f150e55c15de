"""The tfds builder base of the query data sets, and reading a prepared split back.

Builders write array_record files and are read back with `as_data_source()`,
which needs no TensorFlow (`as_dataset` and `tfds.load` do).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Iterator

import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import tqdm_utils
import tqdm

from osd_jax import progress
from osd_jax.data.common import FIELDS, Example, default_data_dir, fill_splits


class _NoCustomConfigWarning(logging.Filter):
  """Drops tfds' warning that a config is not predeclared: ours never are."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Using custom data configuration")


@dataclasses.dataclass
class QueryConfig(tfds.core.BuilderConfig):
  """Sizes and seed; its name encodes them so each size gets its own directory."""

  num_train: int | None = None
  num_eval: int | None = None
  seed: int = 0
  eval_percent: int = 10

  @classmethod
  def make(
      cls, num_train: int | None, num_eval: int | None, seed: int, eval_percent: int
  ) -> "QueryConfig":
    """A config named after its values, e.g. "train100_eval20_seed0_pct10"."""

    def size(n: int | None) -> str:
      return "all" if n is None else str(n)

    name = f"train{size(num_train)}_eval{size(num_eval)}_seed{seed}_pct{eval_percent}"
    return cls(
        name=name,
        num_train=num_train,
        num_eval=num_eval,
        seed=seed,
        eval_percent=eval_percent,
    )


class QueryBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base of all query builders: common features, sized config, train/eval splits.

  Subclasses implement `_split_examples` (or `_examples` for a hash split).
  They skip tfds registration: nothing here is looked up by name, and
  re-importing a module under pytest must not collide with itself.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  DESCRIPTION = ""
  # Sizes used when the caller passes None; None here means "everything".
  DEFAULT_NUM_TRAIN: int | None = None
  DEFAULT_NUM_EVAL: int | None = None
  # tfds looks for a checksums file next to the builder's code through
  # `importlib_resources`, which is not installed on Python >= 3.9 and
  # crashes `download_and_prepare`; nothing here is downloaded, so no checksums.
  code_path = None

  def __init__(
      self,
      *,
      num_train: int | None = None,
      num_eval: int | None = None,
      seed: int = 0,
      eval_percent: int = 10,
      data_dir: str | os.PathLike | None = None,
      **kwargs,
  ):
    num_train = self.DEFAULT_NUM_TRAIN if num_train is None else num_train
    num_eval = self.DEFAULT_NUM_EVAL if num_eval is None else num_eval
    config = QueryConfig.make(num_train, num_eval, seed, eval_percent)
    quiet = _NoCustomConfigWarning()
    logging.getLogger("absl").addFilter(quiet)  # tfds logs through absl
    try:
      super().__init__(
          data_dir=os.fspath(data_dir or default_data_dir()),
          config=config,
          file_format="array_record",
          **kwargs,
      )
    finally:
      logging.getLogger("absl").removeFilter(quiet)

  def download_and_prepare(self, *args, **kwargs):
    """tfds' preparation without its progress bars: `_progress` counts instead."""
    shown = getattr(tqdm_utils, "_active", True)  # tfds has no getter
    tfds.display_progress_bar(False)
    try:
      return super().download_and_prepare(*args, **kwargs)
    finally:
      tfds.display_progress_bar(shown)

  # tfds prints "Downloading and preparing dataset ..." and "... prepared to"
  # banners on stdout; nothing is downloaded here and the bar says enough.
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _progress(self, total: int | None) -> tqdm.tqdm:
    """A bar over the examples this data set is prepared from."""
    return progress.bar(total, f"preparing {self.name}", "examples")

  def _info(self) -> tfds.core.DatasetInfo:
    features = tfds.features.FeaturesDict(
        {name: tfds.features.Text() for name in FIELDS}
    )
    return tfds.core.DatasetInfo(
        builder=self, description=self.DESCRIPTION, features=features
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded; manual files are found by the subclass.
    splits = self._split_examples()
    empty = [name for name, examples in splits.items() if not examples]
    if empty:  # tfds cannot write an empty split; say why it is empty instead.
      raise ValueError(
          f"{self.name}: split(s) {empty} would be empty ({ {k: len(v) for k, v in splits.items()} } "
          f"examples with eval_percent={self.builder_config.eval_percent}); the source is too small "
          "for these sizes: give it more examples or change num_train/num_eval/eval_percent."
      )
    return {
        name: self._generate_examples(examples) for name, examples in splits.items()
    }

  def _generate_examples(
      self, examples: list[Example]
  ) -> Iterator[tuple[str, Example]]:
    for example in examples:
      yield example["id"], example

  def _split_examples(self) -> dict[str, list[Example]]:
    """Examples per split; by default a hash split of `_examples()`."""
    config = self.builder_config
    sizes = (config.num_train, config.num_eval)
    with self._progress(None if None in sizes else sum(sizes)) as kept:
      return fill_splits(
          self._examples(), *sizes, config.eval_percent, on_kept=kept.update
      )

  def _examples(self) -> Iterator[Example]:
    """All candidate examples in a deterministic order (for the given seed)."""
    raise NotImplementedError(
        f"{type(self).__name__} must implement _examples or _split_examples"
    )


def read_split(builder: tfds.core.DatasetBuilder, split: str) -> list[Example]:
  """Prepare `builder` if needed and return one split as a list of str dicts."""
  builder.download_and_prepare()
  source = builder.as_data_source()[split]
  records = source.__getitems__(list(range(len(source)))) if len(source) else []
  return [
      {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in r.items()}
      for r in records
  ]
