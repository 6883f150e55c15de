"""Greedy speculative decoding with n-gram lookup, replayed over known answers.

Under greedy decoding lookup's proposals depend only on the text: once the
target's answers are known, every step can be replayed without a target
pass. The lookup (NGramDraft.lookup, as served, its history ring included)
proposes, the answer says how many proposed tokens the target keeps, and the
step emits one more. One slot, requests in order, as the main job serves at
one slot; experiments.bench_lookup tunes the lookup with it.
"""

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax.decoding.drafts.base import Context
from osd_jax.decoding.drafts.ngram import History, NGramDraft


def replay(lookup: NGramDraft, answers: list[dict], k: int,
           size: int) -> list[dict]:
  """Per request: target calls, tokens, proposed and accepted, and how many
  steps proposed w tokens (`widths`), greedy, one slot of `size` positions."""
  propose = jax.jit(lookup.lookup, static_argnums=1)
  remember = jax.jit(History.remember)
  ring = lookup.init_state(1, size)
  out = []
  for request in answers:
    prompt, answer = request["prompt"], request["answer"]
    text = np.zeros((1, size), np.int32)
    text[0, :len(prompt) + len(answer)] = prompt + answer
    tokens = jnp.asarray(text)  # a lookup reads only positions < its length
    done, stats = 0, {"calls": 0, "proposed": 0, "accepted": 0, "widths": [0] * (k + 1)}
    while done < len(answer):
      ctx = Context(tokens, jnp.asarray([len(prompt) + done - 1], jnp.int32),
                    jnp.zeros((1,), jnp.int32))
      proposal, count = jax.device_get(propose(ctx, k, ring))
      count = min(int(count[0]), len(answer) - done - 1)
      accepted = 0
      while accepted < count and proposal[0, accepted] == answer[done + accepted]:
        accepted += 1
      done += accepted + 1
      stats["calls"] += 1
      stats["proposed"] += count
      stats["accepted"] += accepted
      stats["widths"][count] += 1
    out.append(dict(stats, domain=request["domain"], tokens=len(answer)))
    if lookup.history:
      ring = remember(ring, tokens[0], jnp.int32(len(prompt) + len(answer)))
  return out
