"""Flags of the online update, shared by the main job and the server."""

from absl import flags

from osd_jax.distillation import losses
from osd_jax.distillation.update import DistillConfig

UPDATE_INTERVAL = flags.DEFINE_integer(
    "update_interval", 8, "I: finished requests between draft updates (paper: 8).",
    lower_bound=1)
UPDATE_STEPS = flags.DEFINE_integer(
    "update_steps", 1, "Optimizer steps per update, each over the whole buffer"
    " or a --minibatch drawn from it.", lower_bound=1)
MINIBATCH = flags.DEFINE_integer(
    "minibatch", 0, "Samples per optimizer step, drawn anew each step from the"
    " ring (all devices' rings together): the ring is replayed, at a cost set"
    " by --update_steps x --minibatch; 0: every step over the whole buffer.",
    lower_bound=0)
UPDATE_STEPS_PER_CALL = flags.DEFINE_integer(
    "update_steps_per_call", 0, "Split each update over serve calls, at most"
    " this many of its optimizer steps in each: every stream in flight waits"
    " for a few steps at a time instead of a whole update (a smaller stall of"
    " inter-token latency), and the update ends some calls later, training"
    " also on requests that finish meanwhile. Needs --minibatch replay from"
    " the kept ring (--keep_buffer); 0: a whole update in one call.",
    lower_bound=0)
SHIFT_STEPS = flags.DEFINE_integer(
    "shift_steps", 0, "A reaction to a shift: extra optimizer steps in an update"
    " whose loss before it exceeds --shift_ratio x the running mean of those"
    " of past updates (0: none).", lower_bound=0)
SHIFT_RATIO = flags.DEFINE_float(
    "shift_ratio", 1.5, "How far above its running mean the loss before an"
    " update must be for --shift_steps.", lower_bound=1.0)
BUFFER_CAPACITY = flags.DEFINE_integer(
    "buffer_capacity", 8, "Samples kept per device (and draft); with the"
    " default --update_interval, each sample is in one update.", lower_bound=1)
KEEP_BUFFER = flags.DEFINE_bool(
    "keep_buffer", True, "Keep the ring buffer after an update, so each sample"
    " is seen capacity / update_interval times (the paper clears it:"
    " --nokeep_buffer --buffer_capacity=8).")
flags.register_multi_flags_validator(
    [UPDATE_STEPS_PER_CALL.name, MINIBATCH.name, KEEP_BUFFER.name],
    lambda f: not f[UPDATE_STEPS_PER_CALL.name] or (f[MINIBATCH.name] > 0
                                                     and f[KEEP_BUFFER.name]),
    "--update_steps_per_call needs --minibatch > 0 and --keep_buffer: each step"
    " draws anew from the ring.")
TRAIN_LEN = flags.DEFINE_integer(
    "train_len", 0, "Positions of a buffered sample (0: --cache_size); longer"
    " requests are served but not learnt from.")
KEEP_PROMPT_CACHE = flags.DEFINE_bool(
    "keep_prompt_cache", True, "Buffer the model draft's prompt keys and values"
    " from serving's prefill, so an update does not run the draft over every"
    " prompt again (they are the draft's as the request came in; 1.57 MB a"
    " sample for the default draft).")
TEACHER_TOPK = flags.DEFINE_integer(
    "teacher_topk", 32, "Keep the target's top-k from verification; 0 ="
    " recompute the teacher with a target forward at update time.")
LOSS = flags.DEFINE_enum("loss", "fkl", list(losses.NAMES), "Divergence.")
LOSS_BETA = flags.DEFINE_float("loss_beta", 0.5, "Weight of the generalised JSD.")
LOSS_TEMPERATURE = flags.DEFINE_float("loss_temperature", 1.0, "Distillation temperature.")
LOSS_WEIGHTING = flags.DEFINE_enum(
    "loss_weighting", "all", ["corrected", "all", "lookup_missed"],
    "Distil on every generated token, on corrected/bonus tokens only (paper),"
    " or on the tokens of steps where the hybrid's lookup proposed nothing,"
    " the ones its learned draft is called on (needs a gated hybrid).")
