"""Query data sets (tfds builders, manual-directory loaders) and request streams.

Importing this package loads no data and no tensorflow-datasets; builders are
imported from their modules (chat, math, code, sql, manual_builders) or
resolved by name through `sources.builder_class`.
"""

from osd_jax.data.common import EVAL, FIELDS, TRAIN, Example, default_data_dir, default_manual_dir, make_example
from osd_jax.data.language import detect_language, language_code
from osd_jax.data.manual import ManualDataError, load_manual
from osd_jax.data.sources import (
    Source,
    builder_class,
    builder_source,
    default_sources,
    examples_source,
    source_names,
)
from osd_jax.data.streams import Request, category_counts, make_stream, mixture_weights, stream_names

__all__ = [
    "EVAL",
    "FIELDS",
    "TRAIN",
    "Example",
    "default_data_dir",
    "default_manual_dir",
    "make_example",
    "detect_language",
    "language_code",
    "ManualDataError",
    "load_manual",
    "Source",
    "builder_class",
    "builder_source",
    "default_sources",
    "examples_source",
    "source_names",
    "Request",
    "category_counts",
    "make_stream",
    "mixture_weights",
    "stream_names",
]
