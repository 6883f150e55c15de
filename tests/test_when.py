"""`when`: a conditional update of a pytree that XLA can do in place."""

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax.when import when


def test_when_runs_the_function_only_if_the_predicate_holds():
  tree = {"w": jnp.arange(4.0), "n": jnp.int32(3)}
  step = lambda t: {"w": t["w"] * 2, "n": t["n"] + 1}
  for pred, want in [(True, step(tree)), (False, tree)]:
    got = jax.jit(lambda p, t: when(p, step, t))(jnp.bool_(pred), tree)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)

