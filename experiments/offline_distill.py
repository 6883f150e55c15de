"""Distil a draft on a data set before serving: the paper's static baseline.

  python -m experiments.offline_distill --dataset=math --output_dir=outputs/offline_math
  python -m experiments.offline_distill --dataset=sql --num_train=32 --epochs=2 \
      --hf_dir=outputs/offline_sql/hf --output_dir=outputs/offline_sql
  python -m experiments.online --draft=outputs/offline_sql/hf ...  # serve it

Collects the target's continuations (or the draft's, by --sample_source) of
--num_train training prompts with the target's top-k at every position,
trains the draft for --epochs on them, and reports alpha on --num_eval
held-out prompts before and after. Writes an orbax checkpoint of the draft
parameters (OUTPUT_DIR/draft_params), the draft config and a summary, and
with --hf_dir an HF directory that --draft accepts.
"""

import dataclasses
import json
import os

from absl import app, flags
import jax
import orbax.checkpoint as ocp

from experiments import cli, model_flags
from osd_jax.checkpoints import loading
from osd_jax.data import EVAL, TRAIN, make_stream
from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import losses, offline, samples
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import driver

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """This job's flags (the model flags come from experiments.model_flags)."""
  fv = dict(flag_values=flag_values)
  flags.DEFINE_string("dataset", "math", "A make_stream source: math, code, sql,"
                      " chat, or a manual set (spider, gsm8k, ...).", **fv)
  flags.DEFINE_string("prompts_file", None, "One prompt per line; replaces"
                      " --dataset's training prompts (no eval set then).", **fv)
  flags.DEFINE_string("manual_dir", None, "Folder of the paper's data sets.", **fv)
  flags.DEFINE_integer("num_train", 96, "Training prompts.", **fv)
  flags.DEFINE_integer("num_eval", 32, "Held-out prompts for alpha before/after;"
                       " 0 skips it.", **fv)
  flags.DEFINE_integer("epochs", 4, "Passes over the training data.", **fv)
  flags.DEFINE_integer("batch_size", 8, "Training minibatch and generation batch.", **fv)
  flags.DEFINE_enum("loss", "fkl", list(losses.NAMES), "Divergence.", **fv)
  flags.DEFINE_float("loss_beta", 0.5, "Weight of the generalised JSD.", **fv)
  flags.DEFINE_float("loss_temperature", 1.0, "Distillation temperature.", **fv)
  flags.DEFINE_enum("sample_source", "served", list(samples.SOURCES),
                    "served: the target writes the training text; draft: the"
                    " draft does; mixed_*: both.", **fv)
  flags.DEFINE_float("source_mix", 0.5, "Target share for the mixed sources.", **fv)
  flags.DEFINE_float("learning_rate", 1e-3, "AdamW rate (paper: 1e-4; derived"
                     " SmolLM2 drafts learn far faster at 1e-3).", **fv)
  flags.DEFINE_float("temperature", 0.0, "Sampling temperature of the generated"
                     " text and of serving for eval; 0 = greedy.", **fv)
  flags.DEFINE_integer("max_new_tokens", 48, "Tokens generated per prompt.", **fv)
  flags.DEFINE_integer("prompt_len", 160, "Prompt capacity; longer are dropped.", **fv)
  flags.DEFINE_integer("teacher_topk", 32, "Teacher top-k kept per position; 0"
                       " recomputes the teacher with a target forward.", **fv)
  flags.DEFINE_integer("k", 4, "Draft tokens per step when measuring alpha.", **fv)
  flags.DEFINE_bool("chat", True, "Wrap prompts in the chat template.", **fv)
  flags.DEFINE_integer("seed", 0, "Data and sampling seed.", **fv)
  flags.DEFINE_string("output_dir", "outputs/offline", "Checkpoint and summary.", **fv)
  flags.DEFINE_string("hf_dir", None, "Also export the draft as an HF directory.", **fv)
  flags.DEFINE_string("compilation_cache", "",
                      "Persistent XLA compilation cache directory; '' disables.", **fv)


