"""Running a pass at the narrowest of a few static widths.

Shapes are static under jit, so a pass whose useful width varies per step
(verification of a trimmed proposal, a draft catching up on its cache) is
compiled once per width and the step picks one branch at run time.
"""

import functools

import jax
import jax.numpy as jnp


def at_smallest_width(widths: tuple[int, ...], needed, at_width):
  """at_width(w) for the smallest of `widths` that holds `needed` (the
  largest if none does): one branch per width under lax.switch."""
  if len(widths) == 1:
    return at_width(widths[0])
  index = jnp.minimum(jnp.searchsorted(jnp.array(widths), needed), len(widths) - 1)
  return jax.lax.switch(index, [functools.partial(at_width, w) for w in widths])
