"""The distillation ring buffer against a plain Python ring, and its stated memory."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.distillation.buffer import Buffer
from osd_jax.models.kv_cache import KVCache

CAPACITY, MAX_LEN, GEN_LEN, TEACHER_K = 5, 6, 3, 2
add = jax.jit(Buffer.add)


def rows(batch, first_id):
  """A batch whose every field says which request it came from (ids first_id...)."""
  ids = np.arange(first_id, first_id + batch)
  return dict(
      tokens_BxL=np.repeat(ids[:, None], MAX_LEN, 1).astype(np.int32),
      gen_start_B=ids.astype(np.int32),
      loss_weight_BxG=np.repeat(ids[:, None], GEN_LEN, 1).astype(np.float32),
      teacher_ids_BxGxK=np.full((batch, GEN_LEN, TEACHER_K), 1, np.int32)
      * ids[:, None, None],
      teacher_probs_BxGxK=np.full((batch, GEN_LEN, TEACHER_K), 0.5, np.float32)
      * ids[:, None, None],
      category_B=(ids % 3).astype(np.int32))


class Ring:
  """The reference: a list of slots, written in order, oldest overwritten."""

  def __init__(self):
    self.slot_ids = [None] * CAPACITY
    self.next = 0
    self.added = 0

  def add(self, ids, is_new):
    for i, new in zip(ids, is_new):
      if new:
        self.slot_ids[self.next] = i
        self.next = (self.next + 1) % CAPACITY
        self.added += 1

  def check(self, buffer: Buffer):
    assert int(buffer.next_slot) == self.next
    assert int(buffer.num_added) == self.added
    valid = [i is not None for i in self.slot_ids]
    np.testing.assert_array_equal(buffer.is_valid, valid)
    for slot, i in enumerate(self.slot_ids):
      if i is None:
        continue
      expected = rows(1, i)
      assert int(buffer.gen_start[slot]) == i
      assert int(buffer.category[slot]) == i % 3
      np.testing.assert_array_equal(buffer.tokens[slot], expected["tokens_BxL"][0])
      np.testing.assert_array_equal(buffer.loss_weight[slot],
                                    expected["loss_weight_BxG"][0])
      np.testing.assert_array_equal(buffer.teacher_ids[slot],
                                    expected["teacher_ids_BxGxK"][0])
      np.testing.assert_array_equal(buffer.teacher_probs[slot],
                                    expected["teacher_probs_BxGxK"][0])


def empty():
  return Buffer.empty(CAPACITY, MAX_LEN, GEN_LEN, TEACHER_K)


def test_empty():
  buffer = empty()
  assert buffer.capacity == CAPACITY and buffer.keeps_teacher
  assert not bool(buffer.is_valid.any())
  assert int(buffer.next_slot) == 0 and int(buffer.num_added) == 0
  assert not Buffer.empty(CAPACITY, MAX_LEN, GEN_LEN, 0).keeps_teacher


def test_ring_matches_reference():
  """Consecutive slots, wrap-around, oldest overwritten, is_new False rows skipped."""
  rng = np.random.default_rng(0)
  buffer, ring, first = empty(), Ring(), 100
  for batch in (3, 2, 4, 1, 3, 4, 4, 2):
    is_new = rng.random(batch) < 0.7
    buffer = add(buffer, **rows(batch, first), is_new_B=jnp.asarray(is_new))
    ring.add(range(first, first + batch), is_new)
    ring.check(buffer)
    first += batch
  assert ring.added > CAPACITY  # it wrapped


def test_rows_not_new_are_not_written():
  buffer = add(empty(), **rows(4, 10), is_new_B=jnp.zeros(4, bool))
  for name in ("tokens", "gen_start", "loss_weight", "teacher_ids",
               "teacher_probs", "category", "is_valid"):
    np.testing.assert_array_equal(getattr(buffer, name), getattr(empty(), name))
  assert int(buffer.next_slot) == 0 and int(buffer.num_added) == 0


def test_batch_larger_than_capacity_keeps_the_newest():
  """Oldest overwritten holds within one add too: the last CAPACITY rows stay."""
  batch = CAPACITY + 3
  buffer = add(empty(), **rows(batch, 0), is_new_B=jnp.ones(batch, bool))
  ring = Ring()
  ring.add(range(batch), [True] * batch)
  ring.check(buffer)


def test_cleared_invalidates_and_keeps_position():
  buffer = add(empty(), **rows(3, 0), is_new_B=jnp.ones(3, bool))
  cleared = buffer.cleared()
  assert not bool(cleared.is_valid.any())
  assert int(cleared.next_slot) == 3 and int(cleared.num_added) == 3
  np.testing.assert_array_equal(cleared.tokens, buffer.tokens)
  again = add(cleared, **rows(1, 7), is_new_B=jnp.ones(1, bool))
  np.testing.assert_array_equal(again.is_valid, [False, False, False, True, False])
  assert int(again.gen_start[3]) == 7


def test_add_under_jit_equals_eager():
  args = dict(rows(4, 3), is_new_B=jnp.asarray([True, False, True, True]))
  eager = empty().add(**args)
  jitted = add(empty(), **args)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_array_equal(a, b)


def documented_bytes_per_sample(max_len, gen_len, teacher_k, hidden_dim=0):
  """Evaluates the formula stated in Buffer's docstring."""
  doc = " ".join(Buffer.__doc__.split())
  m = re.search(r"Memory per sample: (\d+) max_len \+ gen_len \((\d+) \+ (\d+)"
                r" teacher_k\) \+ (\d+) max_len hidden_dim \+ (\d+) bytes", doc)
  assert m, f"memory formula not found in the docstring: {doc}"
  a, b, c, h, d = map(int, m.groups())
  return a * max_len + gen_len * (b + c * teacher_k) + h * max_len * hidden_dim + d


