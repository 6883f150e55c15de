"""Flags of experiments.serve: serving, learning, state; and the configs they make."""

from absl import flags

from osd_jax.distillation import losses
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import online
from osd_jax.serving.live import LiveConfig

# HTTP.
HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
MODEL_NAME = flags.DEFINE_string(
    "served_model_name", None, "Model name clients pass (default: --target).")
DRAIN_S = flags.DEFINE_integer(
    "drain_s", 30, "On SIGTERM/SIGINT, seconds in-flight requests get to finish"
    " before they are cut off with an error.")
# Serving.
K = flags.DEFINE_integer("k", 4, "Draft tokens per speculative step.")
MAX_TOKENS = flags.DEFINE_integer("max_tokens", 256, "The most tokens a request may ask for.")
CACHE_SIZE = flags.DEFINE_integer(
    "cache_size", 1024, "Positions per slot: prompt + max_tokens + k must fit.")
SLOTS = flags.DEFINE_integer("slots", 8, "Decode slots (requests in flight), all devices.")
STEPS_PER_CALL = flags.DEFINE_integer(
    "steps_per_call", 4, "Speculative steps per engine call: tokens stream back,"
    " and queued requests get slots, between calls.")
DEVICES = flags.DEFINE_string("devices", "all", "'all' or how many local devices.")
TEMPERATURE = flags.DEFINE_float(
    "temperature", 1.0, "Temperature of requests that name none (OpenAI's default).")
TOP_P = flags.DEFINE_float("top_p", 1.0, "top_p of requests that name none.")
TOP_K = flags.DEFINE_integer("top_k", 0, "top_k of requests that name none; 0 = off.")
SEED = flags.DEFINE_integer("seed", 0, "Draws the seeds of requests that bring none.")
WARM_UP = flags.DEFINE_bool(
    "warm_up", True, "Compile every program before listening, so no request"
    " waits on a compile.")
COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "", "Persistent XLA compilation cache directory (e.g."
    " ~/.cache/osd_jax/xla), so a restart skips the compiles; '' disables.")
# Learning.
LEARN = flags.DEFINE_bool("learn", True, "Distil the draft on the traffic; --nolearn"
                          " keeps it frozen.")
UPDATE_INTERVAL = flags.DEFINE_integer(
    "update_interval", 8, "I: finished requests between draft updates (paper: 8).")
UPDATE_STEPS = flags.DEFINE_integer(
    "update_steps", 1, "Optimizer steps per update, each over the whole buffer.")
BUFFER_CAPACITY = flags.DEFINE_integer("buffer_capacity", 16, "Samples kept per device.")
KEEP_BUFFER = flags.DEFINE_bool(
    "keep_buffer", True, "Keep the ring buffer after an update (the paper clears it).")
TRAIN_LEN = flags.DEFINE_integer(
    "train_len", 0, "Positions of a buffered sample (0: --cache_size); longer"
    " requests are served but not learnt from.")
TEACHER_TOPK = flags.DEFINE_integer(
    "teacher_topk", 32, "Keep the target's top-k from verification; 0 ="
    " recompute the teacher with a target forward at update time.")
LOSS = flags.DEFINE_enum("loss", "fkl", list(losses.NAMES), "Divergence.")
LOSS_BETA = flags.DEFINE_float("loss_beta", 0.5, "Weight of the generalised JSD.")
LOSS_TEMPERATURE = flags.DEFINE_float("loss_temperature", 1.0, "Distillation temperature.")
LOSS_WEIGHTING = flags.DEFINE_enum(
    "loss_weighting", "all", ["corrected", "all"],
    "Distil on every generated token, or on corrected/bonus tokens only (paper).")
OPTIMIZER = flags.DEFINE_enum("optimizer", "adamw", ["adamw", "adam", "sgd"], "Optimizer.")
LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Draft learning rate.")
CLIP_NORM = flags.DEFINE_float("clip_norm", 0.0, "Global-norm clipping; 0 = off.")
WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
ROLLING_WINDOW = flags.DEFINE_integer(
    "rolling_window", 16, "Finished requests in /metrics' rolling alpha.")
# State.
CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Orbax checkpoints of the draft, optimizer and buffer"
    " (none if unset).")
CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 16, "Draft updates between checkpoints (0: only at exit).")
RESUME = flags.DEFINE_bool("resume", False, "Continue from --checkpoint_dir's newest"
                           " checkpoint.")
EXPORT_DIR = flags.DEFINE_string(
    "export_dir", None, "Where POST /v1/draft/export, and the exit, write the draft"
    " as an HF directory (none if unset).")


def online_config() -> online.OnlineConfig:
  """The engine's static settings; each request brings its own sampling."""
  return online.OnlineConfig(
      k=K.value, sampling=None, max_new_tokens=MAX_TOKENS.value,
      cache_size=CACHE_SIZE.value, train_len=TRAIN_LEN.value,
      steps_per_call=STEPS_PER_CALL.value, learn=LEARN.value,
      update_interval=UPDATE_INTERVAL.value, update_steps=UPDATE_STEPS.value,
      buffer_capacity=BUFFER_CAPACITY.value, clear_after_update=not KEEP_BUFFER.value,
      teacher_k=TEACHER_TOPK.value, loss_weighting=LOSS_WEIGHTING.value,
      distill=DistillConfig(
          loss=LOSS.value, beta=LOSS_BETA.value, temperature=LOSS_TEMPERATURE.value,
          optimizer=OPTIMIZER.value, learning_rate=LEARNING_RATE.value,
          weight_decay=WEIGHT_DECAY.value, clip_norm=CLIP_NORM.value))


def live_config() -> LiveConfig:
  return LiveConfig(num_slots=SLOTS.value, checkpoint_every=CHECKPOINT_EVERY.value,
                    export_dir=EXPORT_DIR.value, rolling_window=ROLLING_WINDOW.value,
                    seed=SEED.value)
