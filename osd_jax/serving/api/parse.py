"""OpenAI request bodies to checked engine requests; anything off is an ApiError (4xx).

Every check the engine would otherwise trip over happens here, before a
request is queued: JSON shape, model name, parameter types and ranges,
unsupported options, empty and over-long prompts, max_tokens.
"""

import dataclasses
import json
import numbers

from osd_jax.serving.api.wire import ApiError
from osd_jax.serving.live_request import RequestParams

MAX_STOPS = 4  # as OpenAI
MAX_BODY_BYTES = 4 << 20  # far beyond any prompt a slot can hold


@dataclasses.dataclass(frozen=True)
class Limits:
  """What parsing needs to know of the server (the engine's checks are callables)."""

  model: str  # the served model name
  tokenizer: object
  vocab_size: int
  problem: object  # (prompt_len, max_tokens) -> message or None
  default_max_tokens: object  # prompt_len -> int
  temperature: float = 1.0  # defaults of requests that name none
  top_p: float = 1.0
  top_k: int = 0
  max_n: int = 1  # the most choices a request may ask for (the engine's slots)
  max_logprobs: int | None = None  # the most top log-probs (None: none kept)


@dataclasses.dataclass(frozen=True)
class Parsed:
  """A request the engine can serve, with what the HTTP side does around it."""

  prompt_ids: list[int]
  params: RequestParams
  stops: tuple[str, ...]
  stream: bool
  include_usage: bool
  n: int = 1  # independent choices, each its own engine request


# Options the server cannot honour, with the value that means "not used".
_UNSUPPORTED = {"best_of": 1, "echo": False, "suffix": None,
                "logit_bias": None, "presence_penalty": 0,
                "frequency_penalty": 0, "tools": None, "functions": None,
                "tool_choice": None, "function_call": None}


def parse(raw: bytes, limits: Limits, *, chat: bool) -> Parsed:
  """Checks a /v1/completions (chat False) or /v1/chat/completions body."""
  if len(raw) > MAX_BODY_BYTES:
    raise ApiError(413, f"The request body is over {MAX_BODY_BYTES} bytes.")
  try:
    body = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise ApiError(400, f"The request body is not valid JSON: {e}") from e
  if not isinstance(body, dict):
    raise ApiError(400, "The request body must be a JSON object.")
  model = body.get("model") or limits.model
  if model != limits.model:
    raise ApiError(404, f"The model {model!r} does not exist; this server serves"
                   f" {limits.model!r}.", param="model", code="model_not_found")
  n = _integer(body, "n", 1)
  if not 1 <= n <= limits.max_n:
    raise ApiError(400, f"n must be in [1, {limits.max_n}] (the server's slots),"
                   f" got n={n}.", param="n")
  for name, unused in _UNSUPPORTED.items():
    value = body.get(name)
    if value is not None and value != unused and value not in ({}, [], False):
      raise ApiError(400, f"{name}={value!r} is not supported by this server.",
                     param=name)
  fmt = body.get("response_format")
  if fmt is not None and fmt != {"type": "text"}:
    raise ApiError(400, "Only response_format {'type': 'text'} is supported.",
                   param="response_format")
  ids = _chat_ids(body, limits) if chat else _prompt_ids(body, limits)
  max_key = ("max_completion_tokens" if chat and body.get("max_completion_tokens")
             is not None else "max_tokens")
  prompt_problem = limits.problem(len(ids), 1)
  if prompt_problem:
    raise ApiError(400, prompt_problem, param="messages" if chat else "prompt")
  max_tokens = _integer(body, max_key, None)
  if max_tokens is None:
    max_tokens = limits.default_max_tokens(len(ids))
  problem = limits.problem(len(ids), max_tokens)
  if problem:
    raise ApiError(400, problem, param=max_key)
  temperature = _number(body, "temperature", limits.temperature)
  if not 0.0 <= temperature <= 2.0:
    raise ApiError(400, f"temperature must be in [0, 2], got {temperature}.",
                   param="temperature")
  top_p = _number(body, "top_p", limits.top_p)
  if not 0.0 < top_p <= 1.0:
    raise ApiError(400, f"top_p must be in (0, 1], got {top_p}.", param="top_p")
  top_k = _integer(body, "top_k", limits.top_k)  # vLLM's extension; -1 is off
  if top_k < -1:
    raise ApiError(400, f"top_k must be -1 (off), 0 (off) or more, got {top_k}.",
                   param="top_k")
  seed = _integer(body, "seed", None)
  stream = body.get("stream") or False
  if not isinstance(stream, bool):
    raise ApiError(400, "stream must be true or false.", param="stream")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict) or not isinstance(options.get("include_usage", False),
                                                     bool):
    raise ApiError(400, "stream_options must be {'include_usage': bool}.",
                   param="stream_options")
  params = RequestParams(max_tokens=max_tokens, temperature=temperature,
                         top_k=max(top_k, 0), top_p=top_p, seed=seed,
                         logprobs=_logprobs(body, limits, chat))
  return Parsed(ids, params, _stops(body), stream, bool(options.get("include_usage")),
                n)


