"""A tiny random target/draft pair with a real tokenizer, and query data it can read.

Words "w3".."w63" are tokens 3..63, so prompts made of them tokenize one word
per token; the chat template only adds two marker tokens.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.data import common
from osd_jax.data.sources import examples_source
from osd_jax.models import config as configs
from osd_jax.models import llama

VOCAB = 64
SPECIALS = ("<pad>", "<s>", "</s>", "<user>", "<assistant>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def tokenizer() -> transformers.PreTrainedTokenizerFast:
  """Word-level: specials take ids 0-4, then "w5".."w63"."""
  vocab = {t: i for i, t in enumerate(SPECIALS)}
  vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
      pad_token="<pad>", unk_token="<pad>", chat_template=CHAT_TEMPLATE,
      additional_special_tokens=list(SPECIALS[3:]))


def word_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
  """Token i is the word "<i>": text and ids map one to one (0 pad, 1 bos, 2 eos)."""
  tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)},
                                   unk_token="<0>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<1>", eos_token="<2>", pad_token="<0>")


def random_params(config, seed: int = 0, scale: float = 1.0, norm_noise: float = 0.0):
  """init_params' layout, filled from numpy (jax's eager PRNG compiles slowly).

  Matrices are scale * N(0, 1/fan_in); norms are 1 (+ norm_noise * N(0, 1)).
  """
  shapes = jax.eval_shape(functools.partial(llama.init_params, config),
                          jax.random.key(0))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = path[-1].key
    if name.endswith("norm"):
      if not norm_noise:  # draw nothing: the same seed gives the same matrices
        return jnp.ones(leaf.shape, leaf.dtype)
      return jnp.asarray(1 + norm_noise * rng.standard_normal(leaf.shape),
                         leaf.dtype)
    fan_in = 1 if name == "embed" else leaf.shape[-2]
    return jnp.asarray(scale * rng.standard_normal(leaf.shape) / np.sqrt(fan_in),
                       leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def pair(seed: int = 0, head_vocab: int = 40) -> tuple[LoadedModel, LoadedModel]:
  """A 3-layer random target and a draft cut from its first layer, head restricted."""
  tok = tokenizer()
  # Untied head: tied random models mostly repeat their last token. EOS is an
  # id no random model picks often, so sequences run to max_new_tokens.
  config = configs.tiny(vocab_size=VOCAB, num_layers=3, tie_embeddings=False,
                        pad_id=0, bos_id=1, eos_id=2)
  target = LoadedModel(config, random_params(config, seed, scale=2.0), tok,
                       f"tiny target seed {seed}")
  draft = draft_lib.derive(target, [0],
                           draft_lib.frequent_token_ids(tok, head_vocab))
  return target, draft


def _prompt(rng: np.random.Generator, words: range, length: int) -> str:
  return " ".join(f"w{int(i)}" for i in rng.choice(words, length))


def sources(num_per_split: int = 24, seed: int = 0) -> dict:
  """In-memory sources named like the builders (math, sql, code, chat).

  Each domain draws its words from its own range, so domains differ; chat
  examples carry one of three languages so streams can route by language.
  """
  rng = np.random.default_rng(seed)
  ranges = {"math": range(5, 25), "sql": range(20, 40), "code": range(35, 55),
            "chat": range(5, 64)}
  languages = ("en", "zh", "ru")
  out = {}
  for domain, words in ranges.items():
    splits = {}
    for split in (common.TRAIN, common.EVAL):
      splits[split] = [
          common.make_example(
              id=f"{domain}-{split}-{i}",
              prompt=_prompt(rng, words, int(rng.integers(3, 10))),
              domain=domain, language=languages[i % 3] if domain == "chat" else "en",
              source="tiny")
          for i in range(num_per_split)]
    out[domain] = examples_source(splits)
  return out
