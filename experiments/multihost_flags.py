"""Flags that start jax.distributed for multi-host runs (TPU slices, several GPUs hosts)."""

from absl import flags

from osd_jax.serving import distributed

MULTIHOST = flags.DEFINE_bool(
    "multihost", False, "Initialise jax.distributed (one process per host). On"
    " a Cloud TPU VM slice the coordinator is found from the environment.")
COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0 (not needed on TPU VMs).")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")


def maybe_initialize() -> None:
  """Starts jax.distributed when --multihost is set; call before using devices."""
  if MULTIHOST.value:
    distributed.initialize(COORDINATOR.value, NUM_PROCESSES.value,
                           PROCESS_ID.value)
