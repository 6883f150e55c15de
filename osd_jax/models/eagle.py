"""The feature draft (EAGLE): one decoder block over the target's own hidden states.

At position j the draft reads the target's feature f_j (its final, normed
hidden state, the vector its head reads) and the embedding of the next
token c_{j+1}, and predicts f_{j+1}; the target's frozen head turns that
into a distribution over c_{j+2}. Verification computes the features anyway,
so drafting needs no extra target pass. Steps 2..k feed the draft its own
predicted feature: training rolls out the same way (EAGLE-3's
"training-time test"), so later steps are trained on what they will see.

Trainable: `fc` (embedding and feature -> width), one decoder block, an
output norm. Borrowed, frozen: the target's embedding and head (restricted
to `head_token_ids` when given), bound in at run time by `bind`.
"""

import dataclasses

import jax
import jax.numpy as jnp

from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
  """The draft block has the target's width, heads and rotary embedding."""

  target: LlamaConfig
  head_token_ids: tuple[int, ...] | None = None  # None: the full head

  @property
  def head_config(self) -> LlamaConfig:
    """A config whose head layout is the draft's (for full-vocabulary logits)."""
    return self.target.replace(head_token_ids=self.head_token_ids,
                               tie_embeddings=self.head_token_ids is None)

  def init_cache(self, batch_size: int, cache_size: int) -> KVCache:
    return self.target.replace(num_layers=1).init_cache(batch_size, cache_size)

  def decode_params(self) -> int:
    """What one draft step reads: fc, the block and the head's rows."""
    d = self.target.hidden_dim
    return 2 * d * d + self.head_config.replace(num_layers=1).decode_params()


def init_params(target_params: dict, target_config: LlamaConfig) -> dict:
  """fc sums the embedding and the feature; the block starts as the target's last."""
  eye = jnp.eye(target_config.hidden_dim, dtype=jnp.float32)
  layers = target_params["layers"]
  last = (layers[-1] if isinstance(layers, list)
          else jax.tree.map(lambda w: w[-1], layers))
  last = jax.tree.map(lambda w: jnp.array(w, jnp.float32), last)  # a copy
  return {"fc": jnp.concatenate([eye, eye], axis=0), "layer": last,
          "norm": jnp.array(target_params["final_norm"], jnp.float32)}


def bind(params: dict, target_params: dict, config: FeatureConfig) -> dict:
  """The trainable parameters with the target's embedding and head, frozen."""
  head = (target_params["lm_head"] if "lm_head" in target_params
          else target_params["embed"].T)
  if config.head_token_ids is not None:
    head = head[:, jnp.asarray(config.head_token_ids)]
  frozen = {name: target_params[name] for name in ("embed", "embed" + llama.WIDE)
            if name in target_params}  # the wide copy: see llama.embed_rows
  frozen["lm_head"] = head
  return dict(params, **jax.tree.map(jax.lax.stop_gradient, frozen))


def _inputs(params, tokens_BxT, features_BxTxD) -> jax.Array:
  """fc([embedding of c_{j+1}; f_j]) at every position j."""
  e = llama.embed_rows(params, tokens_BxT, jnp.float32)
  x = jnp.concatenate([e, features_BxTxD.astype(jnp.float32)], axis=-1)
  return llama.matmul(x, params["fc"])


def forward(params: dict, config: FeatureConfig, tokens_BxT, features_BxTxD,
            cache: KVCache, *, window: int | None = None,
            cache_is_empty: bool = False) -> tuple[jax.Array, KVCache]:
  """Predicted features [B, T, D] (normed, as the head reads them) and the cache.

  Token t of row b sits at position cache.lengths[b] + t (0 + t when
  `cache_is_empty`), exactly as llama.forward places it.
  """
  t = tokens_BxT.shape[1]
  lengths = jnp.zeros_like(cache.lengths) if cache_is_empty else cache.lengths
  positions = lengths[:, None] + jnp.arange(t)[None, :]
  x, (k, v) = llama.decoder_layer(
      config.target, _inputs(params, tokens_BxT, features_BxTxD), params["layer"],
      positions, (cache.k[0], cache.v[0]), None if cache_is_empty else lengths,
      None if cache_is_empty else (window or cache.size))
  cache = cache.replace(k=(k,), v=(v,), lengths=lengths + t)
  return llama.rms_norm(x, params["norm"], config.target.rms_eps), cache


