"""Target-only decoding as one jitted on-device loop (the baseline to beat)."""

import functools

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding.output import Output
from osd_jax.decoding.prefill import prefill
from osd_jax.decoding.sampling import Sampling
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig
from osd_jax.models.kv_cache import KVCache


@flax.struct.dataclass
class DecodeState:
  cache: KVCache
  output: Output
  last_token: jax.Array  # [batch] int32, emitted but not yet in the cache
  rng: jax.Array


@functools.partial(jax.jit, static_argnames=("config", "sampling", "max_new_tokens"),
                   donate_argnames=("cache",))
def generate(params: llama.Params, prompts_BxP: jax.Array,
             prompt_lens_B: jax.Array, cache: KVCache, rng: jax.Array, *,
             config: LlamaConfig, sampling: Sampling,
             max_new_tokens: int) -> tuple[Output, KVCache]:
  """Decodes until every row hit EOS or max_new_tokens; one compiled program."""
  rng, first_rng = jax.random.split(rng)
  logits_BxV, cache = prefill(params, config, prompts_BxP, prompt_lens_B, cache)
  first = sampling.sample(first_rng, logits_BxV)
  output = Output.empty(prompts_BxP.shape[0], max_new_tokens, slack=1)
  output, _ = output.append(first[:, None], jnp.ones_like(first), config.eos_id)

  def step(state: DecodeState) -> DecodeState:
    rng, step_rng = jax.random.split(state.rng)
    logits, cache = llama.apply(params, config, state.last_token[:, None],
                                state.cache)
    token = sampling.sample(step_rng, logits[:, 0])
    was_done = state.output.done
    output, _ = state.output.append(token[:, None], jnp.ones_like(token),
                                    config.eos_id)
    # Finished rows keep their cache length, so the cache never overflows.
    cache = cache.with_lengths(jnp.where(was_done, state.cache.lengths,
                                         cache.lengths))
    return DecodeState(cache, output, token, rng)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.output.done), step,
                             DecodeState(cache, output, first, rng))
  return state.output, state.cache
