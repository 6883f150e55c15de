"""What a serve call does for learning: buffer the requests that finished,
then update each draft whose turn it is (serving/online.py calls `learn`).

Every device runs this on its own slots and buffers; the counts and the
update's sums go over the device axis, so every replica of a draft takes
the same steps.
"""

import flax
import jax
import jax.numpy as jnp

from osd_jax.decoding.drafts import HybridDraft
from osd_jax.distillation import objectives, replay, samples
from osd_jax.serving.records import samples as record_samples
from osd_jax.when import when


@flax.struct.dataclass
class StepOutput:
  """What one serve call did besides decoding (per draft)."""

  did_update: jax.Array  # [num_drafts] bool
  loss: jax.Array  # [num_drafts] meaningful only where did_update
  skipped: jax.Array  # [num_drafts] optimizer steps skipped in this call
  # The updated draft's acceptance on what it trained on (NaN: not estimated).
  acceptance: jax.Array  # [num_drafts]
  # Took optimizer steps in this call: with updates split over calls
  # (OnlineConfig.update_steps_per_call), also in those that do not finish one.
  trained: jax.Array  # [num_drafts] bool


def kept_prompts(cfg, drafter, draft_state):
  """The draft cache whose prompt keys/values the buffer keeps (Buffer.prompt_k),
  or None: not asked for, not learning, trained through the prompt, or not a
  model draft (objectives.served_cache)."""
  if not (cfg.learn and cfg.keep_prompt_cache) or cfg.distill.prompt_gradient:
    return None
  return objectives.served_cache(drafter, draft_state)


def reports_misses(drafter) -> bool:
  """Whether the drafter says where its lookup missed (a gated hybrid)."""
  return isinstance(drafter, HybridDraft) and bool(drafter.draft_cost)


def _student_rows(target_params, draft_params, state, rows, rng,
                  target_config, drafter, cfg):
  """Rows whose tokens the draft wrote (sample_source draft or mixed)."""
  tokens, gen_start, weight, ids, probs, hidden = rows
  base = objectives.learnable(drafter.base)
  width = cfg.sample_len - cfg.max_new_tokens
  prompts = tokens[:, :width]
  lens = state.slots.prompt_lens
  source_rng, gen_rng = jax.random.split(rng)
  mix = cfg.source_mix if cfg.sample_source == "mixed_token" else 0.0
  # The first draft stands in for all when there are several.
  s_tokens, s_lengths, s_ids, s_probs = samples.student_generate(
      target_params, draft_params[0], prompts, lens, gen_rng,
      target_config=target_config, draft_config=base.config, sampling=cfg.sampling,
      max_new_tokens=cfg.max_new_tokens, teacher_mix=mix, teacher_k=cfg.teacher_k)
  is_student = jnp.ones(lens.shape, bool)
  if cfg.sample_source == "mixed_request":
    is_student = jax.random.uniform(source_rng, lens.shape) >= cfg.source_mix
  pick = lambda s, t: jnp.where(is_student.reshape((-1,) + (1,) * (s.ndim - 1)), s, t)
  full = jnp.pad(prompts, ((0, 0), (0, cfg.max_new_tokens)))
  full = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(
      row, new, (start,)))(full, s_tokens, lens)
  # No verification happened on these tokens: every position is weighted.
  s_weight = (jnp.arange(cfg.max_new_tokens) < s_lengths[:, None]).astype(jnp.float32)
  return (pick(full, tokens), gen_start, pick(s_weight, weight), pick(s_ids, ids),
          pick(s_probs, probs), hidden)


def has_work(state, finished, may_update, *, cfg, axis_name):
  """Whether `learn` would do anything but split the rng after a call in
  which `finished` requests finished: buffer one that keeps its sample
  (Records.keeps), or take an update's steps (one is due, or split over
  calls and not done) where `may_update`."""
  any_finished = (finished & state.records.keeps).any().astype(jnp.int32)
  if axis_name is not None:
    any_finished = jax.lax.pmax(any_finished, axis_name)
  # since_update counts requests of earlier calls: an update the budget held.
  due = (state.update_steps_done > 0) | (state.since_update >= cfg.update_interval)
  return (any_finished > 0) | (may_update & due.any())


