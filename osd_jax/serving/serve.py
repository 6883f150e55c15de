"""Serve one batch speculatively and record what distillation needs, on device."""

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding import speculative
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import teacher
from osd_jax.models.config import LlamaConfig


@flax.struct.dataclass
class Served:
  """A served batch: output tokens, where the draft was wrong, teacher top-k."""

  tokens: jax.Array  # [batch, gen_len] generated tokens (valid < lengths)
  lengths: jax.Array  # [batch]
  # Token g was a correction (draft rejected) or a bonus (all k accepted):
  # the positions the paper distils on.
  is_corrected: jax.Array  # [batch, gen_len] bool
  teacher_ids: jax.Array  # [batch, gen_len, teacher_k]
  teacher_probs: jax.Array  # [batch, gen_len, teacher_k]
  metrics: speculative.Metrics


def _scatter_rows(store_BxGx, values_BxCx, start_B, count_B):
  """store[b, start[b] + c] = values[b, c] for c < count[b] (others untouched)."""
  c = values_BxCx.shape[1]
  index = start_B[:, None] + jnp.arange(c)
  index = jnp.where(jnp.arange(c) < count_B[:, None], index, store_BxGx.shape[1])
  rows = jnp.arange(store_BxGx.shape[0])[:, None]
  return store_BxGx.at[rows, index].set(values_BxCx.astype(store_BxGx.dtype),
                                        mode="drop")


def serve_batch(target_params, draft_params, prompts_BxP, prompt_lens_B, rng, *,
                target_config: LlamaConfig, draft_config: LlamaConfig, k: int,
                sampling: Sampling, max_new_tokens: int,
                teacher_k: int) -> Served:
  """Speculative decoding of a batch until done, with per-token records."""
  batch, width = prompts_BxP.shape
  cache_size = width + max_new_tokens + k
  state = speculative.start(
      target_params, draft_params, prompts_BxP, prompt_lens_B,
      target_config.init_cache(batch, cache_size),
      draft_config.init_cache(batch, cache_size), rng,
      target_config=target_config, draft_config=draft_config, k=k,
      max_new_tokens=max_new_tokens)
  slack = max_new_tokens + k + 1
  records = dict(
      is_corrected=jnp.zeros((batch, slack), bool),
      teacher_ids=jnp.zeros((batch, slack, teacher_k), jnp.int32),
      teacher_probs=jnp.zeros((batch, slack, teacher_k), jnp.float32))

  def step(carry):
    state, records = carry
    state, result, target_logits = speculative.speculate_and_verify(
        target_params, draft_params, state, target_config=target_config,
        draft_config=draft_config, k=k, sampling=sampling)
    corrected = jnp.arange(k + 1) == result.num_accepted[:, None]
    put = lambda name, values: _scatter_rows(records[name], values,
                                             result.start, result.kept)
    records = dict(records, is_corrected=put("is_corrected", corrected))
    if teacher_k:
      # The plain softmax, whatever the serving sampler (update.teacher_probs).
      ids, probs = teacher.top_k(jax.nn.softmax(target_logits, axis=-1),
                                 teacher_k)
      records.update(teacher_ids=put("teacher_ids", ids),
                     teacher_probs=put("teacher_probs", probs))
    return state, records

  state, records = jax.lax.while_loop(lambda c: ~jnp.all(c[0].output.done),
                                      step, (state, records))
  cut = lambda x: x[:, :max_new_tokens]
  return Served(cut(state.output.tokens), state.output.lengths,
                cut(records["is_corrected"]), cut(records["teacher_ids"]),
                cut(records["teacher_probs"]), state.metrics)
