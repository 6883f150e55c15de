"""Generate text with the target alone (--k=0) or speculatively with a draft.

  python -m experiments.generate --prompt="The capital of France is"
  python -m experiments.generate --chat --k=4 --output=json --prompt="Write a haiku"
  python -m experiments.generate --chat --k=4 --draft=ngram --prompt="Write a haiku"
"""

import json
import math
import time

from absl import flags
import jax

from experiments import cli, model_flags, verify_flags
from osd_jax.decoding.engine import Engine, acceptance_by_position, summarize
from osd_jax.decoding.sampling import Sampling

PROMPTS = flags.DEFINE_multi_string(
    "prompt", ["The capital of France is"], "Prompt; repeat for a batch.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per prompt.")
TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus mass; 1.0 = off.")
TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely; 0 = off.")
SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
CHAT = flags.DEFINE_bool("chat", False, "Apply the tokenizer's chat template.")
K = flags.DEFINE_integer("k", 0, "Draft tokens per step; 0 = target only.",
                        lower_bound=0)
OUTPUT = flags.DEFINE_enum("output", "text", ["text", "json"], "Output format.")
model_flags.serve_with_the_best_draft()  # the draft of --k >= 1


def strict_json(record: dict) -> str:
  """One JSON line that jq and JSON.parse read: a metric with no value (alpha
  when nothing was drafted is NaN) is null, not Python's NaN."""
  def finite(x):
    if isinstance(x, dict):
      return {key: finite(value) for key, value in x.items()}
    if isinstance(x, list):
      return [finite(value) for value in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x
  return json.dumps(finite(record), allow_nan=False)


def main(argv):
  del argv
  target = model_flags.load_target()
  draft = model_flags.load_draft(target) if K.value else None
  engine = Engine(target, draft, k=K.value,
                  sampling=Sampling(TEMPERATURE.value, TOP_K.value, TOP_P.value),
                  max_new_tokens=MAX_NEW_TOKENS.value,
                  trim_verify=verify_flags.TRIM_VERIFY.value)
  start = time.perf_counter()
  completions = engine.generate(PROMPTS.value, chat=CHAT.value, seed=SEED.value)
  seconds = time.perf_counter() - start
  for c in completions:
    if OUTPUT.value == "json":
      print(strict_json({"prompt": c.prompt, "text": c.text,
                         "token_ids": c.token_ids, **c.metrics}))
    else:
      print(f"{c.prompt}\033[1m{c.text}\033[0m\n")
  if OUTPUT.value == "text":
    tokens = sum(len(c.token_ids) for c in completions)
    print(f"[{tokens} tokens in {seconds:.1f} s, compile included]")
    if K.value:
      totals = jax.tree.map(lambda x: x[None], engine.totals)
      m = summarize(totals)
      by_pos = acceptance_by_position(totals)
      print(f"[alpha {m['alpha']:.3f}, acceptance {m['acceptance_rate']:.3f},"
            f" {m['tokens_per_target_call']:.2f} tokens/target call,"
            f" by position {[round(x, 2) for x in by_pos]}]")


if __name__ == "__main__":
  cli.run(main)
