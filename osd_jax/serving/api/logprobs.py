"""A choice's log-probs in OpenAI's shapes, handed out with the text they belong to.

The engine sends each token's target log-prob and top N (vLLM's default
raw_logprobs: log_softmax of the raw logits, before temperature, top-k or
top-p). A token's entry goes out in the chunk that sends its text: text held
back (a possible stop string, half a character) holds its tokens back too.
Once the text is closed the entries cover the tokens usage counts: every
token and the EOS, or, with a stop string, those through the token that
completed it (tokens the engine made past it are dropped, as their text is).
"""

import dataclasses

from osd_jax.serving.api.text import TextStream
from osd_jax.serving.live_request import TokenLogprob

# JSON has no -inf: vLLM's floor for a log-prob that underflows.
_FLOOR = -9999.0
_CONTEXT = 4  # tokens decoded before one, so that it keeps its leading space


@dataclasses.dataclass(frozen=True)
class Entry:
  """One emitted token with its log-probs, its text and where that starts."""

  token: str
  logprob: float
  top: tuple[tuple[str, float], ...]  # the top N as text, likeliest first
  offset: int  # where the text before this token ends, in the choice's text


def _finite(logprob: float) -> float:
  return logprob if logprob >= _FLOOR else _FLOOR  # NaN too


class LogprobStream:
  """One choice's entries, released as its TextStream sends their text."""

  def __init__(self, tokenizer, text: TextStream):
    self._tokenizer, self._text = tokenizer, text
    self._ids: list[int] = []  # every token the engine sent (EOS and all)
    self._logprobs: list[TokenLogprob] = []
    self._released = 0

  def add(self, ids: list[int], logprobs: list[TokenLogprob]) -> None:
    """A token group from the engine (before the TextStream takes it)."""
    self._ids.extend(ids)
    self._logprobs.extend(logprobs)

  def take(self) -> list[Entry]:
    """The entries of tokens whose text has been sent since the last take."""
    end = self._covered()
    entries = [self._entry(i) for i in range(self._released, end)]
    self._released = max(self._released, end)
    return entries

  def _covered(self) -> int:
    """How many tokens the text sent so far accounts for."""
    text = self._text
    if text.closed:
      return min(len(self._ids), text.stop_tokens if text.stop_tokens is not None
                 else len(text.ids) + text.ended_by_eos)
    n = self._released
    while n < len(text.ids) and len(self._decode(text.ids[:n + 1])) <= len(text.text):
      n += 1
    return n

  def _entry(self, i: int) -> Entry:
    context = self._ids[max(i - _CONTEXT, 0):i]
    token_text = lambda t: self._decode(context + [t])[len(self._decode(context)):]
    lp = self._logprobs[i]
    return Entry(token_text(self._ids[i]), _finite(lp.logprob),
                 tuple((token_text(t), _finite(v)) for t, v in lp.top),
                 min(len(self._decode(self._ids[:i])), len(self._text.text)))

  def _decode(self, ids: list[int]) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=False)


def completion(entries: list[Entry]) -> dict:
  """A /v1/completions choice's `logprobs`: the top N as {text: logprob},
  with the emitted token always among them (OpenAI: up to N + 1)."""
  tops = []
  for e in entries:
    top = dict(e.top)
    top.setdefault(e.token, e.logprob)
    tops.append(top)
  return {"tokens": [e.token for e in entries],
          "token_logprobs": [e.logprob for e in entries],
          "top_logprobs": tops, "text_offset": [e.offset for e in entries]}


def chat(entries: list[Entry]) -> dict:
  """A /v1/chat/completions choice's `logprobs`: {content: [...]}."""
  item = lambda token, logprob: {"token": token, "logprob": logprob,
                                 "bytes": list(token.encode("utf-8"))}
  return {"content": [dict(item(e.token, e.logprob),
                           top_logprobs=[item(t, v) for t, v in e.top])
                      for e in entries]}
