"""Placing arrays on a (possibly multi-host) mesh; one code path for 1 or N hosts.

With several processes (one per host, jax.distributed), every host runs the
same program: parameters and state are placed from identical host values,
each host feeds only the rows of a batch that its devices hold, and outputs
are gathered back.
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


def barrier(name: str) -> None:
  """Waits until every process gets here (returns at once with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def all_agree(flag: bool) -> bool:
  """Whether `flag` holds on every process: a host's choice of which
  programs to run next must be every host's, or their collectives hang."""
  if jax.process_count() == 1:
    return flag
  return bool(np.all(multihost_utils.process_allgather(np.asarray(flag))))


def is_primary() -> bool:
  """Only process 0 writes logs, plots and reports."""
  return jax.process_index() == 0


def _put(x, sharding):
  """Places a host value that every host holds alike; each host transfers
  only the slices of its own devices, wherever they sit in the mesh.

  An array that already spans several hosts (a step's output, a restored
  checkpoint) has no host copy: it is resharded on the devices instead.
  """
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding))
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.device_put(x, sharding)
  x = np.asarray(x)
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  # Not device_put: across hosts it first all-gathers the whole value to
  # check that the hosts agree (a collective per leaf, every call).
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def replicate(tree, mesh: jax.sharding.Mesh):
  """Every leaf on every device of the mesh (host values must agree)."""
  return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), tree)


def shard_leading(tree, mesh: jax.sharding.Mesh, axis: str):
  """Leaves split along their first axis over the mesh (global host values).

  With several hosts, each puts only the rows of its own devices: a batch
  planned alike on every host is fed this way, each host its own requests.
  """
  return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P(axis))), tree)


def gather(tree):
  """Host numpy copies of (possibly cross-host) arrays."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)
