"""The server's metrics agree with each other at every instant a client can scrape."""

import dataclasses
import queue

import pytest

from osd_jax.serving import live, online
from osd_jax.serving.live_request import (Finished, LiveRequest, RequestParams,
                                          RequestStats)
from osd_jax.serving.server_metrics import ServerMetrics
from experiments.server_process import parse_metrics
from tests.test_online import MAIN, MAX_NEW, QUERIES, prompt_ids, tiny_pair


def _finished(metrics: dict) -> float:
  return sum(metrics[f'vllm:request_success_total{{finished_reason="{r}"}}']
             for r in ("stop", "length", "abort"))


def test_a_finished_request_and_its_free_slot_show_in_the_same_scrape():
  """Scraped the moment each request's answer goes out (on the engine thread,
  before the engine's turn ends), the success counter and the slot gauge agree:
  requests run one at a time, so every finished request left no slot in use."""
  target, draft = tiny_pair()
  cfg = dataclasses.replace(MAIN, sampling=None, learn=False)
  engine = live.LiveEngine(target, draft, cfg, live.LiveConfig(num_slots=2),
                           mesh=online.make_mesh(1))
  scrapes = queue.Queue()

  def on_event(event):
    if isinstance(event, Finished):
      scrapes.put(parse_metrics(engine.metrics.render()))

  engine.start(warm_up=False)
  try:
    for n, q in enumerate(QUERIES[:3], 1):
      engine.submit(LiveRequest(list(prompt_ids(q)), RequestParams(max_tokens=MAX_NEW),
                                on_event))
      seen = scrapes.get(timeout=300)
      assert (_finished(seen), seen["osd:slots_in_use"], seen["osd:queue_depth"]) == \
          (n, 0, 0)
  finally:
    engine.stop()


def test_an_unknown_gauge_is_refused_before_anything_is_counted():
  metrics = ServerMetrics(k=2, num_slots=2)
  stats = RequestStats(3, 2, 1, 2, 1, (1, 0), 1, 0.5, 1.0)
  with pytest.raises(KeyError, match="slots"):
    metrics.observe(stats, "stop", slots=1)
  assert _finished(parse_metrics(metrics.render())) == 0
  metrics.observe(stats, "stop", slots_in_use=1, queue_depth=0)
  seen = parse_metrics(metrics.render())
  assert (_finished(seen), seen["osd:slots_in_use"]) == (1, 1)
