"""The feature draft's alpha at each proposal step, teacher-forced on known text.

Step s of a proposal reads the draft's own predicted features from steps
1..s-1 (models/eagle.py: `rollout`, whose levels equal the proposal's steps).
Scoring every level against the target at every generated position of a
served answer shows how acceptance falls with the step, without serving:
level s's alpha is what step s accepts when the tokens before it are right.
"""

import functools

import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts import FeatureDraft
from osd_jax.models import eagle, llama
from osd_jax.models.config import LlamaConfig


@functools.partial(jax.jit, static_argnames=("drafter", "target_config", "depth"))
def level_sums(draft_params, target_params, tokens_NxL, gen_start_N, weight_NxG, *,
               drafter: FeatureDraft, target_config: LlamaConfig,
               depth: int) -> jax.Array:
  """[depth, 3] sums over the generated tokens each level predicts:
  weight x alpha (sum of min(p, q)), weight x greedy agreement (the draft's
  argmax is the next token) and the weight.

  Token g of row n sits at gen_start[n] + 1 + g; level s predicts it from
  position gen_start + g - 1, and only for g >= s - 1, as in training
  (objectives: a proposal never starts inside the prompt).
  """
  hidden, _ = llama.forward(target_params, target_config, tokens_NxL)
  bound = eagle.bind(draft_params, target_params, drafter.config)
  levels = eagle.rollout(bound, drafter.config, tokens_NxL, hidden, depth)
  length = tokens_NxL.shape[1]
  g = jnp.arange(weight_NxG.shape[1])
  at = gen_start_N[:, None] + g - 1  # the position whose output predicts g
  take = lambda x, positions: jnp.take_along_axis(
      x, jnp.clip(positions, 0, length - 1)[..., None], axis=1)
  p = jax.nn.softmax(llama.logits(target_params, target_config, take(hidden, at + 1)), -1)
  support = drafter.config.head_token_ids
  if support is not None:  # q is zero elsewhere
    p = p[..., jnp.asarray(support)]
  token = jnp.take_along_axis(tokens_NxL, jnp.clip(at + 2, 0, length - 1), axis=1)
  columns = (jnp.arange(p.shape[-1]) if support is None else jnp.asarray(support))
  rows = []
  for level, out in enumerate(levels, start=1):
    logits = eagle.head_logits(bound, take(out, at))
    q = jax.nn.softmax(logits, -1)
    w = weight_NxG * (at >= 0) * (g >= level - 1)
    agree = columns[jnp.argmax(logits, -1)] == token
    rows.append(jnp.stack([(w * jnp.minimum(p, q).sum(-1)).sum(), (w * agree).sum(),
                           w.sum()]))
  return jnp.stack(rows)
