"""Checkpoints: HF and GGUF loading, HF export, derived drafts and clear errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints import gguf_file, layout, loading
from osd_jax.decoding.engine import Engine
from osd_jax.models import config as configs
from osd_jax.models import llama
from tests import gguf_convert
from tests.tiny_models import random_params

TEXTS = [
    "The capital of France is Paris.",
    "Привет, мир! Как дела?",
    "你好，世界！今天天气很好。",
    "¿Dónde está la estación? Mañana en Cádiz.",
    "Emoji: 😀👍🏽 🇫🇷",
    "def f(x):\n\treturn x * 2\n",
    "Pi is 3.14159; year 2024.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

apply = jax.jit(llama.apply, static_argnames="config")


def tiny_tokenizer(vocab_size=300, corpus=TEXTS):
  """A byte-level BPE tokenizer shaped like SmolLM2's (ids 0-2 special)."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(corpus * 10, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
      unk_token=SPECIALS[0], pad_token=SPECIALS[2], chat_template=CHAT_TEMPLATE)


def tiny_model(tokenizer, seed=0, **overrides) -> loading.LoadedModel:
  # GGUF stores rms_eps as float32: start from a value that survives that.
  fields = dict(vocab_size=len(tokenizer), pad_id=2, rope_theta=1e5,
                rms_eps=float(np.float32(1e-5)))
  fields.update(overrides)
  config = configs.tiny(**fields)
  return loading.LoadedModel(config, random_params(config, seed, norm_noise=0.1), tokenizer,
                             f"tiny seed {seed}")


def logits_of(model, tokens=((5, 17, 42, 99, 3, 250, 7, 8),)):
  return np.asarray(apply(model.params, model.config, jnp.asarray(tokens))[0])


def assert_same_params(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def write_gguf(path, model, arch=None):
  """A float32 GGUF file written the way llama.cpp's converter writes one."""
  hf_dir = path + ".hf"
  loading.save_hf(model, hf_dir)
  gguf_convert.convert(hf_dir, path, model.tokenizer, pre="gpt2", arch=arch)


@pytest.fixture(scope="module")
def tokenizer():
  return tiny_tokenizer()


@pytest.fixture(scope="module")
def saved(tokenizer, tmp_path_factory):
  """A tiny untied model and the HF directory it was exported to."""
  model = tiny_model(tokenizer, tie_embeddings=False)
  path = str(tmp_path_factory.mktemp("hf") / "tiny")
  loading.save_hf(model, path)
  return model, path


def broken_copy(saved_path, tmp_path):
  path = str(tmp_path / "copy")
  shutil.copytree(saved_path, path)
  return path


def edit_config(path, **changes):
  file = os.path.join(path, "config.json")
  config = json.load(open(file))
  config.update(changes)
  json.dump(config, open(file, "w"))


# --- round trips -----------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_hf_round_trip_gives_identical_logits(tokenizer, tmp_path, tied):
  model = tiny_model(tokenizer, seed=1, tie_embeddings=tied)
  loading.save_hf(model, str(tmp_path))
  back = loading.load(str(tmp_path))
  assert back.config == model.config
  assert_same_params(back.params, model.params)
  np.testing.assert_array_equal(logits_of(back), logits_of(model))


def test_hf_export_is_a_plain_llama_checkpoint(saved):
  """Other tools read it: transformers' config and HF tensor layout."""
  model, path = saved
  hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
  assert hf.architectures == ["LlamaForCausalLM"]
  assert hf.num_key_value_heads == model.config.num_kv_heads
  tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
  np.testing.assert_array_equal(tensors["lm_head.weight"],
                                np.asarray(model.params["lm_head"]).T)
  np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"],
                                np.asarray(model.params["layers"]["wq"][1]).T)


def test_hf_round_trip_keeps_tokenizer(saved, tokenizer):
  _, path = saved
  back = loading.load(path).tokenizer
  assert back.get_vocab() == tokenizer.get_vocab()
  for text in TEXTS:
    assert back(text)["input_ids"] == tokenizer(text)["input_ids"]
  messages = [{"role": "user", "content": "Hi"}]
  assert (back.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
          == tokenizer.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=True))


def test_tokenizer_round_trip_on_multilingual_text(tokenizer):
  for text in TEXTS:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_restricted_head_draft_round_trip(tokenizer, tmp_path):
  target = tiny_model(tokenizer, seed=2, num_layers=3)
  head = draft_lib.frequent_token_ids(tokenizer, 64)
  draft = draft_lib.derive(target, [0, 2], head)
  loading.save_hf(draft, str(tmp_path))
  back = loading.load(str(tmp_path))
  assert back.config == draft.config
  assert back.config.head_token_ids == head
  np.testing.assert_array_equal(logits_of(back), logits_of(draft))
  loading.check_pair(target, back)


