"""The serve-and-learn step: serve a batch, buffer it, and every I requests distil.

One compiled program per batch, replicated over a device mesh with shard_map:
each device serves its slice of the batch into its own buffer; the update
averages gradients across devices, so every replica of the draft stays equal.
"""

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from osd_jax.decoding import speculative
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import samples, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.models.config import LlamaConfig
from osd_jax.serving import distributed
from osd_jax.serving.serve import Served, serve_batch

AXIS = "data"


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
  """Static settings of the loop (hashable: a jit static argument)."""

  k: int = 4
  sampling: Sampling = Sampling()
  max_new_tokens: int = 64
  prompt_len: int = 128  # prompts are padded (and must fit) to this
  update_interval: int = 8  # I: requests between updates, per draft
  buffer_capacity: int = 8  # samples per device and draft
  clear_after_update: bool = True  # as published; False keeps a ring
  teacher_k: int = 32  # 0: recompute the teacher with a target forward
  loss_weighting: str = "corrected"  # or "all" generated positions
  sample_source: str = "served"
  source_mix: float = 0.5  # target share for the mixed sources
  num_drafts: int = 1
  distill: update.DistillConfig = update.DistillConfig()

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"k must be >= 1, got {self.k}.")
    if self.loss_weighting not in ("corrected", "all"):
      raise ValueError(f"loss_weighting must be corrected|all, got"
                       f" {self.loss_weighting!r}.")
    if self.sample_source not in samples.SOURCES:
      raise ValueError(f"sample_source must be one of {samples.SOURCES}.")
    if self.update_interval < 1 or self.buffer_capacity < 1:
      raise ValueError("update_interval and buffer_capacity must be >= 1.")

  @property
  def max_len(self) -> int:
    return self.prompt_len + self.max_new_tokens


@flax.struct.dataclass
class OnlineState:
  """Everything that changes as the stream goes on; leading axis = draft."""

  draft_params: dict  # [num_drafts, ...] replicated over devices
  opt_state: optax.OptState  # [num_drafts, ...] replicated
  buffer: Buffer  # [devices, num_drafts, ...]: one buffer per device and draft
  rng: jax.Array  # [devices] keys
  since_update: jax.Array  # [num_drafts] requests since that draft's last update
  num_updates: jax.Array  # [num_drafts]
  num_skipped: jax.Array  # [num_drafts] updates skipped for a non-finite loss


@flax.struct.dataclass
class StepOutput:
  """Per request: tokens and metrics; per step: the update, if one ran."""

  tokens: jax.Array  # [batch, max_new_tokens]
  lengths: jax.Array  # [batch]
  metrics: speculative.Metrics  # per request (leaf [batch])
  did_update: jax.Array  # [] bool
  loss: jax.Array  # [] meaningful only where did_update
  update_applied: jax.Array  # [] bool: finite and applied


def init_state(draft_params, cfg: OnlineConfig, num_devices: int,
               seed: int) -> OnlineState:
  """N copies of the starting draft, fresh optimizer states and empty buffers."""
  optimizer = update.make_optimizer(cfg.distill)
  stack = lambda x: jnp.broadcast_to(x, (cfg.num_drafts,) + x.shape).copy()
  params = jax.tree.map(stack, draft_params)
  opt_state = jax.vmap(optimizer.init)(params)
  one = Buffer.empty(cfg.buffer_capacity, cfg.max_len, cfg.max_new_tokens,
                     cfg.teacher_k)
  buffer = jax.tree.map(
      lambda x: jnp.broadcast_to(x, (num_devices, cfg.num_drafts) + x.shape).copy(),
      one)
  zeros = lambda: jnp.zeros((cfg.num_drafts,), jnp.int32)  # distinct buffers
  return OnlineState(params, opt_state, buffer,
                     jax.random.split(jax.random.key(seed), num_devices),
                     zeros(), zeros(), zeros())


