"""The Llama model and its KV cache: cached decoding equals one full forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding.prefill import prefill
from osd_jax.models import config as configs
from osd_jax.models import kv_cache, llama
from tests.tiny_models import random_params

apply = jax.jit(llama.apply, static_argnames=("config", "window"))
prefill_jit = jax.jit(prefill, static_argnames="config")

# Compiles dominate on CPU: the tests share these configs and a few shapes.
CONFIGS = {
    "gqa": configs.tiny(),
    "mqa": configs.tiny(num_kv_heads=1, num_layers=3, head_dim=16),
    "untied": configs.tiny(tie_embeddings=False, rope_theta=1e5),
    "restricted_head": configs.tiny(tie_embeddings=False,
                                    head_token_ids=tuple(range(0, 64, 3))),
}
CACHE_SIZE = 32


def random_tokens(shape, vocab_size, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab_size, shape),
                     jnp.int32)


def full_logits(params, config, tokens_BxT):
  return np.asarray(apply(params, config, tokens_BxT)[0])


def chunked_logits(params, config, tokens_BxT, chunks):
  """Logits of tokens fed through the cache in chunks of the given sizes."""
  cache = config.init_cache(tokens_BxT.shape[0], CACHE_SIZE)
  out, start = [], 0
  for size in chunks:
    logits, cache = apply(params, config, tokens_BxT[:, start:start + size], cache)
    out.append(np.asarray(logits))
    start += size
  assert start == tokens_BxT.shape[1]
  return np.concatenate(out, axis=1), cache


assert_close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_token_by_token_equals_full_forward(name):
  config = CONFIGS[name]
  params = random_params(config)
  tokens = random_tokens((2, 12), config.vocab_size)
  cached, cache = chunked_logits(params, config, tokens, [1] * 12)
  assert_close(cached, full_logits(params, config, tokens))
  np.testing.assert_array_equal(cache.lengths, [12, 12])


def test_chunked_scoring_equals_full_forward():
  """Verification scores k+1 tokens at once after a prefix: same logits."""
  config = CONFIGS["gqa"]
  params = random_params(config, seed=1)
  tokens = random_tokens((2, 12), config.vocab_size, seed=1)
  cached, _ = chunked_logits(params, config, tokens, [4, 4, 1, 3])
  assert_close(cached, full_logits(params, config, tokens))


def test_unstacked_layers_equal_scanned_layers():
  config = CONFIGS["gqa"]
  params = random_params(config, seed=1)
  unrolled = llama.unstack_layers(params)
  assert len(unrolled["layers"]) == config.num_layers
  tokens = random_tokens((2, 12), config.vocab_size, seed=1)
  full = full_logits(params, config, tokens)
  assert_close(full_logits(unrolled, config, tokens), full)
  assert_close(chunked_logits(unrolled, config, tokens, [4, 4, 1, 3])[0], full)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decoding_layout_equals_stacked_params(name):
  """for_decoding's unstacked layers, fused projections (or not) and explicit
  (tied or cut) head: same logits."""
  config = CONFIGS[name]
  params = random_params(config, seed=4)
  fused = llama.for_decoding(params, config)
  plain = llama.for_decoding(params, config, fuse=False)
  assert {"wqkv", "w_gate_up"} <= set(fused["layers"][0]) and "wq" not in fused["layers"][0]
  assert "wqkv" not in plain["layers"][0]
  tokens = random_tokens((2, 12), config.vocab_size, seed=4)
  full = full_logits(params, config, tokens)
  for decoding in (fused, plain, llama.for_decoding(fused, config)):  # idempotent
    assert isinstance(decoding["layers"], list) and "lm_head" in decoding
    assert_close(full_logits(decoding, config, tokens), full)
    assert_close(chunked_logits(decoding, config, tokens, [5, 1, 6])[0], full)


def test_window_narrower_than_the_cache_changes_nothing():
  """Attention reading only the first `window` positions sees every valid key."""
  config = CONFIGS["gqa"]
  params = random_params(config, seed=5)
  tokens = random_tokens((2, 12), config.vocab_size, seed=5)
  _, cache = apply(params, config, tokens[:, :8], config.init_cache(2, CACHE_SIZE))
  full_cache, _ = apply(params, config, tokens[:, 8:], cache)
  windowed, cache = apply(params, config, tokens[:, 8:], cache, window=12)
  assert_close(np.asarray(windowed), np.asarray(full_cache))
  assert_close(np.asarray(windowed), full_logits(params, config, tokens)[:, 8:])
  np.testing.assert_array_equal(cache.lengths, [12, 12])


@pytest.mark.parametrize("axis", [kv_cache.KEY_POSITION_AXIS,
                                  kv_cache.VALUE_POSITION_AXIS])
@pytest.mark.parametrize("rows", [3, 40])  # per-row writes; one scatter past 32
def test_cache_write_puts_each_row_at_its_start(axis, rows):
  """Keys ([N, D, S]) and values ([N, S, D]): row b's T new entries land at
  positions starts[b]..+T-1 of its heads' rows; nothing else changes."""
  heads, t, d, size = 2, 3, 4, 16
  rng = np.random.default_rng(axis * 100 + rows)
  shape = (rows * heads, d, size) if axis == kv_cache.KEY_POSITION_AXIS else (
      rows * heads, size, d)
  store = rng.standard_normal(shape).astype(np.float32)
  new = rng.standard_normal((rows, t, heads, d)).astype(np.float32)
  starts = rng.integers(0, size - t + 1, rows)
  got = np.asarray(jax.jit(kv_cache.write, static_argnums=3)(
      jnp.asarray(store), jnp.asarray(new), jnp.asarray(starts), axis))
  want = store.copy()
  for b in range(rows):
    for h in range(heads):
      for i in range(t):
        if axis == kv_cache.KEY_POSITION_AXIS:
          want[b * heads + h, :, starts[b] + i] = new[b, i, h]
        else:
          want[b * heads + h, starts[b] + i, :] = new[b, i, h]
  np.testing.assert_array_equal(got, want)


