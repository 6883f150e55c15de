"""Flags of experiments.serve: serving, learning, state; and the configs they make."""

from absl import flags

from experiments import compilation_cache, learning_flags, step_flags, verify_flags
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
K = flags.DEFINE_integer("k", 4, "Draft tokens per speculative step; 0 serves the"
                        " target alone (with --nolearn).", lower_bound=0)
SPECULATE = flags.DEFINE_enum(
    "speculate", "auto", ["auto", "always"], "auto: each call speculates or runs"
    " the target alone, whichever has been faster at its number of slots"
    " (measured as it serves; a plain program per serve program compiles too);"
    " always: every call speculates.")
MAX_TOKENS = flags.DEFINE_integer("max_tokens", 256, "The most tokens a request may ask for.")
CACHE_SIZE = flags.DEFINE_integer(
    "cache_size", 1024, "Positions per slot: prompt + max_tokens + k must fit.")
SLOTS = flags.DEFINE_integer("slots", 8, "Decode slots (requests in flight), all devices.")
STEPS_PER_CALL = flags.DEFINE_integer(
    "steps_per_call", 4, "Speculative steps per engine call: tokens stream back,"
    " and queued requests get slots, between calls.")
DEVICES = flags.DEFINE_string("devices", "all", "'all' or how many local devices.")
# The ranges the API accepts in a request (serving/api/parse.py).
TEMPERATURE = flags.DEFINE_float(
    "temperature", 1.0, "Temperature of requests that name none (OpenAI's default).",
    lower_bound=0.0, upper_bound=2.0)
TOP_P = flags.DEFINE_float("top_p", 1.0, "top_p of requests that name none, in (0, 1].",
                           upper_bound=1.0)
flags.register_validator(TOP_P.name, lambda p: p > 0.0, "--top_p must be above 0.")
TOP_K = flags.DEFINE_integer("top_k", 0, "top_k of requests that name none; 0 = off.",
                             lower_bound=0)
MAX_LOGPROBS = flags.DEFINE_integer(
    "max_logprobs", 20, "The most top log-probs a request may ask for (completions'"
    " logprobs, chat's top_logprobs; 0 allows only the emitted token's). The slots"
    " keep that many per emitted token, from the target's raw logits (vLLM's"
    " max_logprobs and raw_logprobs); a request beyond it is a 400.",
    lower_bound=0, upper_bound=20)
SEED = flags.DEFINE_integer("seed", 0, "Draws the seeds of requests that bring none.")
WARM_UP = flags.DEFINE_bool(
    "warm_up", True, "Compile every program before taking requests (/health"
    " answers 503 meanwhile), so no request waits on a compile.")
COMPILATION_CACHE = compilation_cache.FLAG
# Learning.
LEARN = flags.DEFINE_bool("learn", True, "Distil the draft on the traffic; --nolearn"
                          " keeps it frozen.")
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
      cache_size=CACHE_SIZE.value, steps_per_call=STEPS_PER_CALL.value,
      learn=LEARN.value, batch_k=step_flags.batch_k(),
      trim_verify=verify_flags.TRIM_VERIFY.value, max_logprobs=MAX_LOGPROBS.value,
      **learning_flags.online_fields())


def live_config() -> LiveConfig:
  return LiveConfig(num_slots=SLOTS.value, checkpoint_every=CHECKPOINT_EVERY.value,
                    export_dir=EXPORT_DIR.value, rolling_window=ROLLING_WINDOW.value,
                    seed=SEED.value,
                    learning_budget=learning_flags.LEARNING_BUDGET.value,
                    learning_payback=learning_flags.LEARNING_PAYBACK.value,
                    choose_calls=SPECULATE.value == "auto")