def head_logits(params: dict, features) -> jax.Array:
  """Logits over the head's rows."""
  return llama.matmul(features.astype(jnp.float32), params["lm_head"])


def logits(params: dict, config: FeatureConfig, features) -> jax.Array:
  """Full-vocabulary logits; tokens outside a restricted head get MASKED_LOGIT."""
  return llama.full_vocab(config.head_config, head_logits(params, features))


def rollout(params: dict, config: FeatureConfig, tokens_NxL, features_NxLxD,
            depth: int) -> list[jax.Array]:
  """Predicted features of draft steps 1..depth at every position, cache-free.

  Level 1 reads the target's features (teacher forcing). Level s reads, at
  position j, level s-1's prediction from position j-1, and attends as step
  s of a proposal would: to level-1 entries up to j-s+1 and to the entry of
  each level i in 2..s at position j-s+i. Every level's output at j
  predicts c_{j+2}.
  """
  cfg = config.target
  n, length = tokens_NxL.shape
  positions = jnp.broadcast_to(jnp.arange(length), (n, length))
  next_tokens = jnp.pad(tokens_NxL[:, 1:], ((0, 0), (0, 1)))  # c_{j+1} at j
  features = features_NxLxD.astype(jnp.float32)
  keys, values, outputs = [], [], []
  for level in range(1, depth + 1):
    x = _inputs(params, next_tokens, features)
    q, k, v = llama.project_qkv(cfg, params["layer"], x, positions)
    keys.append(llama.flat_heads(k))
    values.append(llama.flat_heads(v))
    attn = _rollout_attend(q, keys, values, cfg.num_kv_heads)
    x = llama.block_output(cfg, params["layer"], x, attn)
    out = llama.rms_norm(x, params["norm"], cfg.rms_eps)
    outputs.append(out)
    features = jnp.pad(out[:, :-1], ((0, 0), (1, 0), (0, 0)))  # from j-1 to j
  return outputs


def _rollout_attend(q_BxTxHxD, keys, values, num_kv_heads: int) -> jax.Array:
  """Attention of the newest level (s = len(keys)) over the levels before it."""
  s = len(keys)
  b, t, h, d = q_BxTxHxD.shape
  g = h // num_kv_heads
  q = q_BxTxHxD.reshape(b, t, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4)
  q = q * jnp.asarray(d ** -0.5, q.dtype)  # [B, KV, T, G, D]
  as_rows = lambda x: x.reshape(b, num_kv_heads, t, d)  # [N, T, D] -> [B, KV, T, D]
  first = jnp.einsum("bktgd,bksd->bktgs", q, as_rows(keys[0]))
  j = jnp.arange(t)
  first = jnp.where((j[None, :] <= j[:, None] - (s - 1))[None, None, :, None, :],
                    first, -jnp.inf)
  shifted = lambda x, by: jnp.pad(x, ((0, 0), (0, 0), (by, 0), (0, 0)))[:, :, :t]
  diagonal = []  # level i's entry at position j - (s - i)
  for i in range(2, s + 1):
    key = shifted(as_rows(keys[i - 1]), s - i)
    score = jnp.einsum("bktgd,bktd->bktg", q, key)
    diagonal.append(jnp.where((j >= s - i)[None, None, :, None], score, -jnp.inf))
  scores = jnp.concatenate([first] + [x[..., None] for x in diagonal], axis=-1)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bktgs,bksd->bktgd", probs[..., :t], as_rows(values[0]))
  for i in range(2, s + 1):
    value = shifted(as_rows(values[i - 1]), s - i)
    out = out + probs[..., t + i - 2, None] * value[:, :, :, None, :]
  return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h * d)
