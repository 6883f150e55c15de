"""Tokenizers: rebuilt from GGUF metadata, or read from an HF directory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from osd_jax.checkpoints import layout

# transformers is imported on first use: its import prints an advisory (no
# torch) that the entry points first decide whether to show (experiments/cli).
if TYPE_CHECKING:
  import transformers

# llama.cpp token types: 3 marks control tokens such as <|im_start|>.
_CONTROL = 3
# Pre-tokenizers by GGUF `tokenizer.ggml.pre`: a split regex run before the
# byte-level mapping (None: GPT-2's own regex inside ByteLevel), as each
# family's tokenizer.json has it. "smollm" first splits every digit apart.
_LETTERS_THEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_AFTER_DIGITS = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PRE_SPLITS = {
    "gpt2": None, "default": None, "smollm": None,
    "llama-bpe": _LETTERS_THEN + r"\p{N}{1,3}" + _AFTER_DIGITS,  # Llama 3
    "qwen2": _LETTERS_THEN + r"\p{N}" + _AFTER_DIGITS,  # Qwen2, Qwen2.5, Qwen3
}


def from_gguf_fields(fields: dict) -> transformers.PreTrainedTokenizerFast:
  """A byte-level BPE tokenizer from `tokenizer.ggml.*` metadata values."""
  import transformers  # pylint: disable=import-outside-toplevel,redefined-outer-name

  model_kind = fields.get("tokenizer.ggml.model")
  if model_kind != "gpt2":
    raise layout.CheckpointError(
        f"GGUF tokenizer model {model_kind!r} is not supported (only"
        " byte-level BPE, 'gpt2').")
  pre = fields.get("tokenizer.ggml.pre", "default")
  if pre not in _PRE_SPLITS:
    raise layout.CheckpointError(f"GGUF pre-tokenizer {pre!r} is not supported.")
  tokens = fields["tokenizer.ggml.tokens"]
  vocab = {token: i for i, token in enumerate(tokens)}
  merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  split = _PRE_SPLITS[pre]
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
  if pre == "smollm":
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif split is not None:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  specials = [t for t, kind in zip(tokens, fields["tokenizer.ggml.token_type"])
              if kind == _CONTROL]
  tok.add_special_tokens(specials)

  def token(key):
    index = fields.get(f"tokenizer.ggml.{key}_token_id")
    return None if index is None else tokens[index]

  if fields.get("tokenizer.ggml.add_bos_token") and token("bos") is not None:
    bos = token("bos")  # Llama 3 prepends <|begin_of_text|> to every text
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, vocab[bos])])

  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=token("bos"), eos_token=token("eos"),
      unk_token=token("unknown"), pad_token=token("padding") or token("eos"),
      chat_template=fields.get("tokenizer.chat_template"))


def from_hf_dir(path: str) -> transformers.PreTrainedTokenizerBase:
  """The tokenizer saved in an HF checkpoint directory (no network)."""
  import transformers  # pylint: disable=import-outside-toplevel,redefined-outer-name

  try:
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError) as e:  # no or unreadable tokenizer files
    raise layout.CheckpointError(
        f"{path}: cannot load its tokenizer (tokenizer.json expected): {e}") from e


def same_vocabulary(a, b) -> bool:
  """True when both tokenizers map every token string to the same id."""
  return len(a) == len(b) and a.get_vocab() == b.get_vocab()


def encode(tokenizer, prompts, chat: bool, source: str = "the model") -> list[list[int]]:
  """Token ids per prompt, through the chat template (one user turn) when asked."""
  if chat:
    if not tokenizer.chat_template:
      raise ValueError(f"{source} has no chat template.")
    return [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": p}], add_generation_prompt=True,
        tokenize=True, return_dict=False)) for p in prompts]
  return [tokenizer(p)["input_ids"] for p in prompts]
