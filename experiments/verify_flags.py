"""How the target verifies a proposal: shared by every entry point that speculates."""

from absl import flags

TRIM_VERIFY = flags.DEFINE_bool(
    "trim_verify", True,
    "In calls over fewer than 4 slots, verify only as many positions as the"
    " step's longest proposal needs, not always k + 1 (one target program per"
    " width, so compiles take longer): on a 2-core CPU a pass over 5 tokens"
    " costs about 1.9x one over 1 and over 2 about 1.25x, so steps whose drafts"
    " stopped early (the confidence stop) cost less. --notrim_verify on TPU/GPU,"
    " where a pass costs about the same at any width.")
