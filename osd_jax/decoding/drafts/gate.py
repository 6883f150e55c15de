"""When the hybrid's learned draft pays for its pass.

Where lookup finds no match the hybrid runs its learned draft, and that pass
costs time whether or not its tokens are accepted. The gate runs it only
while what it has been yielding pays for it: its accepted tokens, a fraction
of the batch's, must exceed its cost, a fraction of a target step.

Per row (a slot; the statistics outlive its requests) it keeps running
means of the draft tokens accepted on the steps the draft ran for the row
(a pass that proposed nothing, all its draws unconfident, yielded none), and
of the tokens the row emits a step. A step serves the rows lookup
missed with the draft when

    sum over rows lookup missed of accepted  >  cost * sum over live rows of emitted,

and otherwise only the rows still exploring, so that a closed gate goes
on measuring a draft that learns: a request's first steps (its draft cache
is fresh: little to catch up) and, with `explore_every` n, every n-th step
of a request on which lookup missed (the first included). The rows it does
not serve stay idle. Over a device mesh each device decides for its own
slots, as each runs its own pass. The decision reads only past steps and
this step's lookup, never this step's draws, so rejection sampling stays
exact.

After an update the means describe a draft that is gone: the online loop
then blends in the new draft's acceptance on what it trained on
(`reestimated`), so a draft that has learned gets proposals again without
waiting for a closed gate's exploration to notice.
"""

import flax
import jax
import jax.numpy as jnp

# Weight of the newest step in the running means (about the last 10 steps).
RATE = 0.1
# Steps of each request on which the draft runs wherever lookup misses.
EXPLORE_STEPS = 2
# Weight of an update's estimate against the measured mean: the estimate is
# taken on samples the draft just trained on, so it flatters it; half is
# enough to reopen a gate for a draft that has learned, and measurement
# closes it again within a few steps if the estimate was too kind.
ESTIMATE_WEIGHT = 0.5


@flax.struct.dataclass
class Gate:
  """Per row: what the learned draft has been yielding, and what the row is."""

  accepted: jax.Array  # [B] mean draft tokens accepted a step the draft proposed
  emitted: jax.Array  # [B] mean tokens emitted a step
  age: jax.Array  # [B] steps since the row's request was inserted
  live: jax.Array  # [B] the row emitted at its last step (or was just inserted)
  own: jax.Array  # [B] the row is this drafter's (a per-category copy's rows)
  ran: jax.Array  # [B] the draft ran for the row this step
  misses: jax.Array  # [B] steps of the row's request on which lookup missed
  missed: jax.Array  # [B] lookup missed at the row's latest step
  # What the learned draft did for the row's request (reports, not decisions).
  drafted: jax.Array  # [B] int32 tokens it proposed
  drafted_accepted: jax.Array  # [B] int32 of them accepted

  @classmethod
  def empty(cls, batch_size: int) -> "Gate":
    """Optimistic: the draft starts as if every proposal were accepted once."""
    b = batch_size
    return cls(jnp.ones((b,), jnp.float32), jnp.ones((b,), jnp.float32),
               jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool),
               jnp.ones((b,), bool), jnp.zeros((b,), bool),
               jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool),
               jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))

  def serves(self, missed: jax.Array, cost: float, explore_every: int = 0) -> jax.Array:
    """[B] rows the draft proposes for this step, of those lookup `missed`:
    all of them while the draft pays, else only rows still exploring (the
    rest stay idle: the pass does not catch up on them)."""
    wanted = missed & self.live & self.own
    gain = jnp.where(wanted, self.accepted, 0.0).sum()
    spent = cost * jnp.where(self.live & self.own, self.emitted, 0.0).sum()
    exploring = self.age < EXPLORE_STEPS
    if explore_every:
      exploring |= self.misses % explore_every == 0
    return wanted & ((gain > spent) | exploring)

  def proposed(self, ran: jax.Array, missed: jax.Array,
               num_proposed: jax.Array | None = None) -> "Gate":
    """This step's rows the draft ran for (measured at `after`), those lookup
    `missed`, and the tokens each proposal held. A pass that stopped before
    its first unconfident draw proposed nothing: it cost its catch-up and a
    draw, and is measured as what it yielded, no token."""
    counted = missed & self.live & self.own
    drafted = self.drafted
    if num_proposed is not None:
      drafted = drafted + jnp.where(ran, num_proposed, 0)
    return self.replace(ran=ran, missed=missed, misses=self.misses + counted,
                        drafted=drafted)

  def reestimated(self, accepted: jax.Array) -> "Gate":
    """Blends a new draft's expected accepted tokens a proposal [] into its
    rows' means; a NaN (no estimate) changes nothing."""
    blend = self.accepted + ESTIMATE_WEIGHT * (accepted - self.accepted)
    return self.replace(accepted=jnp.where(self.own & jnp.isfinite(accepted),
                                           blend, self.accepted))

  def after(self, kept: jax.Array, own: jax.Array | bool) -> "Gate":
    """The statistics after a step that kept `kept` [B] tokens a row."""
    own = jnp.broadcast_to(own, kept.shape)
    emitting = own & (kept > 0)
    measured = emitting & self.ran
    mean = lambda old, new, where: jnp.where(where, old + RATE * (new - old), old)
    accepted = jnp.maximum(kept - 1, 0)
    return self.replace(
        drafted_accepted=self.drafted_accepted + jnp.where(measured, accepted, 0),
        accepted=mean(self.accepted, accepted.astype(jnp.float32), measured),
        emitted=mean(self.emitted, kept.astype(jnp.float32), emitting),
        age=self.age + 1, live=kept > 0, own=own,
        ran=jnp.zeros_like(self.ran))

  def started(self) -> "Gate":
    """Every row starts a request (a batch prefilled at once)."""
    return self.replace(age=jnp.zeros_like(self.age), live=jnp.ones_like(self.live),
                        own=jnp.ones_like(self.own),
                        misses=jnp.zeros_like(self.misses),
                        drafted=jnp.zeros_like(self.drafted),
                        drafted_accepted=jnp.zeros_like(self.drafted_accepted))

  def insert_row(self, row: jax.Array) -> "Gate":
    """A new request in `row`: its means stay (they describe the slot's draft)."""
    return self.replace(age=self.age.at[row].set(0), live=self.live.at[row].set(True),
                        own=self.own.at[row].set(True),
                        misses=self.misses.at[row].set(0),
                        drafted=self.drafted.at[row].set(0),
                        drafted_accepted=self.drafted_accepted.at[row].set(0))
