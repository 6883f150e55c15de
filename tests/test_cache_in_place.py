"""Decoding writes its KV cache in place: no compiled step copies a layer's cache.

A copy is silent (outputs are equal) and costly: before commit 58a31bd the
target-only step read the cache (llama.score) and wrote it after
(KVCache.append), XLA copied every layer's cache each step, and the real
target's step took 56.4 instead of 44.4 ms at batch 8 on the 2-core EPYC.
These tests read the optimized HLO for copies of cache-shaped arrays; the
last one shows the check catches that pattern.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from osd_jax.decoding import speculative
from osd_jax.models import llama
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
