"""The Llama family as users bring it: Llama 3 (RoPE scaling), Qwen2 (q/k/v
biases), Qwen3 (q/k norm, a free head_dim) and Mistral (sliding window),
against transformers' own outputs, through HF directories and GGUF files.

The fixtures (tiny random checkpoints and transformers' logits and greedy
ids) are written by tests/fixtures/make_families.py, which needs torch; these
tests do not.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from osd_jax.checkpoints import hf_config, layout, loading
from osd_jax.decoding.engine import Engine
from osd_jax.models import llama, rope
from tests import gguf_convert

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "families")
FAMILIES = ["llama3", "qwen2", "qwen2_draft", "qwen3", "mistral"]
# The config fields that set each fixture apart, as osd-jax must read them.
EXPECTED = {
    "llama3": dict(family="llama", rope_scaling=rope.RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_positions=64), tie_embeddings=False),
    "qwen2": dict(family="qwen2", qkv_bias=True, output_bias=False, tie_embeddings=True),
    "qwen2_draft": dict(family="qwen2", qkv_bias=True, num_layers=1),
    "qwen3": dict(family="qwen3", qk_norm=True, head_dim=24, hidden_dim=64),
    "mistral": dict(family="mistral", sliding_window=512),
}
ADDS_BOS = {"llama3"}
apply = jax.jit(llama.apply, static_argnames="config")


def reference(name: str) -> dict:
  with np.load(os.path.join(FIXTURES, name, "reference.npz")) as data:
    return dict(data)


def num_prompts(ref: dict) -> int:
  return sum(k.startswith("prompt_ids_") for k in ref)


@pytest.fixture(scope="module", params=["hf", "gguf"])
def loader(request, tmp_path_factory):
  """Loads a fixture family from its HF directory, or from a GGUF file written
  from that directory as llama.cpp's converter writes one."""
  def load(name: str) -> loading.LoadedModel:
    path = os.path.join(FIXTURES, name)
    if request.param == "gguf":
      out = str(tmp_path_factory.mktemp(name) / f"{name}.gguf")
      gguf_convert.convert(path, out, loading.load(path).tokenizer,
                           add_bos=name in ADDS_BOS)
      path = out
    return loading.load(path)
  load.kind = request.param
  return load


