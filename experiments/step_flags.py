"""Flags of the serve-and-learn step's decoding, shared by the main job and the server."""

import dataclasses

from absl import app, flags

from experiments import compilation_cache
from osd_jax.decoding import slots as slot_lib
from osd_jax.models import llama
from osd_jax.serving import verify_costs

BATCH_K = flags.DEFINE_list(
    "batch_k", [],
    "BATCH:K pairs: a call over BATCH or more slots per device drafts at most K"
    " tokens per step (K >= 1); default none, k at every batch. An override of"
    " the measured --position_costs, which it turns off unless those are"
    " given as pairs too.")
POSITION_COSTS = flags.DEFINE_string(
    "position_costs", "auto",
    "What verifying one more drafted position costs, as a fraction of a plain"
    " target step, per batch: each row then verifies only the drafted"
    " positions whose chance of acceptance pays for them, none where the"
    " first does not (a plain step). 'auto' times the target on this host at"
    " start-up (seconds a batch; cached beside --compilation_cache's programs,"
    " when that is on); 'off'"
    " verifies every drafted position;"
    " or BATCH:COST pairs, e.g. 1:0.05,8:0.3. Needs --trim_verify.")


def batch_k() -> tuple[tuple[int, int], ...]:
  """--batch_k as (batch, k) pairs; malformed ones are a usage error."""
  pairs = []
  for item in BATCH_K.value:
    batch, _, k_b = item.partition(":")
    if not (batch.isdigit() and k_b.isdigit() and int(batch) and int(k_b)):
      raise app.UsageError(f"--batch_k takes BATCH:K pairs of positive integers,"
                           f" got {item!r}.")
    pairs.append((int(batch), int(k_b)))
  return tuple(pairs)


def given_position_costs() -> tuple[tuple[int, float], ...] | None:
  """--position_costs as (batch, cost) pairs; None for 'auto' (measure),
  () for 'off'. Malformed pairs are a usage error."""
  value = POSITION_COSTS.value.strip()
  if value == "auto":
    return None
  if value == "off":
    return ()
  pairs = []
  for item in value.split(","):
    batch, _, cost = item.partition(":")
    try:
      pair = int(batch), float(cost)
    except ValueError:
      pair = (0, -1.0)
    if pair[0] < 1 or not 0.0 <= pair[1] < float("inf"):
      raise app.UsageError(f"--position_costs takes 'auto', 'off' or BATCH:COST"
                           f" pairs (batch >= 1, cost >= 0), got {item!r}.")
    pairs.append(pair)
  return tuple(pairs)


def position_costs(target_params, target_config, *, k: int, batches, window: int,
                   trim_verify: bool) -> tuple[tuple[int, float], ...]:
  """The position costs the step takes: given, off, or (auto) measured on
  this host and cached (`target_params` as loaded). Auto is off with --batch_k (the override) or
  --notrim_verify; given pairs without --trim_verify are a usage error."""
  given = given_position_costs()
  if given is not None:
    if given and not trim_verify:
      raise app.UsageError("--position_costs cut proposals only where verification"
                           " is trimmed: drop --notrim_verify or pass"
                           " --position_costs=off.")
    return given
  if BATCH_K.value or not trim_verify or k < 1:
    return ()
  # Beside the compiled programs (and gone with them): the same host, the
  # same switch, and a test's temporary cache keeps its tables too.
  programs = compilation_cache.directory(compilation_cache.FLAG.value,
                                         not compilation_cache.FLAG.present)
  folder = None if programs is None else f"{programs}-verify_costs"
  key = verify_costs.cache_key(target_config, target_params, k=k, batches=batches,
                               window=window, host=compilation_cache.host_key())
  # The decoding layout (a copy of the weights) only where the table is timed.
  costs, measured = verify_costs.cached(folder, key, lambda: verify_costs.measure(
      llama.for_decoding(target_params, target_config), target_config, k=k,
      batches=batches, window=window))
  shown = ", ".join(f"batch {b}: {c:.2f}" for b, c in costs)
  print(f"verified position cost of a plain step ({'measured' if measured else 'cached'}):"
        f" {shown}", flush=True)
  return costs


def with_position_costs(cfg, target, slots_per_device: int):
  """`cfg` (an OnlineConfig) with the position costs of --position_costs,
  timed at each batch its calls may take."""
  if cfg.k < 1:
    return cfg
  window = slot_lib.bucket(max(cfg.cache_size // 2, 1), cfg.cache_size)
  costs = position_costs(target.params, target.config, k=cfg.k,
                         batches=slot_lib.batch_buckets(slots_per_device),
                         window=window, trim_verify=cfg.trim_verify)
  return dataclasses.replace(cfg, position_costs=costs)
