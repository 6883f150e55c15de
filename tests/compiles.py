"""Counting the programs XLA builds while a test runs.

The suite keeps a persistent compilation cache (conftest), and a program
loaded from it raises no backend-compile event: a recompilation would go
unseen. So a program counts whether it was compiled or loaded.
"""

import contextlib

import jax

COMPILED = "/jax/core/compile/backend_compile_duration"
LOADED = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def counting(on_program):
  """Calls on_program() once per program compiled or loaded while inside."""

  def on_duration(event, duration, **kwargs):
    del duration, kwargs
    if event == COMPILED:
      on_program()

  def on_event(event, **kwargs):
    del kwargs
    if event == LOADED:
      on_program()

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)
  try:
    yield
  finally:
    jax.monitoring.unregister_event_duration_listener(on_duration)
    jax.monitoring.unregister_event_listener(on_event)
