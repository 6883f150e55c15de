"""`when`: run a function on a pytree only if a predicate holds, in place.

`lax.cond(pred, fn, lambda x: x, tree)` may copy all of `tree` on every
call: XLA's conditional returns new buffers, and where it cannot alias them
with its operands, the branch that changes nothing copies each operand. In
the online serve program it did: the update's no-op branch copied the draft,
its embedding and its Adam moments (about 250 MB for the 2-layer SmolLM2
draft) on every serve call, learning or not. A while loop of zero or one
trips updates its carry in place instead.
"""

import jax
import jax.numpy as jnp


def when(pred: jax.Array, fn, tree):
  """fn(tree) if `pred` (a scalar bool) else `tree`; fn keeps the structure."""
  def body(carry):
    _, tree = carry
    return jnp.bool_(False), fn(tree)

  return jax.lax.while_loop(lambda carry: carry[0], body, (pred, tree))[1]
