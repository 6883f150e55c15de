"""How the target verifies a proposal: shared by every entry point that speculates."""

from absl import flags

TRIM_VERIFY = flags.DEFINE_bool(
    "trim_verify", True,
    "Verify only the positions the proposals fill, not always k + 1 per row:"
    " at one slot the longest proposal's width, over more slots each row's"
    " own positions packed into one pass (one target program per width or"
    " packed size, so compiles take longer). On a 2-core CPU a pass costs"
    " about what it computes (batch 8: 42 / 57 / 70 ms for 8 / 16 / 24"
    " positions), so short proposals (the confidence stop) cost less."
    " --notrim_verify on TPU/GPU, where a pass costs about the same at any width.")
