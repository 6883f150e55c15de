"""Prefill: run padded prompts of different lengths through a model's cache."""

import jax
import jax.numpy as jnp

from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache


def prefill_hidden(params: llama.Params, config: LlamaConfig, prompts_BxP: jax.Array,
                   prompt_lens_B: jax.Array,
                   cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Hidden states at every prompt position [B, P, D], and the cache holding them.

  Prompts are right-padded; pad positions are written too but lie beyond the
  returned lengths, so the next append overwrites them.
  """
  hidden_BxPxD, cache = llama.forward(
      params, config, prompts_BxP,
      cache.with_lengths(jnp.zeros_like(prompt_lens_B)), cache_is_empty=True)
  return hidden_BxPxD, cache.with_lengths(prompt_lens_B)


def prefill(params: llama.Params, config: LlamaConfig, prompts_BxP: jax.Array,
            prompt_lens_B: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Logits after each row's last prompt token, and the cache holding the prompts."""
  hidden_BxPxD, cache = prefill_hidden(params, config, prompts_BxP, prompt_lens_B,
                                       cache)
  last = jnp.maximum(prompt_lens_B - 1, 0)
  hidden_BxD = jnp.take_along_axis(hidden_BxPxD, last[:, None, None], axis=1)[:, 0]
  return llama.logits(params, config, hidden_BxD), cache
