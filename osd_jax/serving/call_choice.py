"""Whether a serve call speculates or runs the target alone: whichever has
been faster, measured.

Speculation pays where the tokens a step's draft adds outweigh what
drafting and verifying cost. On a 2-core CPU it does at one client (1.3x),
and at eight it did not (0.79x in bench_serve, with the verified positions
already cut to those that pay: the draft's and the lookup's own work per
row, and verification's packed pass, cost more than a cost model of
verified positions says). Engines answer with a batch size above which
they stop speculating (vLLM's speculative_disable_by_batch_size), set by
hand. Here the clock decides: per batch size, the running means of the
generated tokens per second of speculative calls and of plain ones (k = 0:
the target alone, the drafter only keeping in step), each kind timed on a
few calls first, in turns, and then each call runs the faster. Every
EXPLORE_EVERY-th call at a batch size runs the other, so a draft that
learns, or traffic that changes, is noticed; at most that share of calls
is spent on the slower kind. A call that took an update is
timed without it (the learning budget's estimate of its cost).

The choice is between whole programs, read only from past calls, so
rejection sampling within a call stays exact.
"""

import collections

# Weight of the newest call in a running mean of tokens per second.
RATE = 0.2
# Every n-th call at a batch size runs the kind that has been slower.
EXPLORE_EVERY = 16
# Calls of each kind timed at a batch size before the faster is chosen
# (they take turns): one call's time depends on which requests it served.
FIRST_CALLS = 2


class CallChoice:
  """Host-side: which kind of call to run next at each batch size."""

  def __init__(self, enabled: bool = True, explore_every: int = EXPLORE_EVERY):
    if explore_every < 2:
      raise ValueError(f"explore_every must be >= 2, got {explore_every}.")
    self.enabled, self.explore_every = enabled, explore_every
    self._rate: dict[tuple[int, bool], float] = {}  # (batch, plain) -> tokens/s
    self._timed = collections.Counter()  # (batch, plain) -> calls timed
    self._turns: collections.Counter = collections.Counter()  # batch -> calls
    self.calls = collections.Counter()  # plain -> calls run

  def plain(self, batch: int, agree=lambda flag: flag) -> bool:
    """Whether the next call over `batch` slots runs the target alone.
    `agree` makes every host's answer the same (distributed.all_agree)."""
    if not self.enabled:
      return False
    self._turns[batch] += 1
    timed = self._timed[batch, False], self._timed[batch, True]
    if min(timed) < FIRST_CALLS:  # turns until each kind is timed enough
      choice = timed[1] < timed[0]
    else:
      choice = self._rate[batch, True] > self._rate[batch, False]
      if self._turns[batch] % self.explore_every == 0:
        choice = not choice
    return agree(choice)

  def record(self, batch: int, plain: bool, seconds: float, tokens: int) -> None:
    """Books a call that generated `tokens` in `seconds`."""
    self.calls[plain] += 1
    if seconds <= 0 or tokens <= 0:
      return
    rate = tokens / seconds
    self._timed[batch, plain] += 1
    old = self._rate.get((batch, plain))
    self._rate[batch, plain] = rate if old is None else old + RATE * (rate - old)

  def seconds_saved(self, batch: int, plain: bool, seconds: float,
                    tokens: int) -> float:
    """What a call saved against the target alone: a speculative call's
    tokens at the plain calls' running rate at its batch size, less its own
    seconds (negative where it was slower); 0 for a plain call, or before
    plain calls at its batch size were timed."""
    rate = self._rate.get((batch, True))
    if plain or rate is None:
      return 0.0
    return tokens / rate - seconds

  def rate(self, batch: int, plain: bool) -> float | None:
    """The running mean of tokens per second (None: not measured yet)."""
    return self._rate.get((batch, plain))

  @property
  def plain_share(self) -> float:
    """The share of calls so far that ran the target alone."""
    total = sum(self.calls.values())
    return self.calls[True] / total if total else 0.0
