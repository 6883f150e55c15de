"""Hugging Face tensor names <-> our stacked parameter tree (one mapping, both ways)."""

import jax.numpy as jnp
import numpy as np

from osd_jax.errors import UserError
from osd_jax.models import llama
from osd_jax.models.config import LlamaConfig

# Our per-layer name -> Hugging Face name inside `model.layers.{i}.`.
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
# The same for the weights only some families have (see LlamaConfig).
BIAS_NAMES = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
              "bv": "self_attn.v_proj.bias"}
OUTPUT_BIAS_NAMES = {"bo": "self_attn.o_proj.bias"}
QK_NORM_NAMES = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


class CheckpointError(UserError, ValueError):
  """A checkpoint that is missing, corrupt or of an unsupported kind."""


def layer_names(config: LlamaConfig) -> dict[str, str]:
  """Our per-layer names -> HF names, for the weights `config` has."""
  return {**LAYER_NAMES, **(BIAS_NAMES if config.qkv_bias else {}),
          **(OUTPUT_BIAS_NAMES if config.output_bias else {}),
          **(QK_NORM_NAMES if config.qk_norm else {})}


def params_from_hf(tensors: dict[str, np.ndarray], config: LlamaConfig) -> dict:
  """Stacks HF-layout tensors ([out, in] linears) into our tree ([in, out])."""
  dtype = config.jnp_param_dtype

  def get(name):
    if name not in tensors:
      raise CheckpointError(f"Checkpoint has no tensor {name!r}.")
    return np.asarray(tensors[name], np.float32)

  names = layer_names(config)
  used = {f"model.layers.{i}.{theirs}" for i in range(config.num_layers)
          for theirs in names.values()}
  # A weight the config does not account for (a bias it does not declare)
  # would be dropped: refuse. Older exports keep RoPE's buffer; it is derived.
  unused = sorted(n for n in tensors if n.startswith("model.layers.")
                  and n not in used and not n.endswith("rotary_emb.inv_freq"))
  if unused:
    raise CheckpointError(
        f"Checkpoint has {len(unused)} layer tensors its config does not use,"
        f" e.g. {unused[0]!r}.")
  layers = {}
  for ours, theirs in names.items():
    per_layer = [get(f"model.layers.{i}.{theirs}") for i in range(config.num_layers)]
    stacked = np.stack(per_layer)
    layers[ours] = stacked if stacked.ndim == 2 else stacked.swapaxes(1, 2)
  params = {"embed": get(EMBED), "layers": layers,
            "final_norm": get(FINAL_NORM)}
  if not config.tie_embeddings:
    head = get(LM_HEAD) if LM_HEAD in tensors else get(EMBED)
    if config.head_token_ids is not None and head.shape[0] == config.vocab_size:
      head = head[np.asarray(config.head_token_ids)]
    params["lm_head"] = head.T
  expected = config.num_params()
  got = sum(np.size(x) for x in _leaves(params))
  if got != expected:
    raise CheckpointError(
        f"Tensor shapes do not match the config: {got} parameters, expected"
        f" {expected}.")
  return _cast(params, dtype)


def params_to_hf(params: dict, config: LlamaConfig) -> dict[str, np.ndarray]:
  """Our tree back to HF names and [out, in] layout, as float32 numpy."""
  tensors = {EMBED: np.asarray(params["embed"], np.float32),
             FINAL_NORM: np.asarray(params["final_norm"], np.float32)}
  layers = llama.unstack_layers(params)["layers"]  # from either layout
  for ours, theirs in layer_names(config).items():
    for i in range(config.num_layers):
      w = np.asarray(layers[i][ours], np.float32)
      tensors[f"model.layers.{i}.{theirs}"] = w if w.ndim == 1 else w.T.copy()
  if not config.tie_embeddings:
    head = np.asarray(params["lm_head"], np.float32).T
    if config.head_token_ids is not None:
      # Plain Llama has no restricted head: rows outside it are zero, the ids
      # go into config.json (our loader reads them back exactly) and the rest
      # into generation_config.json's suppress_tokens (hf_dir).
      full = np.zeros((config.vocab_size, config.hidden_dim), np.float32)
      full[np.asarray(config.head_token_ids)] = head
      head = full
    tensors[LM_HEAD] = head
  # safetensors.numpy writes an array's raw buffer whatever its strides, so a
  # transposed view would be saved scrambled: hand it C-contiguous arrays only.
  return {name: np.ascontiguousarray(w) for name, w in tensors.items()}


def _leaves(tree):
  if isinstance(tree, dict):
    for value in tree.values():
      yield from _leaves(value)
  else:
    yield tree


def _cast(tree, dtype):
  if isinstance(tree, dict):
    return {k: _cast(v, dtype) for k, v in tree.items()}
  return jnp.asarray(tree, dtype)
