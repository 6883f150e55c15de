"""Packing a ragged batch: which positions go in which slot, and a packed
pass equal to the padded one where it computed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.models import llama
from osd_jax.models.packing import Packing, sizes
from tests.test_generation import tiny_model


def test_sizes_run_from_one_position_a_row_to_every_position():
  assert sizes(8, 3) == (8, 12, 16, 20, 24)
  assert sizes(1, 5) == (1, 2, 3, 4, 5)
  assert sizes(2, 5) == (2, 3, 4, 5, 6, 8, 10)
  assert sizes(3, 1) == (3,)


def test_rows_take_consecutive_slots_and_unused_slots_point_nowhere():
  packing = Packing.of_counts(jnp.asarray([1, 5, 0, 3]), width=5, size=10)
  # Row 0 position 0; row 1 positions 0-4; row 2 nothing; row 3 positions 0-2.
  np.testing.assert_array_equal(packing.index, [0, 5, 6, 7, 8, 9, 15, 16, 17, 20])
  x = jnp.arange(20).reshape(4, 5)
  np.testing.assert_array_equal(packing.gather(x), [0, 5, 6, 7, 8, 9, 15, 16, 17, 19])
  back = packing.scatter(packing.gather(x))
  np.testing.assert_array_equal(back, jnp.where(jnp.asarray([[1, 0, 0, 0, 0],
                                                             [1, 1, 1, 1, 1],
                                                             [0, 0, 0, 0, 0],
                                                             [1, 1, 1, 0, 0]]) > 0,
                                                x, 0))


@pytest.mark.parametrize("counts, size", [((2, 4, 1), 8), ((3, 3, 3), 9), ((0, 1, 0), 3)])
def test_a_packed_score_equals_the_padded_one_where_it_computed(counts, size):
  model = tiny_model()
  config = model.config
  params = llama.for_decoding(model.params, config)
  cache = llama.forward(params, config, jnp.asarray([[1, 2, 3], [2, 3, 4], [7, 7, 1]]),
                        config.init_cache(3, 32))[1]
  tokens = jax.random.randint(jax.random.key(0), (3, 4), 0, config.vocab_size)
  full_hidden, full_new = llama.score(params, config, tokens, cache)
  packing = Packing.of_counts(jnp.asarray(counts), width=4, size=size)
  hidden, new = llama.score_packed(params, config, tokens, cache, packing)
  assert hidden.shape == (size, config.hidden_dim)
  hidden = packing.scatter(hidden)
  for row, count in enumerate(counts):
    np.testing.assert_allclose(hidden[row, :count], full_hidden[row, :count], atol=1e-5)
    for ours, theirs in zip(new.k + new.v, full_new.k + full_new.v):
      np.testing.assert_allclose(ours[row, :count], theirs[row, :count], atol=1e-5)
      assert not np.any(np.asarray(ours[row, count:]))
