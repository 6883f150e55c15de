"""Hugging Face config.json <-> LlamaConfig for the Llama family: Llama 2/3,
Mistral, Qwen2/2.5 and Qwen3.

Every field of the supported transformers config classes is either read
here (and implemented exactly, or refused in one line) or listed in
NO_MATH_FIELDS with the reason it cannot change the computation;
tests/test_families.py fails on a field that is neither.
"""

from osd_jax.checkpoints import layout
from osd_jax.models import rope
from osd_jax.models.config import LlamaConfig

# family (HF model_type) -> its architecture name.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
HEAD_IDS_KEY = "osd_head_token_ids"

# Fields read_config reads.
READ_FIELDS = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "hidden_act", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
    "max_position_embeddings", "attention_bias", "mlp_bias", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "bos_token_id",
    "eos_token_id", "pad_token_id"})
# Fields that cannot change what the model computes, and why.
NO_MATH_FIELDS = {
    "_name_or_path": "where the checkpoint came from",
    "transformers_version": "the writer's version",
    "dtype": "storage dtype; osd-jax computes in --dtype",
    "initializer_range": "random initialisation only",
    "attention_dropout": "dropout is off in serving and in distillation",
    "use_cache": "transformers' own cache switch",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
    "chunk_size_feed_forward": "chunking the MLP gives the same values",
    "pretraining_tp": "slicing the projections gives the same values",
    "is_encoder_decoder": "False for every supported (decoder-only) class",
    "id2label": "sequence-classification heads only",
    "label2id": "sequence-classification heads only",
    "problem_type": "sequence-classification heads only",
}


def from_hf(hf, raw: dict, path: str, *, param_dtype: str, dtype: str) -> LlamaConfig:
  """Our config from a transformers config object and its raw JSON."""
  family = hf.model_type
  archs = set(getattr(hf, "architectures", None) or [ARCHITECTURES.get(family)])
  if family not in ARCHITECTURES or not archs & set(ARCHITECTURES.values()):
    raise layout.CheckpointError(
        f"{path}: architecture {sorted(a for a in archs if a) or family!r} is not"
        f" supported; expected one of {sorted(ARCHITECTURES.values())}.")
  refuse = lambda why: layout.CheckpointError(f"{path}: {why}")
  if getattr(hf, "hidden_act", "silu") != "silu":
    raise refuse(f"hidden_act {hf.hidden_act!r} is not supported (only silu).")
  if getattr(hf, "mlp_bias", False):
    raise refuse("mlp_bias is not supported (no supported family uses it).")
  attention_bias = bool(getattr(hf, "attention_bias", False))
  head_ids = raw.get(HEAD_IDS_KEY)
  eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
  num_heads = hf.num_attention_heads
  return LlamaConfig(
      vocab_size=hf.vocab_size, hidden_dim=hf.hidden_size,
      num_layers=hf.num_hidden_layers, num_heads=num_heads,
      num_kv_heads=hf.num_key_value_heads or num_heads,
      head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
      mlp_dim=hf.intermediate_size, rope_theta=float(_rope(hf)["rope_theta"]),
      rope_scaling=_rope_scaling(_rope(hf), path),
      rms_eps=float(hf.rms_norm_eps),
      tie_embeddings=bool(hf.tie_word_embeddings) and head_ids is None,
      head_token_ids=tuple(head_ids) if head_ids else None,
      # Qwen2 hard-codes biases on q, k and v; Llama and Qwen3 name them.
      qkv_bias=family == "qwen2" or attention_bias,
      output_bias=family != "qwen2" and attention_bias,
      qk_norm=family == "qwen3", sliding_window=_sliding_window(hf, family),
      family=family,
      max_positions=hf.max_position_embeddings, param_dtype=param_dtype,
      dtype=dtype, bos_id=hf.bos_token_id, eos_id=eos if eos is not None else 2,
      pad_id=hf.pad_token_id if hf.pad_token_id is not None else (eos or 0))


def _rope(hf) -> dict:
  """transformers 5's rope_parameters (it folds the legacy rope_scaling in)."""
  params = dict(getattr(hf, "rope_parameters", None) or {})
  params.setdefault("rope_theta", getattr(hf, "rope_theta", 10_000.0))
  return params


def _rope_scaling(params: dict, path: str) -> rope.RopeScaling | None:
  kind = params.get("rope_type", params.get("type", "default"))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise layout.CheckpointError(
        f"{path}: partial_rotary_factor {params['partial_rotary_factor']} is not"
        " supported (RoPE over the whole head only).")
  if kind == "default":
    return None
  if kind == "linear":
    return rope.RopeScaling("linear", factor=float(params["factor"]))
  if kind == "llama3":
    return rope.RopeScaling(
        "llama3", factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_positions=int(params["original_max_position_embeddings"]))
  raise layout.CheckpointError(
      f"{path}: rope_type {kind!r} is not supported (only default, linear and"
      " llama3): it would change the output silently.")


def _sliding_window(hf, family: str) -> int | None:
  """The window, where any layer attends through one (else None)."""
  window = getattr(hf, "sliding_window", None)
  if family == "mistral":
    return window
  if family in ("qwen2", "qwen3"):
    layer_types = getattr(hf, "layer_types", None) or []
    if getattr(hf, "use_sliding_window", False) and (
        "sliding_attention" in layer_types or not layer_types):
      return window
  return None


def to_hf(config: LlamaConfig) -> dict:
  """config.json for our config, in its family's own format."""
  family = config.family
  if family not in ARCHITECTURES:
    raise layout.CheckpointError(f"Cannot export family {family!r}.")
  fields = {
      "architectures": [ARCHITECTURES[family]], "model_type": family,
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
      "intermediate_size": config.mlp_dim, "hidden_act": "silu",
      "rms_norm_eps": config.rms_eps, "rope_theta": config.rope_theta,
      "max_position_embeddings": config.max_positions,
      "tie_word_embeddings": config.tie_embeddings,
      "bos_token_id": config.bos_id, "eos_token_id": config.eos_id,
      "pad_token_id": config.pad_id, "torch_dtype": "float32",
  }
  if config.rope_scaling is not None:
    scaling = config.rope_scaling.to_hf()
    if scaling is None:
      raise layout.CheckpointError(
          "RoPE frequency divisors (a GGUF's rope_freqs) have no Hugging Face"
          " config field: export the model loaded from its HF directory.")
    fields["rope_scaling"] = scaling
  expected = {  # (qkv_bias, output_bias, qk_norm) each family can express
      "llama": {(False, False, False), (True, True, False)},
      "mistral": {(False, False, False)},
      "qwen2": {(True, False, False)},
      "qwen3": {(False, False, True), (True, True, True)}}[family]
  if (config.qkv_bias, config.output_bias, config.qk_norm) not in expected:
    raise layout.CheckpointError(
        f"A {family} config cannot express qkv_bias={config.qkv_bias},"
        f" output_bias={config.output_bias}, qk_norm={config.qk_norm}.")
  if family in ("llama", "qwen3"):
    fields.update(attention_bias=config.output_bias, mlp_bias=False)
  if family == "mistral":
    fields["sliding_window"] = config.sliding_window
  elif config.sliding_window is not None:  # qwen: every layer slides
    fields.update(use_sliding_window=True, sliding_window=config.sliding_window,
                  max_window_layers=0)
  elif family != "llama":
    fields["use_sliding_window"] = False
  if config.head_token_ids is not None:
    fields[HEAD_IDS_KEY] = list(config.head_token_ids)
  return fields
