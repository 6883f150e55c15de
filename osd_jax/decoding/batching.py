"""Right-padded prompt batches, shared by every host loop."""

import numpy as np


def pad_prompts(ids: list[list[int]], batch_size: int, width: int, pad_id: int):
  """[batch, width] prompts, their lengths, and which rows are real requests.

  Rows past len(ids) are dummies (a 2-token prompt of pad ids) that callers
  mask out with `is_real`.
  """
  prompts = np.full((batch_size, width), pad_id, np.int32)
  lens = np.full((batch_size,), 2, np.int32)
  for row, seq in enumerate(ids):
    prompts[row, :len(seq)] = seq
    lens[row] = len(seq)
  return prompts, lens, np.arange(batch_size) < len(ids)
