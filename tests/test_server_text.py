"""TextStream: streamed deltas add up to the whole text, stops cut it, bytes wait."""

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from osd_jax.serving.api.text import TextStream
from osd_jax.serving.live_request import (Finished, LiveRequest, RequestParams,
                                          RequestStats, Tokens)
from tests import tiny_models

EOS = 2


def _byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
  """One token per byte (byte-level BPE without merges): é takes two tokens."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _stream(tokenizer, groups, stops=()) -> tuple[list[str], TextStream]:
  text = TextStream(tokenizer, EOS, stops)
  deltas = [text.add(g) for g in groups]
  return deltas + [text.finish()], text


def test_deltas_add_up_to_the_decoded_text():
  tok = tiny_models.tokenizer()
  ids = tok("w5 w6 w7 w8 w9")["input_ids"]
  deltas, text = _stream(tok, [ids[:2], ids[2:3], ids[3:]])
  assert "".join(deltas) == tok.decode(ids) == text.text
  assert text.stop_tokens is None


def test_eos_ends_the_text_and_is_not_text():
  tok = tiny_models.tokenizer()
  ids = tok("w5 w6")["input_ids"]
  deltas, text = _stream(tok, [ids + [EOS] + ids])
  assert "".join(deltas) == "w5 w6" and text.closed


def test_a_stop_string_across_token_groups_is_held_back_then_cut():
  tok = tiny_models.tokenizer()
  ids = tok("w5 w7 w8 w9")["input_ids"]
  deltas, text = _stream(tok, [ids[:2], ids[2:]], stops=("w7 w8",))
  assert deltas[0] == "w5 "  # "w7" might begin the stop string: held back
  assert "".join(deltas) == "w5 " and text.stop_tokens == 3


def test_a_split_character_waits_for_its_last_byte():
  tok = _byte_tokenizer()
  ids = tok("café!")["input_ids"]
  assert len(ids) == 6  # é is two bytes
  deltas, _ = _stream(tok, [[i] for i in ids])
  assert "\ufffd" not in "".join(deltas) and "".join(deltas) == "café!"
  assert deltas[3] == ""  # the first byte of é alone


def test_usage_counts_through_the_stop_when_the_engine_finished_first():
  """The engine can finish a request before the handler's cancel reaches it
  (a fast speculative call emits the rest at once): usage still counts the
  tokens through the stop string, not what the engine made."""
  from osd_jax.serving.api.app import _Run  # pylint: disable=import-outside-toplevel
  tok = tiny_models.tokenizer()
  ids = tok("w5 w6 w7 w8 w9")["input_ids"]
  live = LiveRequest([1], RequestParams(max_tokens=len(ids)), lambda event: None)
  run = _Run(live, TextStream(tok, EOS, ("w7",)))
  stats = RequestStats(prompt_tokens=1, completion_tokens=len(ids), num_drafts=0,
                       num_draft_tokens=0, num_accepted_tokens=0, accepted_per_pos=(),
                       target_calls=1, alpha_sum=0.0, alpha_count=0.0)
  text = run.take(Tokens(ids)) + run.take(Finished("length", stats))
  assert text == "w5 w6 " and run.finish_reason == "stop"
  assert run.stats.completion_tokens == run.text.stop_tokens < len(ids)
  assert live.cancelled and live.tokens_used == run.text.stop_tokens