OPTIMIZER = flags.DEFINE_enum("optimizer", "adamw", ["adamw", "adam", "sgd"], "Optimizer.")
LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 1e-3, "Draft learning rate. The paper used 1e-4; drafts cut"
    " from SmolLM2 learn far faster at 1e-3 (see README).")
CLIP_NORM = flags.DEFINE_float("clip_norm", 0.0, "Global-norm clipping; 0 = off.",
                               lower_bound=0.0)
WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
LEARNING_BUDGET = flags.DEFINE_float(
    "learning_budget", 0.0, "Share of serving time the draft's updates may"
    " take; a due update waits while they have taken more (0: no limit, an"
    " update every --update_interval requests).", lower_bound=0.0, upper_bound=0.99)
LEARNING_PAYBACK = flags.DEFINE_float(
    "learning_payback", 0.5, "Besides --learning_budget: updates may take at"
    " most this share of the seconds the learned draft has saved so far (its"
    " accepted tokens at what a served token has cost); the first update is"
    " free. Where the draft serves little, learning stops until it earns. 0:"
    " off.", lower_bound=0.0, upper_bound=1.0)
TRAIN_EMBEDDING = flags.DEFINE_bool(
    "train_embedding", False, "Train the draft's token embedding online too"
    " (off: it stays as it started, with no gradient or optimizer state).")


# What DistillConfig reads (the rest is the serving loop's buffer and schedule).
DISTILL_FLAGS = (LOSS.name, LOSS_BETA.name, LOSS_TEMPERATURE.name, OPTIMIZER.name,
                 LEARNING_RATE.name, WEIGHT_DECAY.name, CLIP_NORM.name,
                 TRAIN_EMBEDDING.name)


def online_fields(**distill_extra) -> dict:
  """OnlineConfig's learning fields from these flags; `distill_extra` adds
  DistillConfig fields of the caller's own flags (a schedule, say)."""
  return dict(
      train_len=TRAIN_LEN.value, update_interval=UPDATE_INTERVAL.value,
      update_steps=UPDATE_STEPS.value,
      update_steps_per_call=UPDATE_STEPS_PER_CALL.value, minibatch=MINIBATCH.value,
      shift_steps=SHIFT_STEPS.value, shift_ratio=SHIFT_RATIO.value,
      buffer_capacity=BUFFER_CAPACITY.value,
      clear_after_update=not KEEP_BUFFER.value, teacher_k=TEACHER_TOPK.value,
      keep_prompt_cache=KEEP_PROMPT_CACHE.value,
      loss_weighting=LOSS_WEIGHTING.value,
      distill=DistillConfig(
          loss=LOSS.value, beta=LOSS_BETA.value, temperature=LOSS_TEMPERATURE.value,
          optimizer=OPTIMIZER.value, learning_rate=LEARNING_RATE.value,
          weight_decay=WEIGHT_DECAY.value, clip_norm=CLIP_NORM.value,
          train_embedding=TRAIN_EMBEDDING.value, **distill_extra))


def learn_with_replay() -> None:
  """Defaults of the entry points that serve and learn (issue 44): a ring of
  the last 32 requests, replayed in 4 steps of 8 samples every 8 requests.
  That is offline's optimizer compute per request (the paper experiment
  `main`: 64 prompts, 4 epochs of minibatches of 8, 32 steps a domain;
  online 8 updates of 4), where one full-buffer step an update gave a
  quarter of it and stopped learning half-way. At a domain change the loss
  before an update jumps: such an update takes 4 more steps."""
  flags.set_default(UPDATE_STEPS, 4)
  flags.set_default(MINIBATCH, 8)
  flags.set_default(BUFFER_CAPACITY, 32)
  flags.set_default(SHIFT_STEPS, 4)
