"""How much of serving's wall clock the draft's updates may take.

An update runs inside a serve call, so every request in flight waits for
it. Where the learned draft serves few tokens (lookup covers the stream, or
the hybrid's gate keeps the draft idle), each second of learning is a
second of serving lost. With a budget b, an update may start only while the
updates so far have taken at most b of the time spent in serve calls; a
due update waits otherwise, and the buffer meanwhile keeps the newest
samples. A budget of 0 sets no limit: an update every `update_interval`
requests.

An update's cost is read off the clock: the seconds of the call that ran it
minus what calls of the same shape (the caller's key: window, slots, ...)
take without one.
"""

# Weight of the newest call in a shape's running mean of call seconds.
_RATE = 0.2


class LearningBudget:
  """Host-side bookkeeping: the updates' seconds against the serve calls'."""

  def __init__(self, share: float):
    if not 0.0 <= share < 1.0:
      raise ValueError(f"The learning budget is a share of serving time in [0, 1),"
                       f" got {share}.")
    self.share = share
    self.serving_seconds = 0.0  # of every serve call so far
    self.update_seconds = 0.0  # the estimated cost of every update so far
    self.updates = 0
    self._plain: dict = {}  # shape -> mean seconds of a call without an update

  def allows(self, agree=lambda flag: flag) -> bool:
    """May the next call start an update? With a budget, `agree` makes
    every host's answer the same (distributed.all_agree): hosts that differ
    on it would run different programs."""
    if not self.share:
      return True
    return agree(self.update_seconds <= self.share * self.serving_seconds)

  def record(self, shape, seconds: float, updated: bool) -> float:
    """Books a call of `shape` that took `seconds`; returns the seconds its
    update cost (0 without one)."""
    self.serving_seconds += seconds
    plain = self._plain.get(shape)
    if not updated:
      self._plain[shape] = seconds if plain is None else plain + _RATE * (seconds - plain)
      return 0.0
    if plain is None:  # none of this shape yet: the cheapest, not to undercount
      plain = min(self._plain.values(), default=0.0)
    cost = max(seconds - plain, 0.0)
    self.update_seconds += cost
    self.updates += 1
    return cost
