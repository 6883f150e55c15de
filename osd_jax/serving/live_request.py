"""One live request as the engine thread sees it: its settings, its events, its stats.

The HTTP side builds a LiveRequest and hands it to the engine; from then on
the engine thread alone reads and writes it, except `cancel`, which any
thread may call (a plain attribute write: atomic under the GIL). Results go
back through `on_event`, called on the engine thread; it must not block.
"""

import dataclasses
import itertools
import time
from collections.abc import Callable

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class RequestParams:
  """What a request asks of the engine: its budget and its own sampling."""

  max_tokens: int
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  seed: int | None = None  # None: the server draws one
  # N: each token comes with the target's log-prob of it and its top N
  # (vLLM's raw_logprobs, decoding/logprobs.py); None: no log-probs.
  logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class RequestStats:
  """Per-request speculative counts, from the slot's running sums."""

  prompt_tokens: int
  completion_tokens: int
  num_drafts: int  # verification passes that checked >= 1 drafted token
  num_draft_tokens: int  # drafted tokens proposed
  num_accepted_tokens: int
  accepted_per_pos: tuple[int, ...]  # accepted at draft position 0..k-1
  target_calls: int  # verification passes
  alpha_sum: float  # sum over verified positions of sum_v min(p, q)
  alpha_count: float  # verified positions

  @property
  def alpha(self) -> float:
    return self.alpha_sum / self.alpha_count if self.alpha_count else 0.0

  @property
  def acceptance_rate(self) -> float:
    return (self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens else 0.0)

  @property
  def mean_accepted_length(self) -> float:
    """Drafted tokens accepted per verification pass."""
    return self.num_accepted_tokens / self.target_calls if self.target_calls else 0.0


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """The target's log-prob of one emitted token, and its N likeliest tokens there."""

  logprob: float
  top: tuple[tuple[int, float], ...]  # (token id, log-prob), likeliest first


@dataclasses.dataclass(frozen=True)
class Tokens:
  """Token ids the request got in one engine call (a token group)."""

  ids: list[int]
  logprobs: list[TokenLogprob] | None = None  # one per id, if the request asked


@dataclasses.dataclass(frozen=True)
class Finished:
  """The request left its slot: `eos`, `length` (budget) or `cancelled`."""

  reason: str
  stats: RequestStats


@dataclasses.dataclass(frozen=True)
class Failed:
  """The engine could not serve the request (shutting down, engine error)."""

  message: str


Event = Tokens | Finished | Failed


class LiveRequest:
  """A tokenized request in the engine's queue or one of its slots."""

  def __init__(self, prompt_ids: list[int], params: RequestParams,
               on_event: Callable[[Event], None]):
    self.id = next(_ids)
    self.prompt_ids, self.params, self.on_event = list(prompt_ids), params, on_event
    self.arrival = time.perf_counter()
    self.cancelled = False
    # Set with cancel() when the client used only the first n tokens (a stop
    # string): usage and counters then count n, not what the engine made.
    self.tokens_used: int | None = None
    self.sent = 0  # generated tokens already handed to on_event (engine only)

  def cancel(self, tokens_used: int | None = None) -> None:
    """The client is gone or has what it needs: free the slot (any thread)."""
    self.tokens_used = tokens_used
    self.cancelled = True
