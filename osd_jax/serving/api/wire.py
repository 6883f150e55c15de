"""The OpenAI wire format: error bodies, completions, chat completions and their chunks."""

import json
import math
import time
import uuid

from osd_jax.serving.api import logprobs as logprobs_lib
from osd_jax.serving.live_request import RequestStats


class ApiError(Exception):
  """A request the server refuses, as OpenAI reports it: a status and an error body."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message = status, message
    self.param, self.code, self.kind = param, code, kind

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind,
                      "param": self.param, "code": self.code}}


def new_id(chat: bool) -> str:
  return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _finite(x: float) -> float | None:
  """JSON has no NaN: a draft gone non-finite reports null, not a broken body."""
  return x if math.isfinite(x) else None


def usage(stats: RequestStats | list[RequestStats]) -> dict:
  """OpenAI's usage, plus the request's speculative metrics; for n choices
  their sums (the prompt counted once, as OpenAI counts it)."""
  stats = combined(stats if isinstance(stats, list) else [stats])
  return {
      "prompt_tokens": stats.prompt_tokens,
      "completion_tokens": stats.completion_tokens,
      "total_tokens": stats.prompt_tokens + stats.completion_tokens,
      "alpha": _finite(stats.alpha),
      "acceptance_rate": stats.acceptance_rate,
      "mean_accepted_length": stats.mean_accepted_length,
      "num_drafts": stats.num_drafts,
      "num_draft_tokens": stats.num_draft_tokens,
      "num_accepted_tokens": stats.num_accepted_tokens,
      "num_accepted_tokens_per_pos": list(stats.accepted_per_pos),
      "target_calls": stats.target_calls,
  }


def combined(stats: list[RequestStats]) -> RequestStats:
  """The stats of n choices of one prompt as one request's."""
  first = stats[0]
  total = lambda name: sum(getattr(s, name) for s in stats)
  return RequestStats(
      prompt_tokens=first.prompt_tokens, completion_tokens=total("completion_tokens"),
      num_drafts=total("num_drafts"), num_draft_tokens=total("num_draft_tokens"),
      num_accepted_tokens=total("num_accepted_tokens"),
      accepted_per_pos=tuple(map(sum, zip(*(s.accepted_per_pos for s in stats)))),
      target_calls=total("target_calls"), alpha_sum=total("alpha_sum"),
      alpha_count=total("alpha_count"))


class Shape:
  """The response and chunk bodies of one request, completion or chat."""

  def __init__(self, model: str, chat: bool):
    self.model, self.chat = model, chat
    self.id, self.created = new_id(chat), int(time.time())

  def _envelope(self, kind: str, choices: list, **extra) -> dict:
    return {"id": self.id, "object": kind, "created": self.created,
            "model": self.model, "choices": choices, **extra}

  def logprobs(self, entries: list[logprobs_lib.Entry] | None) -> dict | None:
    """A choice's `logprobs` field (None: the request did not ask)."""
    if entries is None:
      return None
    return logprobs_lib.chat(entries) if self.chat else logprobs_lib.completion(entries)

  def response(self, texts: list[str], finish_reasons: list[str],
               stats: list[RequestStats],
               entries: list[list[logprobs_lib.Entry] | None] | None = None) -> dict:
    """The whole answer of a request that did not stream: a choice per text,
    with its log-prob entries if the request asked."""
    entries = entries or [None] * len(texts)
    if self.chat:
      choices = [{"index": i, "message": {"role": "assistant", "content": text},
                  "logprobs": self.logprobs(e), "finish_reason": reason}
                 for i, (text, reason, e) in enumerate(zip(texts, finish_reasons,
                                                           entries))]
      return self._envelope("chat.completion", choices, usage=usage(stats))
    choices = [{"index": i, "text": text, "logprobs": self.logprobs(e),
                "finish_reason": reason}
               for i, (text, reason, e) in enumerate(zip(texts, finish_reasons,
                                                         entries))]
    return self._envelope("text_completion", choices, usage=usage(stats))

  def chunk(self, text: str | None, finish_reason: str | None = None,
            first: bool = False, index: int = 0,
            entries: list[logprobs_lib.Entry] | None = None) -> dict:
    """One streamed token group (text, and the log-prob entries of its
    tokens) or the closing chunk (finish_reason) of choice `index`."""
    if self.chat:
      delta = {} if text is None else {"content": text}
      if first:
        delta["role"] = "assistant"
      choice = {"index": index, "delta": delta, "logprobs": self.logprobs(entries),
                "finish_reason": finish_reason}
      return self._envelope("chat.completion.chunk", [choice])
    choice = {"index": index, "text": text or "", "logprobs": self.logprobs(entries),
              "finish_reason": finish_reason}
    return self._envelope("text_completion", [choice])

  def usage_chunk(self, stats: list[RequestStats]) -> dict:
    """stream_options.include_usage: the last chunk, with no choices."""
    kind = "chat.completion.chunk" if self.chat else "text_completion"
    return self._envelope(kind, [], usage=usage(stats))


def sse(body: dict) -> str:
  """One server-sent event."""
  return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
