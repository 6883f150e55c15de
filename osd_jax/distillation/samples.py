"""Where training tokens come from: served output, the draft's own, or a mix.

- served: the speculative output, i.e. exact target samples, verified anyway.
- draft: the draft continues the prompt itself (on-policy, as in DistillSpec);
  the target scores every token in the same loop.
- mixed_token: each token comes from the target with probability `mix`,
  else from the draft.
- mixed_request: each request is served-sourced with probability `mix`,
  else draft-sourced.
"""

import jax
import jax.numpy as jnp

from osd_jax.decoding.output import Output
from osd_jax.decoding.prefill import prefill
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import teacher
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig

SOURCES = ("served", "draft", "mixed_token", "mixed_request")


def student_generate(target_params, draft_params, prompts_BxP, prompt_lens_B,
                     rng, *, target_config: LlamaConfig,
                     draft_config: LlamaConfig, sampling: Sampling,
                     max_new_tokens: int, teacher_mix: float, teacher_k: int):
  """Token-by-token generation from the draft (or, w.p. teacher_mix, the target).

  Returns (tokens [B, G], lengths [B], teacher ids [B, G, K], probs [B, G, K]),
  the teacher being the target's distribution at each generated position.
  """
  batch, width = prompts_BxP.shape
  cache_size = width + max_new_tokens
  rng, first_rng = jax.random.split(rng)
  target_logits, target_cache = prefill(
      target_params, target_config, prompts_BxP, prompt_lens_B,
      target_config.init_cache(batch, cache_size))
  draft_logits, draft_cache = prefill(
      draft_params, draft_config, prompts_BxP, prompt_lens_B,
      draft_config.init_cache(batch, cache_size))
  records = (jnp.zeros((batch, max_new_tokens + 1, teacher_k), jnp.int32),
             jnp.zeros((batch, max_new_tokens + 1, teacher_k), jnp.float32))

  def choose(rng, target_logits, draft_logits):
    source_rng, target_rng, draft_rng = jax.random.split(rng, 3)
    from_target = jax.random.uniform(source_rng, (batch,)) < teacher_mix
    return jnp.where(from_target, sampling.sample(target_rng, target_logits),
                     sampling.sample(draft_rng, draft_logits))

  def record(records, target_logits, output: Output):
    if not teacher_k:
      return records
    # The plain softmax, as for served samples (see update.teacher_probs).
    ids, probs = teacher.top_k(jax.nn.softmax(target_logits, axis=-1), teacher_k)
    rows = jnp.arange(batch)
    at = jnp.where(output.done, max_new_tokens + 1, output.lengths)
    return (records[0].at[rows, at].set(ids, mode="drop"),
            records[1].at[rows, at].set(probs, mode="drop"))

  output = Output.empty(batch, max_new_tokens, slack=1)
  records = record(records, target_logits, output)
  token = choose(first_rng, target_logits, draft_logits)
  output, _ = output.append(token[:, None], jnp.ones_like(token),
                            target_config.eos_id)

  def step(carry):
    output, token, target_cache, draft_cache, records, rng = carry
    rng, step_rng = jax.random.split(rng)
    was_done = output.done
    t_logits, new_target_cache = llama.apply(target_params, target_config,
                                             token[:, None], target_cache)
    d_logits, new_draft_cache = llama.apply(draft_params, draft_config,
                                            token[:, None], draft_cache)
    records = record(records, t_logits[:, 0], output)
    token = choose(step_rng, t_logits[:, 0], d_logits[:, 0])
    output, _ = output.append(token[:, None], jnp.ones_like(token),
                              target_config.eos_id)
    hold = lambda new, old: new.with_lengths(
        jnp.where(was_done, old.lengths, new.lengths))
    return (output, token, hold(new_target_cache, target_cache),
            hold(new_draft_cache, draft_cache), records, rng)

  carry = (output, token, target_cache, draft_cache, records, rng)
  output, _, _, _, records, _ = jax.lax.while_loop(
      lambda c: ~jnp.all(c[0].done), step, carry)
  cut = lambda x: x[:, :max_new_tokens]
  return cut(output.tokens), output.lengths, cut(records[0]), cut(records[1])