def test_sharded_checkpoint_loads(saved, tmp_path):
  model, path = saved
  path = broken_copy(path, tmp_path)
  tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
  os.remove(os.path.join(path, "model.safetensors"))
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  for file, part in shards.items():
    safetensors.numpy.save_file({n: tensors[n] for n in part},
                                os.path.join(path, file))
  index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
  json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
  np.testing.assert_array_equal(logits_of(loading.load(path)), logits_of(model))


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_and_hf_paths_give_same_model(tokenizer, tmp_path, tied):
  """A llama.cpp-layout GGUF (rotary rows permuted) loads to the same model."""
  model = tiny_model(tokenizer, seed=3, tie_embeddings=tied)
  write_gguf(str(tmp_path / "tiny.gguf"), model)
  loading.save_hf(model, str(tmp_path / "hf"))
  from_gguf = loading.load(str(tmp_path / "tiny.gguf"))
  from_hf = loading.load(str(tmp_path / "hf"))
  assert from_gguf.config == model.config == from_hf.config
  assert_same_params(from_gguf.params, model.params)
  np.testing.assert_array_equal(logits_of(from_gguf), logits_of(from_hf))
  loading.check_pair(from_hf, from_gguf)
  for text in TEXTS:
    assert from_gguf.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
  assert from_gguf.tokenizer.chat_template == CHAT_TEMPLATE


# --- derived drafts --------------------------------------------------------


def test_draft_with_all_layers_is_the_target(tokenizer):
  target = tiny_model(tokenizer, seed=4)
  draft = draft_lib.derive(target, range(target.config.num_layers))
  np.testing.assert_array_equal(logits_of(draft), logits_of(target))


def test_restricted_head_keeps_logits_of_its_tokens(tokenizer):
  target = tiny_model(tokenizer, seed=5, num_layers=3)
  head = np.asarray(draft_lib.frequent_token_ids(tokenizer, 40))
  full = logits_of(draft_lib.derive(target, [1]))
  cut = logits_of(draft_lib.derive(target, [1], head))
  np.testing.assert_allclose(cut[..., head], full[..., head], rtol=1e-5, atol=1e-5)
  outside = np.setdiff1d(np.arange(len(tokenizer)), head)
  np.testing.assert_array_equal(cut[..., outside], llama.MASKED_LOGIT)


def test_derived_draft_does_not_alias_target(tokenizer):
  target = tiny_model(tokenizer, seed=6)
  draft = draft_lib.derive(target, [0])
  before = np.asarray(target.params["embed"]).copy()
  draft.params["embed"] = draft.params["embed"].at[0].set(123.0)
  np.testing.assert_array_equal(target.params["embed"], before)


def test_frequent_token_ids(tokenizer):
  ids = draft_lib.frequent_token_ids(tokenizer, 50)
  assert list(ids) == sorted(set(ids))
  assert set(range(50)) <= set(ids)
  assert set(tokenizer.all_special_ids) <= set(ids)
  assert len(draft_lib.frequent_token_ids(tokenizer, 10**6)) == len(tokenizer)


@pytest.mark.parametrize("layers", [[], [-1], [0, 2], [5]])
def test_draft_layers_out_of_range(tokenizer, layers):
  target = tiny_model(tokenizer)  # 2 layers
  with pytest.raises(ValueError, match="within 0..1"):
    draft_lib.derive(target, layers)


def test_cannot_restrict_a_restricted_head(tokenizer):
  draft = draft_lib.derive(tiny_model(tokenizer), [0], [0, 1, 2, 50])
  with pytest.raises(ValueError, match="already restricted"):
    draft_lib.derive(draft, [0], [0, 1])


# --- a draft with another vocabulary ---------------------------------------


def swapped_tokenizer(tokenizer):
  """Same size, same tokens, two of them at each other's ids."""
  spec = json.loads(tokenizer.backend_tokenizer.to_str())
  vocab = spec["model"]["vocab"]
  a, b = [t for t, i in vocab.items() if i in (100, 101)]
  vocab[a], vocab[b] = vocab[b], vocab[a]
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
      bos_token=SPECIALS[1], eos_token=SPECIALS[2], pad_token=SPECIALS[2])


def test_draft_with_another_vocabulary_is_rejected(tokenizer):
  target = tiny_model(tokenizer)
  bigger = tiny_tokenizer(vocab_size=320, corpus=TEXTS + ["more words here"])
  assert len(bigger) != len(tokenizer)
  for draft in [tiny_model(bigger), tiny_model(swapped_tokenizer(tokenizer))]:
    with pytest.raises(layout.CheckpointError, match="[Dd]raft"):
      loading.check_pair(target, draft)
    with pytest.raises(layout.CheckpointError, match="[Dd]raft"):
      Engine(target, draft, k=2)


# --- clear errors ----------------------------------------------------------


