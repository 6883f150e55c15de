"""The Llama-family decoder as pure functions of (params, tokens, cache).

Layer weights are stacked on a leading axis and run with `lax.scan`, so a
30-layer model compiles as fast as a 1-layer one.
"""

import jax
import jax.numpy as jnp

from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache

Params = dict
# Logit given to tokens outside a restricted head: exp() of it is exactly 0 in
# float32 and bfloat16, yet it stays finite so 0 * log q never makes a NaN.
MASKED_LOGIT = -1e9


def init_params(config: LlamaConfig, rng: jax.Array) -> Params:
  """Random parameters (scaled normal) with the layout the loaders produce."""
  d, h, kv, hd, f, n = (config.hidden_dim, config.num_heads,
                        config.num_kv_heads, config.head_dim, config.mlp_dim,
                        config.num_layers)
  dtype = config.jnp_param_dtype
  keys = iter(jax.random.split(rng, 9))

  def normal(shape, fan_in):
    return (jax.random.normal(next(keys), shape) / jnp.sqrt(fan_in)).astype(dtype)

  params = {
      "embed": normal((config.vocab_size, d), 1.0),
      "layers": {
          "attn_norm": jnp.ones((n, d), dtype),
          "wq": normal((n, d, h * hd), d),
          "wk": normal((n, d, kv * hd), d),
          "wv": normal((n, d, kv * hd), d),
          "wo": normal((n, h * hd, d), h * hd),
          "mlp_norm": jnp.ones((n, d), dtype),
          "w_gate": normal((n, d, f), d),
          "w_up": normal((n, d, f), d),
          "w_down": normal((n, f, d), f),
      },
      "final_norm": jnp.ones((d,), dtype),
  }
  if not config.tie_embeddings:
    params["lm_head"] = normal((d, config.head_size), d)
  return params


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x_BxTxHxD: jax.Array, positions_BxT: jax.Array,
               theta: float) -> jax.Array:
  """Rotary embedding in the Hugging Face (rotate-half) layout."""
  head_dim = x_BxTxHxD.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, jnp.float32) / head_dim)
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  angles = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)[:, :, None]
  x32 = x_BxTxHxD.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x_BxTxHxD.dtype)


def _attention(q_BxTxHxD, k_new, v_new, cached_k, cached_v, lengths_B, config):
  """Grouped-query attention of T new queries over the cache plus themselves."""
  b, t, _, hd = q_BxTxHxD.shape
  groups = config.num_heads // config.num_kv_heads
  q = q_BxTxHxD.reshape(b, t, config.num_kv_heads, groups, hd)
  q = q * jnp.asarray(hd ** -0.5, q.dtype)
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  scores_new = jnp.einsum("btkgd,bskd->bkgts", q, k_new)
  scores_new = jnp.where(causal_TxT, scores_new.astype(jnp.float32), -jnp.inf)
  if cached_k is None:
    scores, values = scores_new, v_new
  else:
    is_valid_BxS = jnp.arange(cached_k.shape[1]) < lengths_B[:, None]
    scores_old = jnp.einsum("btkgd,bskd->bkgts", q, cached_k.astype(q.dtype))
    scores_old = jnp.where(is_valid_BxS[:, None, None, None],
                           scores_old.astype(jnp.float32), -jnp.inf)
    scores = jnp.concatenate([scores_old, scores_new], axis=-1)
    values = jnp.concatenate([cached_v.astype(v_new.dtype), v_new], axis=1)
  probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, values)
  return out.reshape(b, t, config.num_heads * hd)


def _layer(config: LlamaConfig, x, layer, cached_k, cached_v, positions,
           lengths):
  """One pre-norm decoder block; returns the output and this block's new K/V."""
  b, t, _ = x.shape
  dtype = x.dtype
  h = rms_norm(x, layer["attn_norm"], config.rms_eps)
  q = (h @ layer["wq"].astype(dtype)).reshape(b, t, config.num_heads, -1)
  k = (h @ layer["wk"].astype(dtype)).reshape(b, t, config.num_kv_heads, -1)
  v = (h @ layer["wv"].astype(dtype)).reshape(b, t, config.num_kv_heads, -1)
  q = apply_rope(q, positions, config.rope_theta)
  k = apply_rope(k, positions, config.rope_theta)
  attn = _attention(q, k, v, cached_k, cached_v, lengths, config)
  x = x + attn @ layer["wo"].astype(dtype)
  h = rms_norm(x, layer["mlp_norm"], config.rms_eps)
  gate = jax.nn.silu(h @ layer["w_gate"].astype(dtype))
  x = x + (gate * (h @ layer["w_up"].astype(dtype))) @ layer["w_down"].astype(dtype)
  return x, k, v


