"""The HTTP shell: OpenAI routes over the live engine.

Handlers parse and check a request, queue it, and turn the engine's events
into a response or a stream of server-sent events; they never touch device
arrays. The engine hands events over with `call_soon_threadsafe` onto an
unbounded queue (a request holds at most max_tokens tokens), so a slow
client never makes the engine wait. A client that goes away cancels its
request, and the engine frees its slot at its next turn.
"""

import asyncio
import contextlib
import dataclasses
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from osd_jax.serving.api import wire
from osd_jax.serving.api.logprobs import Entry, LogprobStream
from osd_jax.serving.api.parse import Limits, Parsed, parse
from osd_jax.serving.api.text import TextStream
from osd_jax.serving.api.wire import ApiError
from osd_jax.serving.live import EngineUnavailable, LiveEngine
from osd_jax.serving.live_request import Failed, Finished, LiveRequest, Tokens

_DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks its client


class _Channel:
  """Engine events of choice `index` onto the request's asyncio queue (shared
  by its n choices) as (index, event); called on the engine thread."""

  def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue,
               index: int = 0):
    self.loop, self.queue, self.index = loop, queue, index

  def __call__(self, event) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
      self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, event))


class _Run:
  """One request from its handler's side: text so far, its log-probs if it
  asked, and how it ended."""

  def __init__(self, live: LiveRequest, text: TextStream,
               logprobs: LogprobStream | None = None):
    self.live, self.text, self.logprobs = live, text, logprobs
    self.finish_reason: str | None = None
    self.stats = None

  def released(self) -> list[Entry] | None:
    """Log-prob entries of the tokens whose text went out since the last
    call (None: the request did not ask)."""
    return None if self.logprobs is None else self.logprobs.take()

  def take(self, event) -> str:
    """The text an event settles; raises ApiError if the engine failed the request."""
    if isinstance(event, Failed):
      raise ApiError(503, event.message, kind="server_error")
    if isinstance(event, Tokens):
      if self.logprobs is not None:
        self.logprobs.add(event.ids, event.logprobs)
      delta = self.text.add(event.ids)
      if self.text.stop_tokens is not None and not self.live.cancelled:
        self.live.cancel(self.text.stop_tokens)  # the slot can go
      return delta
    assert isinstance(event, Finished)
    delta = self.text.finish()
    self.stats = event.stats
    if self.text.stop_tokens is not None:
      # The engine may have finished the request before the cancel reached it.
      self.stats = dataclasses.replace(self.stats, completion_tokens=min(
          self.stats.completion_tokens, self.text.stop_tokens))
    self.finish_reason = ("stop" if self.text.stop_tokens is not None
                          or event.reason == "eos" else "length")
    return delta


