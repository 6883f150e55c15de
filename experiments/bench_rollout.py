"""The feature draft's alpha by proposal step, trained with and without rollout.

  python -m experiments.bench_rollout
  python -m experiments.bench_rollout --rollouts=1,4 --adapt=64 --adapt_epochs=2

#12 asks that the feature draft's (--draft=eagle) alpha at steps 2..k stay
within 0.1 of its step-1 alpha. Steps 2..k read the draft's own predicted
features; a draft trained only on the target's features (rollout 1, EAGLE-1)
has never seen them, one trained with rollout r (EAGLE-3's training-time
test) has, for steps up to r.

For each --rollouts depth (and, beyond one level, each --level_decays, the
weight of later steps in the loss): the draft warm-started on chat text so
(cached as the main job's warm start is), then, per segment of the main
job's stream, the same draft adapted on that segment's first --adapt served
answers (the target's greedy answers, cached like bench_lookup's) for
--adapt_epochs epochs through the online objective. Both are scored on each
segment's last --tail answers, which they never trained on: for steps 1..k,
the teacher-forced alpha (the mean of sum(min(p, q)), the main job's alpha)
and greedy agreement (the share of steps whose argmax is the target's token).
"""

import dataclasses

from absl import flags
import jax.numpy as jnp
import numpy as np

from experiments import bench_common, cli, learning_flags, model_flags
from osd_jax import progress
from osd_jax.distillation import objectives, rollout_alpha, warm_start

ROLLOUTS = flags.DEFINE_list("rollouts", ["1", "4"],
                             "Rollout depths to train the draft with and compare.")
LEVEL_DECAYS = flags.DEFINE_list(
    "level_decays", ["1"], "--eagle_level_decay values tried with each rollout"
    " depth above 1.")
K = flags.DEFINE_integer("k", 4, "Proposal steps scored.", lower_bound=1)
ADAPT = flags.DEFINE_integer("adapt", 64, "Served answers per segment to adapt on;"
                             " 0 scores the warm start only.", lower_bound=0)
ADAPT_EPOCHS = flags.DEFINE_integer("adapt_epochs", 2, "Epochs over them.",
                                    lower_bound=1)
TAIL = flags.DEFINE_integer("tail", 16, "Held-out answers scored per segment.",
                            lower_bound=1)
DOMAINS = flags.DEFINE_list("domains", ["math", "sql", "code"], "Segments, in order.")
NUM_REQUESTS = flags.DEFINE_integer("num_requests", 240, "Requests in the stream.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per answer.")
OUTPUT_DIR = flags.DEFINE_string("output_dir", "outputs/bench_lookup",
                                 "Where the greedy answers are cached.")
cli.require_positive_ints(ROLLOUTS)
flags.register_validator(LEVEL_DECAYS, bench_common.every_item(float, lambda x: 0 <= x <= 1),
                         "--level_decays takes numbers in [0, 1].")

_ROWS = 4  # answers scored per compiled call


def sequences(answers: list[dict]) -> list[tuple[list[int], int]]:
  """(prompt and answer ids, prompt length) of each answer."""
  return [(a["prompt"] + a["answer"], len(a["prompt"])) for a in answers]


