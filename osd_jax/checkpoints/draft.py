"""A draft that shares the target's tokenizer, cut from the target itself."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

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
