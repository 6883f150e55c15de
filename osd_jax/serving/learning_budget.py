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

A payback p ties learning to what it is for: updates may take at most p of
the seconds speculation has saved so far (what the caller books: a
speculative call's tokens at the plain calls' measured rate, less its own
time; negative where it lost). With p <= 1 a server that learns stays at
least as fast as the target alone over its life; where speculation saves
nothing (many clients on a CPU), it does not learn until it saves again.
"""

# Weight of the newest call in a shape's running mean of call seconds.
_RATE = 0.2


class LearningBudget:
  """Host-side bookkeeping: the updates' seconds against the serve calls'."""

  def __init__(self, share: float, payback: float = 0.0):
    if not 0.0 <= share < 1.0:
      raise ValueError(f"The learning budget is a share of serving time in [0, 1),"
                       f" got {share}.")
    if not 0.0 <= payback <= 1.0:
      raise ValueError(f"The learning payback is a share of the seconds speculation"
                       f" saved, in [0, 1], got {payback}.")
    self.share, self.payback = share, payback
    self.serving_seconds = 0.0  # of every serve call so far
    self.saved_seconds = 0.0  # what speculation saved so far (payback)
    self.update_seconds = 0.0  # the estimated cost of every update so far
    self.updates = 0
    self._plain: dict = {}  # shape -> mean seconds of a call without an update

  def allows(self, agree=lambda flag: flag) -> bool:
    """May the next call start an update? With a budget, `agree` makes
    every host's answer the same (distributed.all_agree): hosts that differ
    on it would run different programs."""
    if not (self.share or self.payback):
      return True
    fits = not self.share or self.update_seconds <= self.share * self.serving_seconds
    # Strictly: the first update waits until speculation has saved something.
    paid = not self.payback or self.update_seconds < self.payback * self.saved_seconds
    return agree(fits and paid)

  def saved(self, seconds: float) -> None:
    """Books what a call saved against the target alone (negative: lost)."""
    self.saved_seconds += seconds

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