def padded_length(seqs) -> int:
  """The longest sequence rounded up to 64 (one program for every batch)."""
  return -(-max(len(ids) for ids, _ in seqs) // 64) * 64


def score(draft, target, seqs, depth: int, length: int) -> np.ndarray:
  """[depth, 2]: alpha and greedy agreement of each step over `seqs`."""
  total = np.zeros((depth, 3))
  for start in range(0, len(seqs), _ROWS):
    tokens, gen_start, weight = warm_start.packed(
        seqs[start:start + _ROWS], length, target.config.pad_id, rows=_ROWS)
    total += np.asarray(rollout_alpha.level_sums(
        draft.params, target.params, jnp.asarray(tokens), jnp.asarray(gen_start),
        jnp.asarray(weight), drafter=draft.drafter, target_config=target.config,
        depth=depth))
  return total[:, :2] / np.maximum(total[:, 2:], 1.0)


def adapted(draft, target, seqs, length: int):
  """The draft after --adapt_epochs epochs on `seqs` (a copy)."""
  config = warm_start.WarmStartConfig(
      seq_len=length, epochs=ADAPT_EPOCHS.value, batch_size=8,
      distill=learning_flags.online_fields()["distill"])
  data = warm_start.teacher_data(target, seqs, config, keep_hidden=True,
                                 support=objectives.support(draft.drafter))
  params, _ = warm_start.train(draft, target, data, config, log=lambda _: None)
  return dataclasses.replace(draft, params=params)


def row(name: str, scores: dict[str, np.ndarray]) -> str:
  """Each segment's steps, the drop after step 1 and the tokens a proposal keeps."""
  cells = []
  for s in scores.values():
    steps = "/".join(f"{a:.2f}" for a in s[:, 0])
    drop = s[0, 0] - s[1:, 0].min() if len(s) > 1 else 0.0
    kept = np.cumprod(s[:, 0]).sum()
    cells.append(f"{steps} ({drop:+.2f}) {kept:.2f}".rjust(34))
  return f"{name:36s}" + "".join(cells)


def variants() -> list[tuple[int, float]]:
  """(rollout depth, level decay) pairs: decays only matter beyond one level."""
  out = []
  for depth in map(int, ROLLOUTS.value):
    for decay in ([1.0] if depth == 1 else map(float, LEVEL_DECAYS.value)):
      out.append((depth, decay))
  return out


def main(argv):
  del argv
  cli.refuse_unread(model_flags, model_flags.TARGET_FLAGS + model_flags.WARM_START_FLAGS
                    + (model_flags.DRAFT_HEAD_VOCAB.name,),
                    "bench_rollout trains feature drafts; --rollouts and --level_decays"
                    " set their rollout")
  cli.refuse_unread(learning_flags, learning_flags.DISTILL_FLAGS,
                    "bench_rollout adapts drafts offline, with no serving buffer")
  target = model_flags.load_target()
  answers = bench_common.greedy_answers(target, DOMAINS.value, NUM_REQUESTS.value,
                                        MAX_NEW_TOKENS.value, 512, OUTPUT_DIR.value)
  by_domain = {d: sequences([a for a in answers if a["domain"] == d])
               for d in DOMAINS.value}
  for d, seqs in by_domain.items():
    if len(seqs) < TAIL.value + ADAPT.value:
      raise ValueError(f"{d} has {len(seqs)} requests, fewer than --adapt + --tail.")
  length = padded_length([s for seqs in by_domain.values() for s in seqs])
  k = K.value
  header = "".join(f"{d:>34s}" for d in by_domain)
  lines = [f"alpha at steps 1..{k} on each segment's last {TAIL.value} answers"
           " (drop: step 1 minus the lowest later step; then the sum over s of"
           " the product of steps 1..s: tokens a proposal keeps, were the steps"
           " independent)", f"{'':36s}{header}"]
  greedy = list(lines[1:])
  for depth, decay in variants():
    draft = model_flags.warm_started(
        target, model_flags.feature_draft(target, depth, decay))
    stages = {"warm start": {d: score(draft, target, s[-TAIL.value:], k, length)
                             for d, s in by_domain.items()}}
    if ADAPT.value:
      bar = progress.bar(len(by_domain), f"rollout {depth}: adapting", "segments")
      stages[f"adapted on {ADAPT.value}"] = {}
      for d, s in by_domain.items():
        tuned = adapted(draft, target, s[:ADAPT.value], length)
        stages[f"adapted on {ADAPT.value}"][d] = score(tuned, target, s[-TAIL.value:],
                                                       k, length)
        bar.update(1)
      bar.close()
    for stage, scores in stages.items():
      name = f"rollout {depth}" + (f" decay {decay:g}" if decay != 1 else "") + f", {stage}"
      lines.append(row(name, scores))
      greedy.append(row(name, {d: s[:, 1:] for d, s in scores.items()}))
      print(lines[-1], flush=True)
  print("\n".join(lines))
  print(f"\ngreedy agreement at steps 1..{k}")
  print("\n".join(greedy))


if __name__ == "__main__":
  flags.FLAGS.set_default("warm_start", "chat")
  cli.run(main)