@pytest.mark.parametrize("name", FAMILIES)
def test_config_reads_what_sets_the_family_apart(name, loader):
  config = loader(name).config
  expected = dict(EXPECTED[name])
  if loader.kind == "gguf":
    if name == "llama3":  # llama.cpp stores the scaling as divisors
      expected.pop("rope_scaling")
      assert config.rope_scaling.kind == "divisors"
      np.testing.assert_allclose(
          config.inv_freq, rope.inverse_frequencies(
              16, 500000.0, EXPECTED["llama3"]["rope_scaling"]), rtol=1e-6)
    if name == "mistral":  # written as llama; GGUF has no sliding window
      expected = dict(family="llama")
  for field, value in expected.items():
    assert getattr(config, field) == value, field


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, loader):
  model, ref = loader(name), reference(name)
  for i in range(num_prompts(ref)):
    logits, _ = apply(model.params, model.config, jnp.asarray([ref[f"prompt_ids_{i}"]]))
    ours = np.asarray(logits[0])[ref[f"positions_{i}"]]
    np.testing.assert_allclose(ours, ref[f"logits_{i}"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_ids_match_transformers(name, loader):
  """Through the engine: prefill, then the cached one-token steps."""
  model, ref = loader(name), reference(name)
  n = num_prompts(ref)
  engine = Engine(model, max_new_tokens=len(ref["greedy_0"]))
  prompts = [ref[f"prompt_ids_{i}"].tolist() for i in range(n)]
  completions = engine.generate_ids(prompts)
  for i, completion in enumerate(completions):
    expected = ref[f"greedy_{i}"].tolist()
    if model.config.eos_id in expected:  # the engine stops there
      expected = expected[:expected.index(model.config.eos_id) + 1]
    assert completion.token_ids == expected, i


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_tokenizer_matches_transformers(name, loader):
  tok, ref = loader(name).tokenizer, reference(name)
  offsets = ref["text_offsets"]
  for text, a, b in zip(ref["texts"], offsets[:-1], offsets[1:]):
    assert tok(str(text))["input_ids"] == ref["text_ids_flat"][a:b].tolist(), text


# --- what is refused, in one line ---------------------------------------------


def edited_copy(name: str, tmp_path, **changes) -> str:
  path = str(tmp_path / name)
  shutil.copytree(os.path.join(FIXTURES, name), path)
  file = os.path.join(path, "config.json")
  config = json.load(open(file))
  config.update(changes)
  json.dump(config, open(file, "w"))
  return path


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unknown_rope_type_is_refused_by_name(rope_type, tmp_path):
  rope_parameters = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 1e4,
                     "original_max_position_embeddings": 256,
                     "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}
  path = edited_copy("llama3", tmp_path, rope_parameters=rope_parameters)
  with pytest.raises(layout.CheckpointError, match=f"rope_type '{rope_type}'") as e:
    loading.load(path)
  assert "\n" not in str(e.value)


def test_linear_rope_scaling_divides_every_frequency(tmp_path):
  path = edited_copy("llama3", tmp_path, rope_parameters={
      "rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0})
  config = loading.load(path).config
  plain = rope.inverse_frequencies(16, 500000.0)
  np.testing.assert_allclose(config.inv_freq, plain / 4.0, rtol=1e-7)


def test_cache_beyond_the_sliding_window_is_refused():
  model = loading.load(os.path.join(FIXTURES, "mistral"))
  model.config.init_cache(1, 512)  # within the window: fine
  with pytest.raises(ValueError, match="sliding attention window of 512"):
    model.config.init_cache(1, 1024)
  with pytest.raises(ValueError, match="sliding attention window"):
    Engine(model, max_new_tokens=8).generate_ids([[5] * 600])


def test_qwen_sliding_layers_are_refused_beyond_the_window(tmp_path):
  path = edited_copy("qwen2", tmp_path, use_sliding_window=True, sliding_window=128,
                     max_window_layers=1, layer_types=None)
  config = loading.load(path).config
  assert config.sliding_window == 128
  with pytest.raises(ValueError, match="sliding attention window of 128"):
    config.init_cache(1, 256)
  # Every layer full attention (max_window_layers = all): no window.
  path = edited_copy("qwen2", tmp_path / "full", use_sliding_window=True,
                     sliding_window=128, max_window_layers=2, layer_types=None)
  assert loading.load(path).config.sliding_window is None


def test_a_weight_the_config_does_not_declare_is_refused(tmp_path):
  """Qwen2's biases under a Llama config would be dropped: refused instead."""
  path = edited_copy("qwen2", tmp_path, model_type="llama",
                     architectures=["LlamaForCausalLM"])
  with pytest.raises(layout.CheckpointError, match="does not use"):
    loading.load(path)


@pytest.mark.parametrize("field,value", [("hidden_act", "gelu"), ("mlp_bias", True)])
def test_unsupported_fields_are_refused(field, value, tmp_path):
  path = edited_copy("llama3", tmp_path, **{field: value})
  with pytest.raises(layout.CheckpointError, match=field):
    loading.load(path)


def test_unknown_gguf_metadata_is_refused(tmp_path):
  out = str(tmp_path / "q.gguf")
  gguf_convert.convert(os.path.join(FIXTURES, "qwen2"), out,
                       loading.load(os.path.join(FIXTURES, "qwen2")).tokenizer)
  import gguf  # pylint: disable=import-outside-toplevel
  reader = gguf.GGUFReader(out)
  writer = gguf.GGUFWriter(str(tmp_path / "r.gguf"), "qwen2")
  for key, field in reader.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    writer.add_key_value(key, field.contents(), field.types[0],
                         field.types[-1] if len(field.types) > 1 else None)
  writer.add_float32("qwen2.attention.logit_softcapping", 30.0)
  for tensor in reader.tensors:
    writer.add_tensor(tensor.name, np.asarray(tensor.data))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(layout.CheckpointError, match="logit_softcapping"):
    loading.load(str(tmp_path / "r.gguf"))


# --- every config field is read or known not to matter ------------------------


@pytest.mark.parametrize("config_class", [
    transformers.LlamaConfig, transformers.MistralConfig, transformers.Qwen2Config,
    transformers.Qwen3Config])
def test_every_config_field_is_read_or_known_not_to_change_the_math(config_class):
  fields = set(config_class().to_dict())
  unaccounted = fields - hf_config.READ_FIELDS - set(hf_config.NO_MATH_FIELDS)
  assert not unaccounted, (
      f"{config_class.__name__} has fields osd-jax neither reads nor lists as"
      f" not changing the computation: {sorted(unaccounted)}")


def test_the_field_audit_fails_on_an_unlisted_field():
  """The audit above is not vacuous: a field it does not know fails it."""
  class WithExtra(transformers.LlamaConfig):
    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.logit_softcapping = 30.0
  with pytest.raises(AssertionError, match="logit_softcapping"):
    test_every_config_field_is_read_or_known_not_to_change_the_math(WithExtra)


# --- export in the family's own format ----------------------------------------


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "mistral"])
def test_export_round_trips_in_the_family_format(name, tmp_path):
  model = loading.load(os.path.join(FIXTURES, name))
  loading.save_hf(model, str(tmp_path))
  hf = transformers.AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
  assert hf.architectures == [hf_config.ARCHITECTURES[model.config.family]]
  back = loading.load(str(tmp_path))
  assert back.config == model.config
  jax.tree.map(np.testing.assert_array_equal, back.params, model.params)


def test_export_of_gguf_rope_divisors_is_refused_in_one_line(tmp_path):
  out = str(tmp_path / "l.gguf")
  path = os.path.join(FIXTURES, "llama3")
  gguf_convert.convert(path, out, loading.load(path).tokenizer, add_bos=True)
  with pytest.raises(layout.CheckpointError, match="rope_freqs"):
    loading.save_hf(loading.load(out), str(tmp_path / "export"))


def test_config_fields_change_the_output():
  """Each family field matters: dropping it changes the logits (so the
  conformance tests above could not pass by ignoring it)."""
  ids = jnp.asarray([reference("llama3")["prompt_ids_3"][:64]])
  for name, field, off in [("llama3", "rope_scaling", None),
                           ("qwen3", "qk_norm", False)]:
    model = loading.load(os.path.join(FIXTURES, name))
    params = model.params
    if field == "qk_norm":
      params = dict(params, layers={k: v for k, v in params["layers"].items()
                                    if k not in ("q_norm", "k_norm")})
    changed = dataclasses.replace(model.config, **{field: off})
    a = apply(model.params, model.config, ids)[0]
    b = apply(params, changed, ids)[0]
    assert not np.allclose(a, b, atol=1e-3), name
