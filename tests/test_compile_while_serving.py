"""The live engine is ready once the programs that hold any call (the widest
window over every slot) are compiled; the rest of its plan compiles while it
serves, each taken up when ready."""

import dataclasses
import functools
import queue
import threading
import time

from osd_jax.decoding.engine import Engine
from osd_jax.serving import live, online
from osd_jax.serving.live_request import Finished, LiveRequest, RequestParams, Tokens
from tests.test_online import MAIN, MAX_NEW, QUERIES, prompt_ids, tiny_pair


def serve_together(engine: live.LiveEngine, prompts) -> list[list[int]]:
  """The tokens of each prompt (MAX_NEW of them), submitted together to a
  started engine."""
  tokens, done = [[] for _ in prompts], queue.Queue()

  def on_event(i, event):
    if isinstance(event, Tokens):
      tokens[i].extend(event.ids)
    elif isinstance(event, Finished):
      done.put(i)

  for i, ids in enumerate(prompts):
    engine.submit(LiveRequest(ids, RequestParams(max_tokens=MAX_NEW),
                              functools.partial(on_event, i)))
  for _ in prompts:
    done.get(timeout=300)
  return tokens


def test_ready_on_the_widest_programs_then_the_rest_compile_while_serving(monkeypatch):
  """Requests served before and after the rest compiled get the target's
  greedy tokens; until then only the first programs run."""
  target, draft = tiny_pair()
  engine = live.LiveEngine(target, draft, dataclasses.replace(MAIN, sampling=None),
                           live.LiveConfig(num_slots=2, choose_calls=True),
                           mesh=online.make_mesh(1))
  plan = engine.plan
  widest = max(window for window, _ in plan.programs)
  assert any(window < widest for window, _ in plan.programs + plan.plain)
  release, compile_rest = threading.Event(), live.LiveEngine._compile_rest

  def held(self, programs, scratch):
    release.wait(300)
    compile_rest(self, programs, scratch)

  monkeypatch.setattr(live.LiveEngine, "_compile_rest", held)
  calls, serve = [], online.Step.serve

  def watched(self, *args, **kwargs):
    calls.append((kwargs["window"], kwargs["batch"]))
    return serve(self, *args, **kwargs)

  monkeypatch.setattr(online.Step, "serve", watched)
  prompts = [list(prompt_ids(q)) for q in QUERIES[:6]]
  reference = [r.token_ids for r in Engine(target, k=0, max_new_tokens=MAX_NEW,
                                           num_slots=2).generate_ids(prompts)]
  engine.start()
  try:
    assert engine.healthy
    ready = engine.compiled
    assert ready.programs == ready.plain == ((widest, 2),)
    assert serve_together(engine, prompts[:3]) == reference[:3]
    # Only the programs compiled before it was ready ran.
    assert set(calls) == {(widest, 2)}
    release.set()
    deadline = time.monotonic() + 300
    while engine.compiled != plan and time.monotonic() < deadline:
      time.sleep(0.1)
    assert engine.compiled == plan
    calls.clear()
    assert serve_together(engine, prompts[3:]) == reference[3:]
    assert any(batch < 2 or window < widest for window, batch in calls)
  finally:
    release.set()
    engine.stop()
  assert engine.failure is None


def test_a_stop_ends_the_compile_thread_before_its_next_program(monkeypatch):
  target, draft = tiny_pair()
  engine = live.LiveEngine(target, draft, dataclasses.replace(MAIN, sampling=None),
                           live.LiveConfig(num_slots=2), mesh=online.make_mesh(1))
  release, compile_rest = threading.Event(), live.LiveEngine._compile_rest
  after_stop = []

  def held(self, programs, scratch):
    release.wait(300)
    compile_rest(self, programs, scratch)

  compile_ = live.LiveEngine._compile  # pylint: disable=protected-access

  def counted(self, programs, scratch, done):
    if release.is_set():
      after_stop.extend(programs)
    return compile_(self, programs, scratch, done)

  monkeypatch.setattr(live.LiveEngine, "_compile_rest", held)
  monkeypatch.setattr(live.LiveEngine, "_compile", counted)
  engine.start()
  ready = engine.compiled
  assert ready != engine.plan  # some programs are left for the thread
  programs = set(engine._step._serve)  # pylint: disable=protected-access
  stopping = threading.Thread(target=engine.stop, args=(300,))
  stopping.start()
  while engine._accepting:  # pylint: disable=protected-access
    time.sleep(0.01)
  release.set()
  stopping.join(300)
  assert not stopping.is_alive()
  assert not engine._compiler.is_alive()  # pylint: disable=protected-access
  assert engine.compiled == ready and engine.failure is None
  # It looked at one program, saw the stop and compiled nothing.
  assert len(after_stop) == 1
  assert set(engine._step._serve) == programs  # pylint: disable=protected-access
