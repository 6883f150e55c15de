"""Replay: each optimizer step of an update trains on a minibatch drawn from the ring.

A ring that spans recent traffic holds more samples than one step should
pay for, and a sample seen once teaches the draft little. So every step
draws `size` samples from the valid ones without replacement, uniformly, and
an update of several steps revisits the ring the way offline distillation's
epochs revisit its data, at a cost set by steps x size, not by the ring.

The draw must not depend on how samples are laid out over devices (the
multi-device update equals the one-device one): each sample's priority is
a hash of the step's key and the sample's request id (Buffer.uid), the
minibatch is the `size` highest priorities over all devices, and each device
gathers its own part of it into `min(size, capacity)` rows, the rest
marked invalid. A device thus computes up to `size` samples however many
devices share the minibatch: exactness first.
"""

import jax
import jax.numpy as jnp

from osd_jax.distillation.buffer import Buffer


def priorities(buffer: Buffer, key: jax.Array) -> jax.Array:
  """[capacity] a uniform draw per sample from (key, its uid); -1 where it
  carries no weight (invalid, or nothing to learn)."""
  draw = jax.vmap(lambda uid: jax.random.uniform(jax.random.fold_in(key, uid)))(
      buffer.uid)
  learnable = buffer.is_valid & (buffer.loss_weight > 0).any(axis=1)
  return jnp.where(learnable, draw, -1.0)


def draw(buffer: Buffer, key: jax.Array, size: int,
         axis_name: str | None = None) -> Buffer:
  """This device's part of a minibatch of `size` samples of all devices' rings."""
  local = priorities(buffer, key)
  everyone = local if axis_name is None else jax.lax.all_gather(
      local, axis_name).reshape(-1)
  # The size-th highest priority over all devices; below it, not drawn.
  floor = jax.lax.top_k(everyone, min(size, everyone.shape[0]))[0][-1]
  values, rows = jax.lax.top_k(local, min(size, buffer.capacity))
  return buffer.taken(rows, (values >= floor) & (values >= 0))


def step_key(key: jax.Array, step: jax.Array) -> jax.Array:
  """The key of an update's `step`-th draw."""
  return jax.random.fold_in(key, step)