def _training_rows(target_params, draft_params, prompts, lens, served: Served,
                   rng, tcfg, dcfg, cfg: OnlineConfig):
  """(tokens [B, L], generated tokens' weights [B, G], teacher ids, probs)."""
  tokens, lengths = served.tokens, served.lengths
  t_ids, t_probs = served.teacher_ids, served.teacher_probs
  weight = (served.is_corrected if cfg.loss_weighting == "corrected"
            else jnp.ones_like(served.is_corrected))
  if cfg.sample_source != "served":
    source_rng, gen_rng = jax.random.split(rng)
    mix = cfg.source_mix if cfg.sample_source == "mixed_token" else 0.0
    s_tokens, s_lengths, s_ids, s_probs = samples.student_generate(
        target_params, draft_params, prompts, lens, gen_rng, target_config=tcfg,
        draft_config=dcfg, sampling=cfg.sampling,
        max_new_tokens=cfg.max_new_tokens, teacher_mix=mix,
        teacher_k=cfg.teacher_k)
    # No verification happened on these tokens: every position is weighted.
    is_student = jnp.ones(lengths.shape, bool)
    if cfg.sample_source == "mixed_request":
      is_student = jax.random.uniform(source_rng, lengths.shape) >= cfg.source_mix
    pick = lambda s, t: jnp.where(
        is_student.reshape((-1,) + (1,) * (s.ndim - 1)), s, t)
    tokens, lengths = pick(s_tokens, tokens), pick(s_lengths, lengths)
    t_ids, t_probs = pick(s_ids, t_ids), pick(s_probs, t_probs)
    weight = pick(jnp.ones_like(weight), weight)
  gen = jnp.arange(cfg.max_new_tokens)
  weight = (weight & (gen < lengths[:, None])).astype(jnp.float32)
  full = jnp.pad(prompts, ((0, 0), (0, cfg.max_new_tokens)))

  def place(row, generated, start):
    return jax.lax.dynamic_update_slice(row, generated, (start,))

  full = jax.vmap(place)(full, tokens, lens)
  return full, weight, t_ids, t_probs


def _distill(target_params, params, opt_state, buffer: Buffer, tcfg, dcfg,
             cfg: OnlineConfig, axis_name):
  """One optimizer step on the buffer; (params, opt_state, loss, applied).

  Devices hold different amounts of loss weight (EOS, corrections, pad
  rows), so weighted sums and total weight are summed over devices before
  dividing: the update equals a single device's on the whole batch.
  """
  optimizer = update.make_optimizer(cfg.distill)
  p = update.teacher_probs(target_params, tcfg, buffer)
  (loss_sum, total), grads = jax.value_and_grad(
      update.weighted_loss_sum, has_aux=True)(params, dcfg, buffer, p,
                                               cfg.distill)
  if axis_name is not None:
    loss_sum, total, grads = jax.lax.psum((loss_sum, total, grads), axis_name)
  scale = 1.0 / jnp.maximum(total, 1.0)
  grads = jax.tree.map(lambda g: g * scale, grads)
  loss = loss_sum * scale
  params, opt_state, applied = update.apply_update(params, opt_state, grads,
                                                   loss, optimizer)
  return params, opt_state, loss, applied


