"""What one draft update costs, and its optimizer state, by what it differentiates.

  python -m experiments.bench_update                   # the derived draft, CPU defaults
  python -m experiments.bench_update --draft=eagle
  python -m experiments.bench_update --buffer_capacity=32 --minibatch=8 --update_steps=4

Times `objectives.distill` (an update as the online loop takes it: by
default one optimizer step over a full buffer; --update_steps steps of
--minibatch samples drawn from it, the main job's replay) on buffers of served-like samples: 64 generated
positions after a prompt, a top-32 teacher, in the 256- and 512-position
length buckets. Compared: the prompt's keys and values kept
from serving (the default, model drafts only), recomputed without
gradient, or with gradient, and the draft's token embedding frozen (the
default) or trained.
Reports the median of --repeats calls after a compiling one, and the bytes
of optimizer state each setting keeps.
"""

import dataclasses

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_common, cli, model_flags
from osd_jax.decoding.drafts import ModelDraft
from osd_jax.distillation import objectives, update
from osd_jax.distillation.buffer import Buffer

CAPACITY = flags.DEFINE_integer("buffer_capacity", 16, "Samples in the buffer.")
GEN_LEN = flags.DEFINE_integer("gen_len", 64, "Generated positions per sample.")
TEACHER_K = flags.DEFINE_integer("teacher_topk", 32, "Teacher top-k kept.")
REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per setting.")
UPDATE_STEPS = flags.DEFINE_integer("update_steps", 1, "Optimizer steps per update.",
                                    lower_bound=1)
MINIBATCH = flags.DEFINE_integer(
    "minibatch", 0, "Samples per step drawn from the buffer (0: all of it).",
    lower_bound=0)
# (bucket, prompt tokens): code prompts fill the larger bucket.
_SHAPES = ((256, 150), (512, 300))


def served_like(vocab: int, length: int, prompt: int, seed: int = 0) -> Buffer:
  """A full buffer of random tokens whose teacher mass sits on 32 random ids."""
  rng = np.random.default_rng(seed)
  n, g, k = CAPACITY.value, GEN_LEN.value, TEACHER_K.value
  return Buffer.empty(n, length, g, k).replace(
      tokens=jnp.asarray(rng.integers(0, min(vocab, 8000), (n, length)), jnp.int32),
      gen_start=jnp.full((n,), prompt - 1, jnp.int32),
      loss_weight=jnp.ones((n, g), jnp.float32),
      teacher_ids=jnp.asarray(rng.integers(0, min(vocab, 8000), (n, g, k)), jnp.int32),
      teacher_probs=jnp.full((n, g, k), 1.0 / k, jnp.float32),
      uid=jnp.arange(n, dtype=jnp.uint32), is_valid=jnp.ones((n,), bool))


def with_prompt_cache(buffer: Buffer, learner, params) -> Buffer:
  """The buffer keeping its prompts' keys and values, as serving's prefill
  would have left them (computed here once, outside the timing)."""
  n, length = buffer.tokens.shape
  cache = update.prefilled_cache(params, learner.config, buffer.tokens, length)
  keeping = Buffer.empty(n, length, buffer.loss_weight.shape[1],
                         buffer.teacher_ids.shape[-1], prompt_cache=cache)
  return keeping.add(buffer.tokens, buffer.gen_start, buffer.loss_weight,
                     buffer.teacher_ids, buffer.teacher_probs, buffer.category,
                     buffer.is_valid, prompt_cache=cache)


def main(argv):
  del argv
  cli.refuse_unread(
      model_flags, model_flags.all_flags_but(
          model_flags.LOOKUP_FLAGS, (model_flags.HYBRID_DRAFT_COST.name,
                                     model_flags.DRAFT_CONFIDENCE.name,
                                     model_flags.DRAFT_STOP_BEFORE.name)),
      "bench_update times the learned draft's update, not serving")
  target = model_flags.load_target()
  draft = model_flags.load_draft(target)
  learner = objectives.learnable(draft.drafter)
  if learner is None:
    raise ValueError(f"--draft={model_flags.DRAFT.value} has no parameters to learn.")
  base = update.DistillConfig(learning_rate=1e-3)
  # name: (settings, whether the buffer keeps serving's prompt keys/values)
  settings = {
      "default (prompt's keys/values from serving)": (base, True),
      "prompt recomputed without gradient": (base, False),
      "embedding trained": (dataclasses.replace(base, train_embedding=True), True),
      "prompt with gradient": (dataclasses.replace(base, prompt_gradient=True), False),
  }
  print(f"draft: {draft.source}")
  print(f"{'setting':44s} {'optimizer state MB':>18s} "
        + " ".join(f"{f'{n} pos, ms':>12s}" for n, _ in _SHAPES))
  for name, (cfg, keeps_cache) in settings.items():
    if keeps_cache and not isinstance(learner, ModelDraft):
      continue  # only a model draft's prompt is a KV cache to keep
    opt_state = update.init_opt_state(draft.params, cfg)
    state_mb = sum(x.nbytes for x in jax.tree.leaves(opt_state)) / 1e6
    step = jax.jit(lambda p, o, b, cfg=cfg: objectives.distill(
        learner, target.params, target.config, p, o, b, cfg,
        steps=UPDATE_STEPS.value, minibatch=MINIBATCH.value,
        key=jax.random.key(0)))
    costs = []
    for length, prompt in _SHAPES:
      buffer = served_like(target.config.vocab_size, length, prompt)
      if keeps_cache:
        buffer = with_prompt_cache(buffer, learner, draft.params)
      _, seconds, _ = bench_common.timed(step, draft.params, opt_state, buffer,
                                         repeats=REPEATS.value)
      costs.append(seconds * 1e3)
    print(f"{name:44s} {state_mb:18.1f} " + " ".join(f"{c:12.0f}" for c in costs),
          flush=True)


if __name__ == "__main__":
  cli.run(main)