def test_missing_path(tmp_path):
  with pytest.raises(layout.CheckpointError, match="not found"):
    loading.load(str(tmp_path / "nowhere"))
  with pytest.raises(layout.CheckpointError, match="not found"):
    gguf_file.read(str(tmp_path / "nowhere.gguf"))


def test_unknown_file_kind(tmp_path):
  (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
  with pytest.raises(layout.CheckpointError, match="neither"):
    loading.load(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("content", [b"GGUF\x03\x00\x00\x00" + b"\x01" * 40,
                                     b"not a gguf file at all" * 20])
def test_corrupt_gguf(tmp_path, content):
  path = tmp_path / "model.gguf"
  path.write_bytes(content)
  with pytest.raises(layout.CheckpointError, match="Cannot read GGUF"):
    loading.load(str(path))


def test_truncated_gguf(tokenizer, tmp_path):
  path = tmp_path / "model.gguf"
  write_gguf(str(path), tiny_model(tokenizer))
  path.write_bytes(path.read_bytes()[:-1000])
  with pytest.raises(layout.CheckpointError, match="Cannot read GGUF"):
    loading.load(str(path))


def test_gguf_of_another_architecture(tokenizer, tmp_path):
  path = str(tmp_path / "model.gguf")
  write_gguf(path, tiny_model(tokenizer), arch="gpt2")
  with pytest.raises(layout.CheckpointError, match="'gpt2' is not supported"):
    loading.load(path)


def _remove(path, name):
  os.remove(os.path.join(path, name))


def _corrupt(path, name):
  with open(os.path.join(path, name), "r+b") as f:
    f.write(b"\xff" * 64)


def _drop_tensor(path, name):
  file = os.path.join(path, "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  del tensors[name]
  safetensors.numpy.save_file(tensors, file)


def _index_missing_shard(path):
  json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}},
            open(os.path.join(path, "model.safetensors.index.json"), "w"))


BREAKAGES = {
    "no_config": (lambda p: _remove(p, "config.json"), "no config.json"),
    "unknown_model_type": (
        lambda p: edit_config(p, model_type="not_a_model",
                              architectures=["NotAModel"]), "not a supported"),
    "gpt2_architecture": (
        lambda p: edit_config(p, model_type="gpt2",
                              architectures=["GPT2LMHeadModel"]),
        r"\['GPT2LMHeadModel'\] is not supported"),
    "attention_bias": (lambda p: edit_config(p, attention_bias=True), "bias"),
    "no_weights": (lambda p: _remove(p, "model.safetensors"), "no .safetensors"),
    "corrupt_safetensors": (lambda p: _corrupt(p, "model.safetensors"),
                            "Cannot read"),
    "missing_shard": (_index_missing_shard, "missing"),
    "missing_tensor": (
        lambda p: _drop_tensor(p, "model.layers.1.mlp.up_proj.weight"),
        "no tensor 'model.layers.1.mlp.up_proj.weight'"),
    "wrong_shapes": (lambda p: edit_config(p, intermediate_size=48),
                     "do not match the config"),
    "no_tokenizer": (lambda p: [_remove(p, "tokenizer.json"),
                                _remove(p, "tokenizer_config.json")],
                     "cannot load its tokenizer"),
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_broken_hf_directory(saved, tmp_path, name):
  breakage, message = BREAKAGES[name]
  path = broken_copy(saved[1], tmp_path)
  breakage(path)
  with pytest.raises(layout.CheckpointError, match=message):
    loading.load(path)


# --- the real model ---------------------------------------------------------


@pytest.mark.real_model
def test_real_gguf_and_exported_hf_give_same_logits(smollm2, tmp_path):
  """GGUF -> our params -> HF directory -> our params: nothing changes."""
  loading.save_hf(smollm2, str(tmp_path))
  back = loading.load(str(tmp_path))
  assert back.config == smollm2.config
  tokens = [smollm2.tokenizer("The capital of France is")["input_ids"]]
  np.testing.assert_array_equal(logits_of(back, tokens), logits_of(smollm2, tokens))
  loading.check_pair(smollm2, back)
  # The exported tokenizer keeps SmolLM2's digit splitting and chat template.
  for text in TEXTS + ["x  1", "\t\t42", "1  2   3"]:
    assert (back.tokenizer(text)["input_ids"]
            == smollm2.tokenizer(text)["input_ids"]), text
  assert back.tokenizer.chat_template == smollm2.tokenizer.chat_template


@pytest.mark.real_model
def test_real_derived_draft(smollm2):
  head = draft_lib.frequent_token_ids(smollm2.tokenizer, 8192)
  draft = draft_lib.derive(smollm2, [0, 1], head)
  assert draft.config.num_layers == 2
  assert len(draft.config.head_token_ids) == 8192  # specials are all below 8192
  assert draft.params["lm_head"].shape == (576, 8192)
  loading.check_pair(smollm2, draft)
