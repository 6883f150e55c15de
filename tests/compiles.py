"""Counting the programs XLA builds while a test runs.

The suite keeps a persistent compilation cache (conftest), so a program may
be loaded from disk rather than compiled. Either way jax wraps the step in
one backend-compile event (pxla wraps `compile_or_get_cached` in it), so
that event counts each program once whether it was compiled or loaded, and
a recompilation cannot hide behind the cache. (A cache hit also raises
`/jax/compilation_cache/cache_hits`; counting that too counted a loaded
program twice.)
"""

import contextlib

import jax

COMPILED_OR_LOADED = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting(on_program):
  """Calls on_program() once per program compiled or loaded while inside."""

  def on_duration(event, duration, **kwargs):
    del duration, kwargs
    if event == COMPILED_OR_LOADED:
      on_program()

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  try:
    yield
  finally:
    jax.monitoring.unregister_event_duration_listener(on_duration)