def config_from_flags(fv: flags.FlagValues = FLAGS) -> offline.OfflineConfig:
  return offline.OfflineConfig(
      sample_source=fv.sample_source, source_mix=fv.source_mix,
      sampling=Sampling(fv.temperature), max_new_tokens=fv.max_new_tokens,
      prompt_len=fv.prompt_len, teacher_k=fv.teacher_topk, epochs=fv.epochs,
      batch_size=fv.batch_size, collect_batch_size=fv.batch_size,
      distill=DistillConfig(loss=fv.loss, beta=fv.loss_beta,
                            temperature=fv.loss_temperature,
                            learning_rate=fv.learning_rate))


def save_draft(directory: str, params, config) -> str:
  """Orbax checkpoint of the parameters plus the config as JSON; returns the path."""
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "draft_params")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, params, force=True)
  checkpointer.wait_until_finished()
  with open(os.path.join(directory, "draft_config.json"), "w") as f:
    json.dump(dataclasses.asdict(config), f, indent=2)
  return path


def restore_draft(directory: str, like: dict) -> dict:
  """The parameters saved by save_draft, shaped like `like`."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  return ocp.StandardCheckpointer().restore(
      os.path.join(os.path.abspath(directory), "draft_params"), abstract)


def _prompts(target, split: str, n: int, fv) -> list[list[int]]:
  """n prompts (token ids) of --dataset's split, or of --prompts_file."""
  if split == TRAIN and fv.prompts_file:
    with open(fv.prompts_file) as f:
      texts = [line.rstrip("\n") for line in f if line.strip()][:n]
  else:
    texts = [r.prompt for r in make_stream(
        "single", [fv.dataset], n, seed=fv.seed, split=split,
        manual_dir=fv.manual_dir)]
  return driver.encode_prompts(target, texts, fv.chat)


def main(argv):
  del argv
  if FLAGS.compilation_cache:
    jax.config.update("jax_compilation_cache_dir",
                      os.path.expanduser(FLAGS.compilation_cache))
  cli.refuse_unread(model_flags,
                    model_flags.TARGET_FLAGS + model_flags.DRAFT_MODEL_FLAGS,
                    "offline distillation trains a model draft from its cut or"
                    " checkpoint (no warm start, lookup or serving settings)")
  target = model_flags.load_target()
  draft = model_flags.load_draft_model(target)  # offline distillation: a model draft
  cfg = config_from_flags()
  print(f"target {target.source}\ndraft {draft.source}\n{cfg}", flush=True)
  train_ids = _prompts(target, TRAIN, FLAGS.num_train, FLAGS)
  eval_ids = ([] if FLAGS.prompts_file or not FLAGS.num_eval
              else _prompts(target, EVAL, FLAGS.num_eval, FLAGS))
  result = offline.distill(target.params, target.config, draft.params,
                           draft.config, train_ids, cfg, seed=FLAGS.seed)
  summary = {"dataset": FLAGS.prompts_file or FLAGS.dataset,
             "samples": int(result.data.capacity),
             "loss_before": result.loss_before, "epoch_losses": result.epoch_losses,
             "seconds": result.seconds, "config": dataclasses.asdict(cfg)}
  if eval_ids:
    for name, params in (("before", draft.params), ("after", result.params)):
      measured = offline.static_alpha(
          target.params, target.config, params, draft.config, eval_ids,
          k=FLAGS.k, sampling=cfg.sampling, max_new_tokens=cfg.max_new_tokens,
          prompt_len=cfg.prompt_len, batch_size=FLAGS.batch_size, seed=FLAGS.seed)
      measured.pop("alpha_per_request")
      measured.pop("indices")
      summary[f"eval_{name}"] = measured
      print(f"eval alpha {name}: {measured['alpha']:.3f} on"
            f" {measured['requests']} held-out prompts", flush=True)
  path = save_draft(FLAGS.output_dir, result.params, draft.config)
  print(f"checkpoint: {path}")
  if FLAGS.hf_dir:
    loading.save_hf(loading.LoadedModel(
        draft.config, result.params, draft.tokenizer,
        f"{draft.source}, distilled offline on {summary['dataset']}"), FLAGS.hf_dir)
    print(f"HF directory: {FLAGS.hf_dir}")
  with open(os.path.join(FLAGS.output_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
