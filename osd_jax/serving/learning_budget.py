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

A payback p ties learning to what it is for, a draft that serves more: updates
may take at most p of the seconds the learned draft has saved so far. The
caller books each finished request's tokens and, of them, the ones the
learned draft proposed and got accepted (`finished`); each of those is
priced at what a token has cost the serve calls so far (their seconds, less
the updates', over the tokens served). The price is low, since speculation
already made those tokens cheap, and the draft's rejected proposals are not
charged: p <= 0.5 leaves them room. Lookup's tokens earn nothing: the
updates do not change lookup. The first update is free, so a draft can show
what it learns; each later one waits until p of what the learned draft
saved covers every update before it. Where the learned draft serves nothing (lookup
covers the stream, or verification costs so much that the gate keeps the
draft idle) learning stops after one update, and resumes when the draft
earns again.

Keeping samples costs too (serving/records.py): the target's top-k at each
verified position, and a learn program for each finished request. A request
keeps its sample only where an update could start before the buffer
(`horizon` requests) has moved past it, at the rates of serving and saving
so far; otherwise it keeps nothing and its calls pay for neither.
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
      raise ValueError(f"The learning payback is a share of the seconds the learned"
                       f" draft saved, in [0, 1], got {payback}.")
    self.share, self.payback = share, payback
    self.serving_seconds = 0.0  # of every serve call so far
    self.saved_seconds = 0.0  # what the learned draft saved so far (payback)
    self.tokens = 0  # served by the requests booked so far
    self.requests = 0  # booked so far
    self.update_seconds = 0.0  # the estimated cost of every update so far
    self.updates = 0  # completed
    self._plain: dict = {}  # shape -> mean seconds of a call without an update

  def allows(self, agree=lambda flag: flag) -> bool:
    """May the next call start an update? With a budget, `agree` makes
    every host's answer the same (distributed.all_agree): hosts that differ
    on it would run different programs."""
    if not (self.share or self.payback):
      return True
    return agree(self._open(self.serving_seconds, self.saved_seconds))

  def worth_keeping(self, horizon: int, agree=lambda flag: flag) -> bool:
    """Should a request admitted now keep its sample? Yes where the budget
    allows an update now or would after `horizon` more requests, each
    serving and saving as the average request so far did."""
    if not (self.share or self.payback):
      return True
    ahead = 1.0 + horizon / max(self.requests, 1)
    return agree(self._open(ahead * self.serving_seconds, ahead * self.saved_seconds))

  def _open(self, serving_seconds: float, saved_seconds: float) -> bool:
    fits = not self.share or self.update_seconds <= self.share * serving_seconds
    paid = (not self.payback or not self.updates
            or self.update_seconds <= self.payback * saved_seconds)
    return fits and paid

  def finished(self, tokens: int, drafted: int) -> float:
    """Books a finished request: `tokens` served, `drafted` of them the
    learned draft's, proposed and accepted. Returns what those saved."""
    self.tokens += tokens
    self.requests += 1
    price = (self.serving_seconds - self.update_seconds) / max(self.tokens, 1)
    saved = drafted * max(price, 0.0)
    self.saved_seconds += saved
    return saved

  def record(self, shape, seconds: float, updated: bool,
             completed: bool | None = None) -> float:
    """Books a call of `shape` that took `seconds`, with optimizer steps if
    `updated`, and ending an update if `completed` (default: `updated`; an
    update split over calls ends in its last); returns the seconds its steps
    cost (0 without any)."""
    self.serving_seconds += seconds
    plain = self._plain.get(shape)
    if not updated:
      self._plain[shape] = seconds if plain is None else plain + _RATE * (seconds - plain)
      return 0.0
    if plain is None:  # none of this shape yet: the cheapest, not to undercount
      plain = min(self._plain.values(), default=0.0)
    cost = max(seconds - plain, 0.0)
    self.update_seconds += cost
    self.updates += updated if completed is None else completed
    return cost
