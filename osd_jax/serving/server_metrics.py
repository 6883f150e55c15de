"""The server's Prometheus metrics: vLLM's speculative-decoding counters, and our own.

Counters add exactly what each finished request's `usage` reports, so a
scrape before and after some traffic differs by the sums over its responses.
The engine thread writes, HTTP handlers read: one lock guards both.
"""

import collections
import threading

from osd_jax.serving.live_request import RequestStats

# (name, help) of the counters summed from RequestStats; vLLM's names first.
_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Verification passes that checked drafted tokens."),
    ("vllm:spec_decode_num_draft_tokens", "Drafted tokens proposed."),
    ("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted."),
    ("vllm:prompt_tokens", "Prompt tokens of finished requests."),
    ("vllm:generation_tokens", "Generated tokens of finished requests."),
    ("osd:target_calls", "Target verification passes."),
    ("osd:alpha_sum", "Sum over verified draft positions of sum_v min(p, q)."),
    ("osd:alpha_count", "Verified draft positions (alpha = alpha_sum / alpha_count)."),
)


def _fields(stats: RequestStats) -> tuple[float, ...]:
  """RequestStats in the order of _COUNTERS."""
  return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
          stats.prompt_tokens, stats.completion_tokens, stats.target_calls,
          stats.alpha_sum, stats.alpha_count)


def _number(x: float) -> str:
  x = float(x)
  if x != x:
    return "NaN"
  return {float("inf"): "+Inf", float("-inf"): "-Inf"}.get(x, repr(x))


class ServerMetrics:
  """Counters over finished requests, gauges the engine sets after every call."""

  def __init__(self, k: int, num_slots: int, window: int = 16):
    self._lock = threading.Lock()
    self._counters = [0.0] * len(_COUNTERS)
    self._per_pos = [0.0] * k
    self._finished = collections.Counter()  # by finish reason
    self._alphas = collections.deque(maxlen=window)  # last requests' alpha
    self._num_slots = num_slots
    self._gauges = {"queue_depth": 0, "slots_in_use": 0, "draft_updates": 0,
                    "draft_updates_skipped": 0, "draft_last_loss": float("nan"),
                    "serve_calls": 0, "plain_calls": 0, "serve_seconds": 0.0,
                    "update_seconds": 0.0, "saved_seconds": 0.0,
                    "draft_saved_seconds": 0.0}

  def observe(self, stats: RequestStats, reason: str, **gauges) -> None:
    """Adds one finished request (reason: stop, length or abort), and sets
    `gauges` (as set_engine) under the same lock: a scrape never sees the
    request counted while its slot still shows in use."""
    with self._lock:
      self._set(gauges)
      for i, value in enumerate(_fields(stats)):
        self._counters[i] += value
      for i, value in enumerate(stats.accepted_per_pos):
        self._per_pos[i] += value
      self._finished[reason] += 1
      if stats.alpha_count:
        self._alphas.append(stats.alpha)

  def set_engine(self, **gauges) -> None:
    """queue_depth, slots_in_use, draft_updates, draft_updates_skipped,
    draft_last_loss, serve_calls, plain_calls, serve_seconds,
    update_seconds, saved_seconds, draft_saved_seconds."""
    with self._lock:
      self._set(gauges)

  def _set(self, gauges: dict) -> None:
    unknown = set(gauges) - set(self._gauges)
    if unknown:
      raise KeyError(f"unknown gauges {sorted(unknown)}")
    self._gauges.update(gauges)

  @property
  def rolling_alpha(self) -> float:
    with self._lock:
      return sum(self._alphas) / len(self._alphas) if self._alphas else float("nan")

  def render(self) -> str:
    """Prometheus text exposition (format 0.0.4)."""
    alpha = self.rolling_alpha
    with self._lock:
      lines = []

      def metric(name, kind, help_text, samples):
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {_number(v)}" for labels, v in samples)

      for (name, help_text), value in zip(_COUNTERS, self._counters):
        metric(name + "_total", "counter", help_text, [("", value)])
      metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "Drafted tokens accepted, by draft position (from 0).",
             [(f'{{position="{i}"}}', v) for i, v in enumerate(self._per_pos)])
      metric("vllm:request_success_total", "counter", "Finished requests.",
             [(f'{{finished_reason="{r}"}}', self._finished[r])
              for r in ("stop", "length", "abort")])
      g = self._gauges
      metric("osd:draft_updates_total", "counter",
             "Online draft updates, over the draft's life (resumes included).",
             [("", g["draft_updates"])])
      metric("osd:draft_updates_skipped_total", "counter",
             "Optimizer steps skipped for a non-finite loss or gradient.",
             [("", g["draft_updates_skipped"])])
      metric("osd:draft_last_loss", "gauge", "Distillation loss at the latest update.",
             [("", g["draft_last_loss"])])
      metric("osd:serve_calls_total", "counter", "Compiled serve calls run.",
             [("", g["serve_calls"])])
      metric("osd:plain_calls_total", "counter",
             "Serve calls that ran the target alone (--speculate=auto).",
             [("", g["plain_calls"])])
      metric("osd:serve_seconds_total", "counter",
             "Seconds the engine spent in serve calls, updates included.",
             [("", g["serve_seconds"])])
      metric("osd:update_seconds_total", "counter",
             "Seconds of those the draft's updates took (each call's time less"
             " a call of its shape without one).", [("", g["update_seconds"])])
      metric("osd:speculation_saved_seconds", "gauge",
             "Seconds speculative calls saved against the target alone (their"
             " tokens at the plain calls' measured rate, less their time;"
             " negative: lost; 0 until plain calls are timed).",
             [("", g["saved_seconds"])])
      metric("osd:draft_saved_seconds", "gauge",
             "Seconds the learned draft's accepted tokens saved, at what a served"
             " token has cost: what --learning_payback spends.",
             [("", g["draft_saved_seconds"])])
      metric("osd:rolling_alpha", "gauge",
             f"Mean alpha of the last {self._alphas.maxlen} finished requests.",
             [("", alpha)])
      metric("osd:queue_depth", "gauge", "Requests waiting for a slot.",
             [("", g["queue_depth"])])
      metric("osd:slots_in_use", "gauge", "Slots serving a request.",
             [("", g["slots_in_use"])])
      metric("osd:slots", "gauge", "Decode slots.", [("", self._num_slots)])
    return "\n".join(lines) + "\n"
