"""Flags of the serve-and-learn step's decoding, shared by the main job and the server."""

from absl import app, flags

BATCH_K = flags.DEFINE_list(
    "batch_k", [],
    "BATCH:K pairs: a call over BATCH or more slots per device drafts at most K"
    " tokens per step (K >= 1); default none, k at every batch. With"
    " --trim_verify a row's proposal costs only the positions it fills, so"
    " the draft's confidence stop already keeps batches short (measured"
    " in docs/results_history.md); e.g. 4:2 caps k where that is not so.")


def batch_k() -> tuple[tuple[int, int], ...]:
  """--batch_k as (batch, k) pairs; malformed ones are a usage error."""
  pairs = []
  for item in BATCH_K.value:
    batch, _, k_b = item.partition(":")
    if not (batch.isdigit() and k_b.isdigit() and int(batch) and int(k_b)):
      raise app.UsageError(f"--batch_k takes BATCH:K pairs of positive integers,"
                           f" got {item!r}.")
    pairs.append((int(batch), int(k_b)))
  return tuple(pairs)
