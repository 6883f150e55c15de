"""A draft that shares the target's tokenizer: cut from the target itself, or
a pretrained model fitted to the target's vocabulary rows."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from osd_jax.checkpoints import loading
from osd_jax.checkpoints.loading import LoadedModel


def frequent_token_ids(tokenizer, size: int) -> tuple[int, ...]:
  """The `size` lowest BPE ids plus every special token.

  Byte-level BPE assigns ids in merge order and merges are learnt most
  frequent first, so low ids are a data-free stand-in for the most frequent
  tokens (on SmolLM2 the first 8,192 cover about 99 % of generated text).
  """
  specials = set(tokenizer.all_special_ids)
  specials.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
  return tuple(sorted(set(range(min(size, len(tokenizer)))) | specials))


def derive(target: LoadedModel, layers: Sequence[int],
           head_token_ids: Sequence[int] | None = None) -> LoadedModel:
  """Target embeddings, the chosen layers and the final norm; optionally a cut head."""
  num_layers = target.config.num_layers
  layers = list(layers)
  if not layers or min(layers) < 0 or max(layers) >= num_layers:
    raise ValueError(
        f"Draft layers {layers} must be non-empty and within 0..{num_layers - 1}.")
  pick = jnp.asarray(layers)
  params = {
      "embed": target.params["embed"],
      "layers": jax.tree.map(lambda w: w[pick], target.params["layers"]),
      "final_norm": target.params["final_norm"],
  }
  head = (target.params["embed"].T if target.config.tie_embeddings
          else target.params["lm_head"])
  changes = dict(num_layers=len(layers))
  if head_token_ids is not None:
    if target.config.head_token_ids is not None:
      raise ValueError("The target's head is already restricted.")
    head_token_ids = tuple(sorted(set(int(i) for i in head_token_ids)))
    params["lm_head"] = head[:, jnp.asarray(head_token_ids)]
    changes.update(tie_embeddings=False, head_token_ids=head_token_ids)
  elif not target.config.tie_embeddings:
    params["lm_head"] = head
  # A draft learns, so it keeps its weights in the compute dtype even where
  # the frozen target stores narrower ones (bfloat16 under float32).
  changes.update(param_dtype=target.config.dtype)
  config = target.config.replace(**changes)
  # Copies, so training the draft never aliases the target's buffers.
  params = jax.tree.map(lambda w: jnp.array(w, config.jnp_param_dtype), params)
  source = f"derived from {target.source}: layers {layers}" + (
      f", head {len(head_token_ids)} tokens" if head_token_ids else "")
  return LoadedModel(config, params, target.tokenizer, source)


def paired(target: LoadedModel, draft: LoadedModel) -> LoadedModel:
  """`draft` checked against the target's tokenizer and fitted to its rows."""
  loading.check_pair(target, draft)
  return fit_vocabulary(draft, target.config.vocab_size)


def fit_vocabulary(draft: LoadedModel, vocab_size: int) -> LoadedModel:
  """The draft over `vocab_size` embedding rows, the target's.

  Models of one tokenizer may pad their tables differently (Qwen2.5-0.5B
  has 151,936 rows, Qwen2.5-7B 152,064, for 151,665 tokens). The draft then
  scores only the rows both have: its head is restricted to them, so rows
  beyond its own table get probability 0 (and zero embeddings), and the rows
  beyond the target's are dropped. Rejection sampling stays exact: q is
  whatever the draft proposes from, and the residual covers the rest.
  """
  config, params = draft.config, dict(draft.params)
  if config.vocab_size == vocab_size:
    return draft
  shared = min(config.vocab_size, vocab_size)
  head = params["embed"].T if config.tie_embeddings else params["lm_head"]
  ids = config.head_token_ids or tuple(range(config.vocab_size))
  kept = [i for i, token in enumerate(ids) if token < shared]
  params["lm_head"] = jnp.array(head[:, jnp.asarray(kept)])
  embed = params["embed"][:shared]
  params["embed"] = jnp.pad(embed, ((0, vocab_size - shared), (0, 0)))
  config = config.replace(vocab_size=vocab_size, tie_embeddings=False,
                          head_token_ids=tuple(ids[i] for i in kept))
  source = f"{draft.source}, fitted from {draft.config.vocab_size} to {vocab_size} rows"
  return LoadedModel(config, params, draft.tokenizer, source)