def learn(target_params, state, finished, rng, may_update, *,
          target_config, drafter, cfg, axis_name):
  """Buffers every finished request that keeps its sample with its draft;
  updates drafts whose turn it is, if `may_update` (else they wait:
  learning_budget).

  A draft's turn comes every `update_interval` buffered requests. Where this
  call's requests would overwrite samples not yet trained on, the update
  trains on those first and buffers the new ones after, for the next. A gated
  hybrid's gate then takes the new draft's acceptance on what it trained on.

  With `update_steps_per_call`, an update takes that many of its steps per
  call, over as many calls as it needs: the streams in flight wait for a
  few steps, not the whole update. Requests that finish meanwhile join the
  ring the later steps draw from; another update starts only after it.
  """
  slots = state.slots
  finished = finished & state.records.keeps
  rows = record_samples(state.records, slots, max_len=cfg.sample_len,
                        gen_len=cfg.max_new_tokens, weighting=cfg.loss_weighting)
  if cfg.sample_source != "served":
    rows = jax.lax.cond(
        finished.any(),
        lambda: _student_rows(target_params, drafter.prepare(state.draft_params),
                              state, rows, rng, target_config, drafter, cfg),
        lambda: rows)
  tokens, gen_start, weight, ids, probs, hidden = rows
  fits = slots.prompt_lens + slots.num_generated <= cfg.sample_len
  params, opt_state, buffer = state.draft_params, state.opt_state, state.buffer
  since, updates, skipped, last, keys, accepted, mean = (
      state.since_update, state.num_updates, state.num_skipped, state.last_loss,
      state.replay_key, state.last_acceptance, state.loss_mean)
  steps_done, first_loss = state.update_steps_done, state.update_first_loss
  split = cfg.update_steps_per_call > 0
  did, losses, skips, estimates, trained = [], [], [], [], []
  learner = objectives.learnable(drafter.base)
  gated = (drafter.base if reports_misses(drafter.base) and cfg.reestimate_gate
           else None)
  greedy = cfg.sampling is not None and cfg.sampling.is_greedy
  draft_states = list(slots.draft)
  nan = jnp.float32(jnp.nan)
  for d in range(cfg.num_drafts):
    take = lambda tree, d=d: jax.tree.map(lambda x: x[d], tree)
    is_new = finished & fits & (slots.route == d)
    prompt_cache = kept_prompts(cfg, drafter.base, slots.draft[d])

    def add(buf, is_new=is_new, prompt_cache=prompt_cache):
      return buf.add(tokens, gen_start, weight, ids, probs, slots.route, is_new,
                     hidden, prompt_cache, uid_B=state.records.uid)

    buf = take(jax.tree.map(lambda x: x[0], buffer))
    new = is_new.sum().astype(jnp.int32)
    overflow = ((buf.num_fresh > 0) & (new > buf.room())).astype(jnp.int32)
    if axis_name is not None:
      new = jax.lax.psum(new, axis_name)
      overflow = jax.lax.pmax(overflow, axis_name)
    count = since[d] + new
    ongoing = steps_done[d] > 0  # an update split over calls, not finished
    starts = (count >= cfg.update_interval) & may_update & ~ongoing
    stepping = starts | (ongoing & may_update)
    first = starts & (overflow > 0)  # train on the waiting ones, then buffer these
    # Only in calls where a request finished: adding nothing still rewrote
    # every field, the kept prompt caches (MBs) included, on every call.
    buf = when(is_new.any() & ~first, add, buf)
    key, draw_key = jax.random.split(keys[d])

    # NaN before the first update: no shift to react to.
    threshold = cfg.shift_ratio * mean[d]

    def train(operand, draw_key=draw_key, threshold=threshold, starts=starts,
              done=steps_done[d], first=first_loss[d]):
      p, o, buf = operand[:3]
      if split:  # the next steps of the update; it ends when none are left
        p, o, loss, bad, done = objectives.distill_part(
            learner, target_params, target_config, p, o, buf, cfg.distill,
            done=done, first_loss=first,
            max_steps=cfg.update_steps_per_call, steps=cfg.update_steps,
            minibatch=cfg.minibatch, key=draw_key, extra_steps=cfg.shift_steps,
            extra_above=threshold, axis_name=axis_name)
        ends = done >= cfg.update_steps + jnp.where(loss > threshold,
                                                    cfg.shift_steps, 0)
        done = jnp.where(ends, 0, done)
      else:
        p, o, loss, bad = objectives.distill(
            learner, target_params, target_config, p, o, buf, cfg.distill,
            steps=cfg.update_steps, minibatch=cfg.minibatch, key=draw_key,
            extra_steps=cfg.shift_steps, extra_above=threshold,
            axis_name=axis_name)
        done, ends = jnp.int32(0), jnp.bool_(True)
      estimate = nan
      if gated is not None:  # on the first step's samples: what it trained on
        def estimated(_):
          seen = (replay.draw(buf, replay.step_key(draw_key, 0), cfg.minibatch,
                              axis_name) if cfg.minibatch else buf)
          return objectives.expected_acceptance(
              learner, target_params, target_config, p, seen, greedy=greedy,
              axis_name=axis_name)
        estimate = when(ends, estimated, nan) if split else estimated(nan)
      if cfg.clear_after_update:
        buf = buf.cleared()
      else:  # what the ring held as the update started is in its draws
        buf = buf.replace(num_fresh=jnp.where(starts, 0, buf.num_fresh))
      return p, o, buf, loss, bad, estimate, done, ends

    unchanged = (take(params), take(opt_state), buf, first_loss[d], jnp.int32(0),
                 nan, steps_done[d], jnp.bool_(False))
    p, o, buf, loss, bad, estimate, done, do = (
        when(stepping, train, unchanged))
    buf = when(first & is_new.any(), add, buf)
    if gated is not None:
      draft_states[d] = gated.with_estimate(draft_states[d], estimate, cfg.k)
    put = lambda tree, new, d=d: jax.tree.map(lambda x, n: x.at[d].set(n), tree, new)
    params, opt_state = put(params, p), put(opt_state, o)
    buffer = jax.tree.map(lambda x, n, d=d: x.at[0, d].set(n), buffer, buf)
    # What the update did not train on counts towards the next: in a ring
    # the surplus (one update per I requests in the long run), after a
    # clear nothing, and after training first this call's requests.
    rest = 0 if cfg.clear_after_update else count - cfg.update_interval
    since = since.at[d].set(jnp.where(first, new, jnp.where(starts, rest, count)))
    steps_done = steps_done.at[d].set(done)
    first_loss = first_loss.at[d].set(jnp.where(do, nan, loss))
    updates = updates.at[d].add(do.astype(jnp.int32))
    skipped = skipped.at[d].add(bad)
    last = last.at[d].set(jnp.where(do, loss, last[d]))
    mean = mean.at[d].set(_running_mean(mean[d], loss, do))
    accepted = accepted.at[d].set(jnp.where(do, estimate, accepted[d]))
    keys = keys.at[d].set(jnp.where(do, key, keys[d]))
    did.append(do)
    losses.append(loss)
    skips.append(bad)
    estimates.append(estimate)
    trained.append(stepping)
  state = state.replace(draft_params=params, opt_state=opt_state, buffer=buffer,
                        since_update=since, num_updates=updates,
                        num_skipped=skipped, last_loss=last, replay_key=keys,
                        loss_mean=mean,
                        last_acceptance=accepted, update_steps_done=steps_done,
                        update_first_loss=first_loss,
                        slots=slots.replace(draft=tuple(draft_states)))
  return state, StepOutput(jnp.stack(did), jnp.stack(losses), jnp.stack(skips),
                           jnp.stack(estimates), jnp.stack(trained))


# Weight of the newest loss in the running mean a shift is measured against
# (about the last 3 updates: a domain's loss settles within a few).
LOSS_RATE = 0.3


def _running_mean(mean: jax.Array, loss: jax.Array, updated: jax.Array) -> jax.Array:
  """The mean after an update's loss (the first such loss starts it)."""
  new = jnp.where(jnp.isnan(mean), loss, mean + LOSS_RATE * (loss - mean))
  return jnp.where(updated & jnp.isfinite(loss), new, mean)
