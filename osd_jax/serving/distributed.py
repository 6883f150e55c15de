"""Placing arrays on a (possibly multi-host) mesh; one code path for 1 or N hosts.

With several processes (one per host, jax.distributed), every host runs the
same program: parameters and state are replicated from identical host values,
each host feeds only its rows of a batch, and outputs are gathered back.
"""

import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """jax.distributed.initialize from flags, or from a TPU VM's environment.

  On CPU the cross-process collectives need gloo, which must be chosen
  before the backend starts.
  """
  if os.environ.get("JAX_PLATFORMS", "") == "cpu" or coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator,
                             num_processes=num_processes, process_id=process_id)


def is_primary() -> bool:
  """Only process 0 writes logs, plots and reports."""
  return jax.process_index() == 0


def _put(x, sharding):
  """device_put through host memory, so every host may pass its own copy."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding))
  return jax.device_put(np.asarray(x), sharding)


def replicate(tree, mesh: jax.sharding.Mesh):
  """Every leaf on every device of the mesh (host values must agree)."""
  return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), tree)


def shard_leading(tree, mesh: jax.sharding.Mesh, axis: str):
  """Leaves split along their first axis over the mesh (global host values)."""
  return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P(axis))), tree)


def local_rows(global_batch: int) -> slice:
  """This host's rows of a global batch (hosts own equal, contiguous parts)."""
  per_host = global_batch // jax.process_count()
  start = jax.process_index() * per_host
  return slice(start, start + per_host)


def from_local_rows(local: np.ndarray, mesh: jax.sharding.Mesh, axis: str,
                    global_batch: int) -> jax.Array:
  """A global batch array built from this host's rows only."""
  sharding = NamedSharding(mesh, P(axis))
  return jax.make_array_from_process_local_data(
      sharding, local, (global_batch,) + local.shape[1:])


def gather(tree):
  """Host numpy copies of (possibly cross-host) arrays."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)