def test_insert_row_replaces_one_row_only():
  """A one-row cache (a shorter prompt bucket) lands in its row; others untouched."""
  config = CONFIGS["gqa"]
  params = random_params(config, seed=6)
  heads = config.num_kv_heads
  _, big = chunked_logits(params, config, random_tokens((2, 12), 64, seed=6),
                          [4, 4, 4])
  prompt = random_tokens((1, 5), 64, seed=7)
  _, one = apply(params, config, prompt, config.init_cache(1, 16))
  for row in range(2):
    merged = big.insert_row(jnp.int32(row), one)
    np.testing.assert_array_equal(merged.lengths, np.where(np.arange(2) == row, 5, 12))
    mine = slice(row * heads, (row + 1) * heads)
    other = slice((1 - row) * heads, (2 - row) * heads)
    pairs = [(got, old, new, kv_cache.KEY_POSITION_AXIS)
             for got, old, new in zip(merged.k, big.k, one.k)]
    pairs += [(got, old, new, kv_cache.VALUE_POSITION_AXIS)
              for got, old, new in zip(merged.v, big.v, one.v)]
    for got, old, new, axis in pairs:
      got, old = np.asarray(got), np.asarray(old)
      np.testing.assert_array_equal(got[other], old[other])
      inserted, rest = np.arange(16), np.arange(16, got.shape[axis])
      np.testing.assert_array_equal(np.take(got[mine], inserted, axis), new)
      np.testing.assert_array_equal(np.take(got[mine], rest, axis),
                                    np.take(old[mine], rest, axis))  # stale, unread
    # Decoding on from the inserted row is decoding on from its own prompt.
    nxt = random_tokens((2, 1), 64, seed=8)
    logits, _ = apply(params, config, nxt, merged)
    sequence = jnp.concatenate([prompt[0], nxt[row]])[None]
    assert_close(np.asarray(logits[row, 0]),
                 full_logits(params, config, sequence)[0, -1])


def test_logits_are_causal():
  """Changing tokens after position t leaves the logits up to t unchanged."""
  config = CONFIGS["gqa"]
  params = random_params(config)
  tokens = random_tokens((2, 12), config.vocab_size)
  changed = tokens.at[:, 6:].set((tokens[:, 6:] + 1) % config.vocab_size)
  a, b = full_logits(params, config, tokens), full_logits(params, config, changed)
  np.testing.assert_array_equal(a[:, :6], b[:, :6])
  assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3


def pad_right(rows, pad_id):
  width = max(len(r) for r in rows)
  padded = np.full((len(rows), width), pad_id, np.int32)
  for out, row in zip(padded, rows):
    out[:len(row)] = row
  return jnp.asarray(padded), jnp.asarray([len(r) for r in rows], jnp.int32)


def test_padded_prefill_then_appends_equals_per_row_forward():
  config = CONFIGS["untied"]
  params = random_params(config, seed=2)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(3, config.vocab_size, n) for n in (2, 7, 4)]
  appended = rng.integers(3, config.vocab_size, (3, 3))
  padded, lens = pad_right(prompts, config.pad_id)
  last_logits, cache = prefill_jit(params, config, padded, lens,
                                   config.init_cache(3, CACHE_SIZE))
  steps = [np.asarray(last_logits)]
  for t in range(appended.shape[1]):
    logits, cache = apply(params, config, jnp.asarray(appended[:, t:t + 1]), cache)
    steps.append(np.asarray(logits[:, 0]))
  np.testing.assert_array_equal(cache.lengths, np.asarray(lens) + 3)
  for row, prompt in enumerate(prompts):
    sequence = jnp.asarray(np.concatenate([prompt, appended[row]]))[None]
    expected = full_logits(params, config, sequence)[0, len(prompt) - 1:]
    assert_close(np.stack([s[row] for s in steps]), expected)


def test_prefill_ignores_pad_values():
  """Whatever sits in the pad positions, valid rows see the same logits."""
  config = CONFIGS["gqa"]
  params = random_params(config)
  prompts = [np.arange(3, 8), np.arange(10, 12)]
  a, lens = pad_right(prompts, 0)
  b = a.at[1, 2:].set(63)
  out_a, _ = prefill_jit(params, config, a, lens, config.init_cache(2, CACHE_SIZE))
  out_b, _ = prefill_jit(params, config, b, lens, config.init_cache(2, CACHE_SIZE))
  np.testing.assert_array_equal(out_a, out_b)