def forward(params: Params, config: LlamaConfig, tokens_BxT: jax.Array,
            cache: KVCache | None = None, *,
            cache_is_empty: bool = False) -> tuple[jax.Array, KVCache | None]:
  """Final hidden states of T new tokens and the cache with them appended.

  With a cache, token t of row b sits at position cache.lengths[b] + t and
  attends to that row's valid cache plus the new tokens up to itself; the
  returned cache holds the new keys/values and lengths advanced by T. Without
  a cache the tokens start at position 0 (training and scoring).
  `cache_is_empty` (prefill into a cache of lengths 0) skips reading the
  cache: faster, and XLA need not constant-fold attention over zeros.
  """
  t = tokens_BxT.shape[1]
  dtype = config.jnp_dtype
  x = params["embed"][tokens_BxT].astype(dtype)
  lengths = (jnp.zeros(tokens_BxT.shape[:1], jnp.int32) if cache is None
             else cache.lengths)
  positions_BxT = lengths[:, None] + jnp.arange(t)[None, :]

  def step(x, layer_and_cache):
    layer, cached_k, cached_v = layer_and_cache
    if cache_is_empty:
      cached_k = cached_v = None
    x, k, v = _layer(config, x, layer, cached_k, cached_v, positions_BxT,
                     lengths)
    return x, (k, v)

  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    # Unstacked layers (see `unstack_layers`): a Python loop, unrolled.
    new_k, new_v = [], []
    for i, layer in enumerate(layers):
      cached = (None, None) if cache is None else (cache.k[i], cache.v[i])
      x, (k, v) = step(x, (layer,) + cached)
      new_k.append(k)
      new_v.append(v)
    new_k, new_v = jnp.stack(new_k), jnp.stack(new_v)
  elif cache is None:
    x, (new_k, new_v) = jax.lax.scan(
        lambda x, layer: step(x, (layer, None, None)), x, layers)
  else:
    x, (new_k, new_v) = jax.lax.scan(step, x, (layers, cache.k, cache.v))
  new_cache = None
  if cache is not None:
    new_cache = cache.write(new_k, new_v, is_empty=cache_is_empty).with_lengths(
        cache.lengths + t)
  return rms_norm(x, params["final_norm"], config.rms_eps), new_cache


def unstack_layers(params: Params) -> Params:
  """The same weights with one array per layer: forward then loops in Python.

  On CPU a scan's per-layer dynamic slice copies the weights, so a frozen
  model decodes faster unrolled (at batch 1, 50-70 ms instead of 90-130 ms
  per SmolLM2 token), for a longer compile (~10 s instead of ~2 s).
  """
  stacked = params["layers"]
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  layers = [jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(num_layers)]
  return dict(params, layers=layers)


def head_logits(params: Params, config: LlamaConfig,
                hidden: jax.Array) -> jax.Array:
  """Logits over the head's rows (the full vocabulary unless restricted)."""
  if config.tie_embeddings:
    kernel = params["embed"].T
  else:
    kernel = params["lm_head"]
  return (hidden @ kernel.astype(hidden.dtype)).astype(jnp.float32)


def logits(params: Params, config: LlamaConfig, hidden: jax.Array) -> jax.Array:
  """Float32 logits over the full vocabulary; tokens outside the head get MASKED_LOGIT."""
  sub = head_logits(params, config, hidden)
  if config.head_token_ids is None:
    return sub
  full = jnp.full(sub.shape[:-1] + (config.vocab_size,), MASKED_LOGIT,
                  jnp.float32)
  return full.at[..., jnp.asarray(config.head_token_ids)].set(sub)


def apply(params: Params, config: LlamaConfig, tokens_BxT: jax.Array,
          cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
  """Full-vocabulary logits [B, T, V] of new tokens and the updated cache."""
  hidden, cache = forward(params, config, tokens_BxT, cache)
  return logits(params, config, hidden), cache