def slot_bytes(buffer: Buffer):
  """Bytes of one slot: every field with a leading capacity axis, over capacity."""
  per_slot = [x.nbytes // buffer.capacity for x in jax.tree.leaves(buffer)
              if x.ndim and x.shape[0] == buffer.capacity]
  return sum(per_slot)


def test_documented_example_size():
  """The docstring's example: max_len 192, gen_len 64, top-32 is 17.4 KB."""
  assert documented_bytes_per_sample(192, 64, 32) / 1000 == pytest.approx(17.4, abs=0.05)


def test_documented_hidden_size():
  """The docstring's feature-draft figure: +221 KB for 192 positions of 576."""
  extra = (documented_bytes_per_sample(192, 64, 32, 576)
           - documented_bytes_per_sample(192, 64, 32))
  assert extra / 1000 == pytest.approx(221, abs=0.5)


@pytest.mark.parametrize("max_len, gen_len, teacher_k, hidden_dim", [
    (6, 3, 2, 0), (192, 64, 32, 0), (20, 8, 0, 0), (20, 8, 4, 16)])
def test_memory_per_sample_is_one_slot(max_len, gen_len, teacher_k, hidden_dim):
  make = lambda: Buffer.empty(7, max_len, gen_len, teacher_k, hidden_dim)
  buffer = jax.eval_shape(make)
  per_slot = sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize
                 for x in jax.tree.leaves(buffer) if x.ndim and x.shape[0] == 7)
  assert per_slot == slot_bytes(make())
  assert documented_bytes_per_sample(max_len, gen_len, teacher_k,
                                     hidden_dim) == per_slot


# A model draft's prompt keys and values, kept from serving ---------------------

def random_cache(batch, heads=2, head_dim=4, size=9, layers=2, seed=0):
  rng = np.random.default_rng(seed)
  draw = lambda shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return KVCache(k=tuple(draw((batch * heads, head_dim, size)) for _ in range(layers)),
                 v=tuple(draw((batch * heads, size, head_dim)) for _ in range(layers)),
                 lengths=jnp.full((batch,), size, jnp.int32))


def test_a_kept_prompt_cache_comes_back_as_the_rows_cache():
  """Each added row's cache (cut to max_len) is stored in its slot; prompt_cache
  gives it back padded, with the sample's gen_start as its length."""
  cache = random_cache(3)
  buffer = empty_keeping(cache)
  batch = rows(3, 1)
  is_new = jnp.asarray([True, False, True])
  buffer = add(buffer, **batch, is_new_B=is_new, prompt_cache=cache)
  back = buffer.prompt_cache(MAX_LEN + 4)
  assert back.size == MAX_LEN + 4
  np.testing.assert_array_equal(back.lengths, buffer.gen_start)
  for slot, row in ((0, 0), (1, 2)):
    np.testing.assert_array_equal(
        jnp.stack(back.valid_entries(slot, MAX_LEN)),
        jnp.stack(cache.valid_entries(row, MAX_LEN)))
  cut = buffer.truncated(4).prompt_cache(5)
  np.testing.assert_array_equal(jnp.stack(cut.valid_entries(1, 4)),
                                jnp.stack(cache.valid_entries(2, 4)))


def test_a_buffer_keeping_prompts_refuses_rows_without_them():
  with pytest.raises(ValueError, match="draft's cache"):
    empty_keeping(random_cache(1)).add(**rows(1, 0), is_new_B=jnp.ones(1, bool))


def test_kept_prompt_bytes_per_sample():
  """Buffer's docstring: 1.57 MB at max_len 512 for SmolLM2's 2-layer float32
  draft (3 kv heads of 64)."""
  template = jax.eval_shape(lambda: random_cache(1, heads=3, head_dim=64, size=512))
  per_slot = lambda buffer: sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize
                                for x in jax.tree.leaves(buffer) if x.shape[:1] == (7,))
  shapes = lambda cache: jax.eval_shape(
      lambda: Buffer.empty(7, 512, 64, 32, prompt_cache=cache))
  assert per_slot(shapes(template)) - per_slot(shapes(None)) == 1_572_864
  assert "1.57 MB at max_len 512" in " ".join(Buffer.__doc__.split())


def empty_keeping(cache):
  return Buffer.empty(CAPACITY, MAX_LEN, GEN_LEN, TEACHER_K, prompt_cache=cache)
