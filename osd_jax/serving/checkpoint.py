"""Orbax checkpoints of the online state plus the host's stream position."""

import json
import os
import time

import jax
import orbax.checkpoint as ocp

from osd_jax.checkpoints.layout import CheckpointError
from osd_jax.serving import distributed
from osd_jax.serving.online import OnlineState


def _storable(state: OnlineState):
  """Typed PRNG keys as raw uint32 data, and no zero-size arrays (orbax stores
  neither); restore rebuilds both from the template."""
  raw = lambda x: (jax.random.key_data(x)
                   if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
  return jax.tree.map(lambda x: raw(x) if x.size else None, state)


def _rebuild(stored, template: OnlineState) -> OnlineState:
  """The inverse of _storable: `stored` has the template's non-empty leaves, in order."""
  leaves, treedef = jax.tree.flatten(template)
  saved = iter(jax.tree.leaves(stored))
  out = []
  for like in leaves:
    if not like.size:
      out.append(like)
      continue
    x = next(saved)
    is_key = jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key)
    out.append(jax.random.wrap_key_data(x) if is_key else x)
  return treedef.unflatten(out)


class Checkpointer:
  """Saves every N requests and at exit; refuses to mix incompatible runs."""

  def __init__(self, directory: str, run_config: dict, *, resume: bool,
               max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    self.run_config = json.loads(json.dumps(run_config, default=str))
    config_file = os.path.join(self.directory, "run_config.json")
    has_checkpoints = os.path.isdir(self.directory) and any(
        name.isdigit() for name in os.listdir(self.directory))
    if has_checkpoints and not resume:
      raise CheckpointError(
          f"{self.directory} already holds checkpoints: pass --resume to"
          " continue that run, or choose another --checkpoint_dir.")
    if has_checkpoints:
      try:
        saved = json.load(open(config_file))
      except (OSError, ValueError) as e:
        raise CheckpointError(f"Cannot read {config_file}: {e}") from e
      diff = {k: (saved.get(k), v) for k, v in self.run_config.items()
              if saved.get(k) != v}
      if diff:
        raise CheckpointError(
            f"Checkpoint in {self.directory} was made with other settings"
            f" (saved, now): {diff}")
    # With several processes (one directory for all, as orbax expects) every
    # one has read the old config before process 0 alone rewrites it.
    distributed.barrier("Checkpointer: run config read")
    if distributed.is_primary():
      os.makedirs(self.directory, exist_ok=True)
      with open(config_file, "w") as f:
        json.dump(self.run_config, f, indent=2)
    self.saves, self.seconds = 0, 0.0  # saves made, and the time they took
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             enable_async_checkpointing=False))

  def save(self, step: int, state: OnlineState, host: dict) -> None:
    """Writes state and host-side progress (stream position, counters)."""
    start = time.perf_counter()
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_storable(state)),
        host=ocp.args.JsonSave(host)), force=True)
    self.manager.wait_until_finished()
    self.saves += 1
    self.seconds += time.perf_counter() - start

  def restore_latest(self, template: OnlineState):
    """(state, host) of the newest checkpoint, or None if there is none."""
    step = self.manager.latest_step()
    if step is None:
      return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _storable(template))
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          host=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f"Checkpoint {step} in {self.directory} is corrupt or does not match"
          f" this run's shapes: {type(e).__name__}: {e}") from e
    return _rebuild(restored.state, template), restored.host

  def close(self) -> None:
    self.manager.close()