def serve_and_learn(target_params, state: OnlineState, prompts_BxP, lens_B,
                    is_real_B, draft_index, *, target_config: LlamaConfig,
                    draft_config: LlamaConfig, cfg: OnlineConfig,
                    axis_name: str | None = None) -> tuple[OnlineState, StepOutput]:
  """One batch on one device (inside shard_map when axis_name is set).

  Rows with is_real False pad the last batch: served, but neither buffered
  nor counted towards the update interval.
  """
  pick = lambda tree: jax.tree.map(lambda x: x[draft_index], tree)
  params, opt_state = pick(state.draft_params), pick(state.opt_state)
  buffer = pick(jax.tree.map(lambda x: x[0], state.buffer))
  rng, serve_rng, sample_rng = jax.random.split(state.rng[0], 3)

  served = serve_batch(target_params, params, prompts_BxP, lens_B, serve_rng,
                       target_config=target_config, draft_config=draft_config,
                       k=cfg.k, sampling=cfg.sampling,
                       max_new_tokens=cfg.max_new_tokens,
                       teacher_k=cfg.teacher_k)
  rows = _training_rows(target_params, params, prompts_BxP, lens_B, served,
                        sample_rng, target_config, draft_config, cfg)
  buffer = buffer.add(rows[0], lens_B - 1, *rows[1:],
                      jnp.full(lens_B.shape, draft_index), is_real_B)
  new_requests = is_real_B.sum().astype(jnp.int32)
  if axis_name is not None:
    new_requests = jax.lax.psum(new_requests, axis_name)
  since = state.since_update[draft_index] + new_requests
  do_update = since >= cfg.update_interval

  def learn(operand):
    params, opt_state, buffer = operand
    params, opt_state, loss, applied = _distill(
        target_params, params, opt_state, buffer, target_config, draft_config,
        cfg, axis_name)
    if cfg.clear_after_update:
      buffer = buffer.cleared()
    return params, opt_state, buffer, loss, applied

  def wait(operand):
    params, opt_state, buffer = operand
    return params, opt_state, buffer, jnp.float32(jnp.nan), jnp.bool_(False)

  params, opt_state, buffer, loss, applied = jax.lax.cond(
      do_update, learn, wait, (params, opt_state, buffer))
  put = lambda tree, new: jax.tree.map(
      lambda x, n: x.at[draft_index].set(n), tree, new)
  state = OnlineState(
      draft_params=put(state.draft_params, params),
      opt_state=put(state.opt_state, opt_state),
      buffer=jax.tree.map(lambda x, n: x.at[0, draft_index].set(n),
                          state.buffer, buffer),
      rng=rng[None],
      since_update=state.since_update.at[draft_index].set(
          jnp.where(do_update, 0, since)),
      num_updates=state.num_updates.at[draft_index].add(do_update.astype(jnp.int32)),
      num_skipped=state.num_skipped.at[draft_index].add(
          (do_update & ~applied).astype(jnp.int32)))
  metrics = served.metrics
  if axis_name is not None:  # per-position counts: one total for the batch
    metrics = metrics.replace(
        reached_by_position=jax.lax.psum(metrics.reached_by_position, axis_name),
        accepted_by_position=jax.lax.psum(metrics.accepted_by_position, axis_name))
  out = StepOutput(served.tokens, served.lengths, metrics, do_update, loss,
                   applied)
  return state, out


@functools.lru_cache(maxsize=16)
def make_step(mesh: jax.sharding.Mesh, *, target_config: LlamaConfig,
              draft_config: LlamaConfig, cfg: OnlineConfig):
  """The jitted, shard_mapped step: (target_params, state, prompts, lens, is_real, d).

  Memoised on its (hashable) arguments, so every stream served with the same
  settings reuses one compiled program.
  """
  step = functools.partial(serve_and_learn, target_config=target_config,
                           draft_config=draft_config, cfg=cfg, axis_name=AXIS)
  state_specs = OnlineState(P(), P(), P(AXIS), P(AXIS), P(), P(), P())
  row = P(AXIS)
  metric_specs = speculative.Metrics(row, row, row, row, row, row, P(), P())
  out_specs = StepOutput(row, row, metric_specs, P(), P(), P())
  sharded = jax.shard_map(
      step, mesh=mesh,
      in_specs=(P(), state_specs, P(AXIS), P(AXIS), P(AXIS), P()),
      out_specs=(state_specs, out_specs), check_vma=False)
  return jax.jit(sharded, donate_argnums=(1,))


def make_mesh(num_devices: int | None = None) -> jax.sharding.Mesh:
  """A 1-D mesh over the first num_devices devices (all, every host, if None)."""
  devices = jax.devices()[:num_devices] if num_devices else jax.devices()
  return jax.sharding.Mesh(devices, (AXIS,))


def place_state(state: OnlineState, mesh: jax.sharding.Mesh) -> OnlineState:
  """Drafts and counters replicated; buffers and rng split across devices."""
  rep = lambda t: distributed.replicate(t, mesh)
  split = lambda t: distributed.shard_leading(t, mesh, AXIS)
  return OnlineState(rep(state.draft_params), rep(state.opt_state),
                     split(state.buffer), split(state.rng),
                     rep(state.since_update), rep(state.num_updates),
                     rep(state.num_skipped))