def test_rollback_then_reappend_equals_fresh():
  """Moving lengths back forgets rejected tokens: new ones see a clean prefix."""
  config = CONFIGS["gqa"]
  params = random_params(config, seed=3)
  rng = np.random.default_rng(3)
  prefix = jnp.asarray(rng.integers(3, 64, (2, 5)), jnp.int32)
  rejected = jnp.asarray(rng.integers(3, 64, (2, 4)), jnp.int32)
  fresh_tail = jnp.asarray(rng.integers(3, 64, (2, 2)), jnp.int32)
  keep = np.array([1, 3])  # tokens of `rejected` each row keeps
  _, cache = apply(params, config, prefix, config.init_cache(2, CACHE_SIZE))
  _, cache = apply(params, config, rejected, cache)
  cache = cache.with_lengths(jnp.asarray(5 + keep))
  logits, cache = apply(params, config, fresh_tail, cache)
  np.testing.assert_array_equal(cache.lengths, 5 + keep + 2)
  sequences = [np.concatenate([prefix[row], rejected[row, :keep[row]],
                               fresh_tail[row]]) for row in range(2)]
  for row, sequence in enumerate(sequences):
    assert_close(np.asarray(logits[row]),
                 full_logits(params, config, jnp.asarray(sequence)[None])[0, -2:])
  # Every layer's valid positions hold exactly what a fresh prefill writes.
  padded, lens = pad_right(sequences, config.pad_id)
  _, fresh = prefill_jit(params, config, padded, lens,
                         config.init_cache(2, CACHE_SIZE))
  for row, n in enumerate(np.asarray(lens)):
    for got, want in zip(cache.valid_entries(row, n), fresh.valid_entries(row, n)):
      assert_close(np.asarray(got), np.asarray(want))


def test_restricted_head_masks_other_tokens():
  config = CONFIGS["restricted_head"]
  params = random_params(config)
  logits = full_logits(params, config, random_tokens((2, 12), 64))
  head = np.asarray(config.head_token_ids)
  outside = np.setdiff1d(np.arange(config.vocab_size), head)
  np.testing.assert_array_equal(logits[..., outside], llama.MASKED_LOGIT)
  probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
  np.testing.assert_array_equal(probs[..., outside], 0.0)
  np.testing.assert_allclose(probs[..., head].sum(-1), 1.0, rtol=1e-5)


def test_bfloat16_close_to_float32():
  config = CONFIGS["gqa"]
  params = random_params(config)
  tokens = random_tokens((2, 12), config.vocab_size)
  bf16 = config.replace(param_dtype="bfloat16", dtype="bfloat16")
  params_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  a = full_logits(params, config, tokens)
  b = full_logits(params_bf16, bf16, tokens)
  assert b.dtype == np.float32  # logits are float32 whatever the compute dtype
  assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
  cached, _ = chunked_logits(params_bf16, bf16, tokens, [1] * 12)
  assert np.abs(cached - b).max() < 0.05 * np.abs(a).max()


def smollm2_config():
  return configs.LlamaConfig(
      vocab_size=49152, hidden_dim=576, num_layers=30, num_heads=9,
      num_kv_heads=3, head_dim=64, mlp_dim=1536, rope_theta=1e5)


@pytest.mark.parametrize("config", [smollm2_config(), *CONFIGS.values()])
def test_num_params_matches_init_shapes(config):
  shapes = jax.eval_shape(functools.partial(llama.init_params, config),
                          jax.random.key(0))
  assert sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)) == config.num_params()


def test_smollm2_size():
  assert round(smollm2_config().num_params() / 1e6, 1) == 134.5


@pytest.mark.parametrize("changes, message", [
    (dict(num_heads=4, num_kv_heads=3), "multiple"),
    (dict(head_token_ids=(1, 2, 3)), "tied"),
    (dict(tie_embeddings=False, head_token_ids=(1, 64)), "outside"),
])
def test_bad_config_raises(changes, message):
  with pytest.raises(ValueError, match=message):
    configs.tiny(**changes)


def test_cache_beyond_context_raises():
  with pytest.raises(ValueError, match="exceeds"):
    configs.tiny(max_positions=16).init_cache(1, 17)


@pytest.mark.real_model
def test_real_model_cached_equals_full_forward(smollm2):
  config, params = smollm2.config, smollm2.params
  tokens = jnp.asarray([smollm2.tokenizer("The capital of France is")["input_ids"]
                        + [7042, 30, 198]], jnp.int32)
  full = full_logits(params, config, tokens)
  one_by_one, _ = chunked_logits(params, config, tokens, [1] * tokens.shape[1])
  scored, _ = chunked_logits(params, config, tokens, [4, 4])
  scale = np.abs(full).max()
  assert np.abs(one_by_one - full).max() < 1e-4 * scale
  assert np.abs(scored - full).max() < 1e-4 * scale
