"""The OpenAI wire format: error bodies, completions, chat completions and their chunks."""

import json
import math
import time
import uuid

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


def usage(stats: RequestStats) -> dict:
  """OpenAI's usage, plus the request's speculative metrics."""
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


class Shape:
  """The response and chunk bodies of one request, completion or chat."""

  def __init__(self, model: str, chat: bool):
    self.model, self.chat = model, chat
    self.id, self.created = new_id(chat), int(time.time())

  def _envelope(self, kind: str, choices: list, **extra) -> dict:
    return {"id": self.id, "object": kind, "created": self.created,
            "model": self.model, "choices": choices, **extra}

  def response(self, text: str, finish_reason: str, stats: RequestStats) -> dict:
    """The whole answer of a request that did not stream."""
    if self.chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish_reason}
      return self._envelope("chat.completion", [choice], usage=usage(stats))
    choice = {"index": 0, "text": text, "logprobs": None,
              "finish_reason": finish_reason}
    return self._envelope("text_completion", [choice], usage=usage(stats))

  def chunk(self, text: str | None, finish_reason: str | None = None,
            first: bool = False) -> dict:
    """One streamed token group (text) or the closing chunk (finish_reason)."""
    if self.chat:
      delta = {} if text is None else {"content": text}
      if first:
        delta["role"] = "assistant"
      choice = {"index": 0, "delta": delta, "logprobs": None,
                "finish_reason": finish_reason}
      return self._envelope("chat.completion.chunk", [choice])
    choice = {"index": 0, "text": text or "", "logprobs": None,
              "finish_reason": finish_reason}
    return self._envelope("text_completion", [choice])

  def usage_chunk(self, stats: RequestStats) -> dict:
    """stream_options.include_usage: the last chunk, with no choices."""
    kind = "chat.completion.chunk" if self.chat else "text_completion"
    return self._envelope(kind, [], usage=usage(stats))


def sse(body: dict) -> str:
  """One server-sent event."""
  return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
