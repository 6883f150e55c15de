"""Decoding writes its KV cache in place: no compiled step copies a layer's cache.

A copy is silent (outputs are equal) and costly: before commit 58a31bd the
target-only step read the cache (llama.score) and wrote it after
(KVCache.append), XLA copied every layer's cache each step, and the real
target's step took 56.4 instead of 44.4 ms at batch 8 on the 2-core EPYC.
These tests read the optimized HLO for copies of cache-shaped arrays; the
last one shows the check catches that pattern.
"""

import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding import slots, speculative
from osd_jax.models import llama
from osd_jax.models.kv_cache import KVCache
from tests.test_generation import tiny_model

BATCH, CACHE, K = 4, 64, 3


def cache_copies(step, params, config) -> list[str]:
  """HLO instructions of `step(params, tokens, cache)`, compiled with the
  cache donated, that copy an array of a layer's cache shape."""
  cache = config.init_cache(BATCH, CACHE).with_lengths(jnp.full((BATCH,), 9, jnp.int32))
  tokens = jnp.ones((BATCH, K + 1), jnp.int32)
  hlo = jax.jit(step, donate_argnums=(2,)).lower(params, tokens, cache).compile().as_text()
  shapes = {",".join(map(str, x.shape)) for x in cache.k + cache.v}
  copies = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} copy\(", hlo)
  return [s for s in copies if s in shapes]


@pytest.fixture(scope="module")
def tiny():
  model = tiny_model()
  return llama.for_decoding(model.params, model.config), model.config


def test_the_target_only_step_writes_in_place(tiny):
  params, config = tiny

  def step(params, tokens, cache):
    return speculative.verify_pass(params, config, tokens[:, :1], cache, CACHE, (1,), 1)

  assert cache_copies(step, params, config) == []


def test_trimmed_verification_writes_in_place(tiny):
  params, config = tiny

  def step(params, tokens, cache):
    return speculative.verify_pass(params, config, tokens, cache, CACHE,
                                   speculative.verify_widths(K), jnp.int32(2))

  assert cache_copies(step, params, config) == []


def test_packed_verification_writes_in_place(tiny):
  params, config = tiny

  def step(params, tokens, cache):
    return speculative.verify_packed(params, config, tokens, cache, CACHE,
                                     jnp.asarray([1, 4, 0, 2], jnp.int32))

  assert cache_copies(step, params, config) == []


def test_reading_then_writing_outside_a_branch_is_caught(tiny):
  """The pattern of the old target-only step: the check sees its copies."""
  params, config = tiny

  def step(params, tokens, cache):
    hidden, new = llama.score(params, config, tokens[:, :1], cache)
    return hidden, cache.append(new, starts_B=cache.lengths)

  assert len(cache_copies(step, params, config)) >= config.num_layers


@flax.struct.dataclass
class _Slots:
  cache: KVCache
  done: jax.Array


def test_a_call_runs_its_steps_on_caches_cut_to_the_window(tiny):
  """Cutting a window out of a larger cache copies it (XLA's CPU backend), so
  slots.decode_loop cuts once a call: its steps see caches the size of the
  window, and the call leaves the cache as steps on the uncut cache do."""
  params, config = tiny
  window, seen = CACHE // 2, []
  cache = config.init_cache(BATCH, CACHE)
  keys = jax.random.split(jax.random.key(3), 2 * config.num_layers)
  cache = cache.replace(
      k=tuple(jax.random.normal(r, x.shape) for r, x in zip(keys, cache.k)),
      v=tuple(jax.random.normal(r, x.shape) for r, x in zip(keys[1::2], cache.v)),
      lengths=jnp.asarray([9, 3, 12, 1], jnp.int32))
  state = _Slots(cache, jnp.zeros((BATCH,), bool))

  def step(state, carry):
    seen.append(state.cache.size)
    tokens = (state.cache.lengths % 7 + 3)[:, None]
    _, new = llama.forward(params, config, tokens, state.cache, window=window)
    return state.replace(cache=new), carry

  run = lambda cut: slots.decode_loop(step, state, (), 4,
                                      window=window if cut else None)[0].cache
  cut, uncut = run(True), run(False)
  assert seen == [window, CACHE]
  assert cut.size == CACHE
  np.testing.assert_array_equal(cut.lengths, cache.lengths + 4)
  for a, b, before in zip(cut.k + cut.v, uncut.k + uncut.v, cache.k + cache.v):
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert not np.array_equal(a, before)  # the steps wrote
  np.testing.assert_array_equal(cut.k[0][:, :, window:], cache.k[0][:, :, window:])