class _EventStream(StreamingResponse):
  """A stream that cancels its request however it ends (done, client gone, shutdown)."""

  def __init__(self, content, on_close):
    super().__init__(content, media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache"})
    self._on_close = on_close

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      self._on_close()


def _error(error: ApiError) -> JSONResponse:
  return JSONResponse(error.body(), status_code=error.status)


def make_app(engine: LiveEngine, limits: Limits) -> Starlette:
  """The Starlette app; its shutdown stops the engine (checkpoint and export)."""
  eos_id = engine.target.config.eos_id

  async def generate(request: Request, chat: bool):
    try:
      parsed = parse(await request.body(), limits, chat=chat)
    except ApiError as e:
      return _error(e)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    runs = []

    def cancel_all():
      for run in runs:
        run.live.cancel()

    for i in range(parsed.n):  # n choices: n engine requests, independent draws
      params = parsed.params
      if params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + i)
      live = LiveRequest(parsed.prompt_ids, params, _Channel(loop, queue, i))
      try:
        engine.submit(live)
      except EngineUnavailable as e:
        cancel_all()
        return _error(ApiError(503, str(e), kind="server_error"))
      text = TextStream(limits.tokenizer, eos_id, parsed.stops)
      runs.append(_Run(live, text, None if params.logprobs is None else
                       LogprobStream(limits.tokenizer, text)))
    shape = wire.Shape(limits.model, chat)
    if parsed.stream:
      return _EventStream(_stream(runs, queue, shape, parsed), cancel_all)
    return await _whole(request, runs, queue, shape)

  async def completions(request: Request):
    return await generate(request, chat=False)

  async def chat_completions(request: Request):
    return await generate(request, chat=True)

  async def models(request: Request):
    del request
    return JSONResponse({"object": "list", "data": [{
        "id": limits.model, "object": "model", "created": int(time.time()),
        "owned_by": "osd-jax", "max_model_len": engine.cfg.cache_size}]})

  async def health(request: Request):
    del request
    if engine.healthy:
      return JSONResponse({"status": "ok"})
    # vLLM's convention: 503 until the engine takes requests.
    status = "starting" if engine.starting else engine.failure or "stopped"
    return JSONResponse({"status": status}, status_code=503)

  async def metrics(request: Request):
    del request
    return PlainTextResponse(engine.metrics.render(),
                             media_type="text/plain; version=0.0.4")

  async def export_draft(request: Request):
    raw = await request.body()
    try:
      body = json.loads(raw) if raw.strip() else {}
      name = body.get("name") if isinstance(body, dict) else None
    except ValueError:
      return _error(ApiError(400, "The request body is not valid JSON."))
    if name is not None and not isinstance(name, str):
      return _error(ApiError(400, "name must be a string.", param="name"))
    try:
      path = await asyncio.wrap_future(engine.export(name))
    except ValueError as e:
      return _error(ApiError(400, str(e), param="name"))
    except EngineUnavailable as e:
      return _error(ApiError(400 if engine.healthy else 503, str(e)))
    return JSONResponse({"object": "draft.export", "path": path})

  async def not_found(request: Request, exc: HTTPException):
    del request
    return _error(ApiError(exc.status_code, exc.detail or "Not found.",
                           code="not_found" if exc.status_code == 404 else None))

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    yield
    # uvicorn got here after in-flight requests finished (or the graceful
    # shutdown timed out): the engine fails what is left and checkpoints.
    await asyncio.to_thread(engine.stop)

  routes = [
      Route("/v1/completions", completions, methods=["POST"]),
      Route("/v1/chat/completions", chat_completions, methods=["POST"]),
      Route("/v1/models", models, methods=["GET"]),
      Route("/v1/draft/export", export_draft, methods=["POST"]),
      Route("/health", health, methods=["GET"]),
      Route("/metrics", metrics, methods=["GET"]),
  ]
  return Starlette(routes=routes, lifespan=lifespan,
                   exception_handlers={HTTPException: not_found})


async def _stream(runs: list[_Run], queue: asyncio.Queue, shape: wire.Shape,
                  parsed: Parsed):
  """Server-sent events: one chunk per token group of a choice, each choice's
  finish, then usage if asked."""
  for i in range(len(runs)):
    yield wire.sse(shape.chunk(None if shape.chat else "", first=True, index=i))
  try:
    while any(run.finish_reason is None for run in runs):
      i, event = await queue.get()
      delta = runs[i].take(event)
      entries = runs[i].released()
      if delta or entries:
        yield wire.sse(shape.chunk(delta, index=i, entries=entries))
      if runs[i].finish_reason is not None:
        yield wire.sse(shape.chunk(None, runs[i].finish_reason, index=i))
  except ApiError as e:
    yield wire.sse(e.body())
    yield wire.SSE_DONE
    return
  if parsed.include_usage:
    yield wire.sse(shape.usage_chunk([run.stats for run in runs]))
  yield wire.SSE_DONE


async def _whole(request: Request, runs: list[_Run], queue: asyncio.Queue,
                 shape: wire.Shape):
  """The whole answer; a client that hangs up meanwhile cancels its request."""
  parts = [[] for _ in runs]
  entries = [None if run.logprobs is None else [] for run in runs]
  try:
    while any(run.finish_reason is None for run in runs):
      try:
        i, event = await asyncio.wait_for(queue.get(), _DISCONNECT_POLL_S)
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          for run in runs:
            run.live.cancel()
          return PlainTextResponse("", status_code=499)  # nobody reads it
        continue
      parts[i].append(runs[i].take(event))
      if entries[i] is not None:
        entries[i].extend(runs[i].released())
  except ApiError as e:
    return _error(e)
  finally:
    for run in runs:
      if run.finish_reason is None:
        run.live.cancel()  # the handler itself was cancelled (shutdown)
  return JSONResponse(shape.response(["".join(p) for p in parts],
                                     [run.finish_reason for run in runs],
                                     [run.stats for run in runs], entries))