# OpenAI's ranges: completions' `logprobs` is the top N, chat's `top_logprobs`.
_MOST_LOGPROBS = {False: 5, True: 20}


def _logprobs(body: dict, limits: Limits, chat: bool) -> int | None:
  """The top N log-probs a request asks for, or None if it asks for none."""
  if chat:
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
      raise ApiError(400, f"logprobs must be true or false, got {asked!r} (the"
                     " number of top tokens is top_logprobs).", param="logprobs")
    n = _integer(body, "top_logprobs", None)
    if n is not None and not asked:
      raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    if not asked:
      return None
    name, n = ("logprobs", 0) if n is None else ("top_logprobs", n)
  else:
    if body.get("top_logprobs") is not None:
      raise ApiError(400, "top_logprobs is a chat field: /v1/completions takes"
                     " logprobs N for the top N.", param="top_logprobs")
    name, n = "logprobs", _integer(body, "logprobs", None)
    if n is None:
      return None
  most = _MOST_LOGPROBS[chat]
  if not 0 <= n <= most:
    raise ApiError(400, f"{name} must be in [0, {most}], got {n}.", param=name)
  if limits.max_logprobs is None:
    raise ApiError(400, f"{name}: this server keeps no log-probs.", param=name)
  if n > limits.max_logprobs:
    raise ApiError(400, f"{name}={n} is beyond this server's max_logprobs"
                   f" ({limits.max_logprobs}).", param=name)
  return n


def _integer(body: dict, name: str, default):
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ApiError(400, f"{name} must be an integer, got {value!r}.", param=name)
  return int(value)


def _number(body: dict, name: str, default: float) -> float:
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
    raise ApiError(400, f"{name} must be a number, got {value!r}.", param=name)
  return float(value)


def _stops(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if (not isinstance(stops, list) or len(stops) > MAX_STOPS
      or not all(isinstance(s, str) for s in stops)):
    raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS}"
                   " strings.", param="stop")
  return tuple(s for s in stops if s)


def _prompt_ids(body: dict, limits: Limits) -> list[int]:
  """A string, one string in a list, token ids, or one list of token ids."""
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str):
    if not prompt:
      raise ApiError(400, "The prompt is empty.", param="prompt")
    return list(limits.tokenizer(prompt)["input_ids"])
  if isinstance(prompt, list) and prompt and all(
      isinstance(t, int) and not isinstance(t, bool) for t in prompt):
    if not all(0 <= t < limits.vocab_size for t in prompt):
      raise ApiError(400, f"Prompt token ids must be in [0, {limits.vocab_size}).",
                     param="prompt")
    return list(prompt)
  if prompt in (None, [], [[]]):
    raise ApiError(400, "The prompt is empty.", param="prompt")
  raise ApiError(400, "prompt must be a string or a list of token ids (one prompt"
                 " per request: batches of prompts are not supported).",
                 param="prompt")


# Chat roles, as the chat template knows them (OpenAI's newer "developer" is
# the system prompt).
_ROLES = {"system": "system", "developer": "system", "user": "user",
          "assistant": "assistant"}


def _chat_ids(body: dict, limits: Limits) -> list[int]:
  """The messages through the tokenizer's chat template, ready for the reply."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise ApiError(400, "messages must be a non-empty list.", param="messages")
  turns = []
  for m in messages:
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
      raise ApiError(400, "Each message needs a role: system (or developer), user or"
                     " assistant.", param="messages")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
      if not all(isinstance(p, dict) and p.get("type") == "text"
                 and isinstance(p.get("text"), str) for p in content):
        raise ApiError(400, "Only text content parts are supported.", param="messages")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise ApiError(400, "Each message's content must be a string.", param="messages")
    turns.append({"role": _ROLES[m["role"]], "content": content})
  if not any(t["content"] for t in turns):
    raise ApiError(400, "The messages are empty.", param="messages")
  tokenizer = limits.tokenizer
  if not getattr(tokenizer, "chat_template", None):
    raise ApiError(400, f"{limits.model} has no chat template: use /v1/completions.")
  try:
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
  except Exception as e:  # pylint: disable=broad-except  (a template's own raise)
    raise ApiError(400, f"The chat template rejected these messages: {e}",
                   param="messages") from e
