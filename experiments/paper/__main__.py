"""Runs one of the paper's experiments; sizes from flags, --quick shrinks them.

  python -m experiments.paper --experiment=main --output_dir=results/main
  python -m experiments.paper --experiment=shift --quick --output_dir=/tmp/shift
  # segments long enough for the online draft's dip and recovery (about 40 min
  # on 2 otherwise idle cores):
  python -m experiments.paper --experiment=shift --segment_length=300 --output_dir=/tmp/shift_300
"""

import dataclasses
import os

from absl import flags
import jax

from experiments import cli, model_flags
from experiments.paper import define_flags, run, settings_from_flags
from experiments.paper import settings as settings_module
from osd_jax.decoding.drafts import Draft, ModelDraft


def main(argv):
  del argv
  settings = settings_from_flags()
  if flags.FLAGS.compilation_cache:
    jax.config.update("jax_compilation_cache_dir",
                      os.path.expanduser(flags.FLAGS.compilation_cache))
  target = model_flags.load_target()
  draft = model_flags.load_draft_model(target)  # offline distillation: a model draft
  # The paper's drafts were pretrained: start from the warm start (if asked).
  warm = model_flags.warm_started(
      target, Draft(ModelDraft(draft.config), draft.params, draft.source))
  draft = dataclasses.replace(draft, params=warm.params, source=warm.source)
  print(f"target {target.source}\ndraft {draft.source}\n{settings}")
  run(flags.FLAGS.experiment, target, draft, settings, flags.FLAGS.output_dir)


# The starting draft, as the main job's: warm-started on chat text.
flags.set_default(model_flags.WARM_START, "chat")

if __name__ == "__main__":
  define_flags()
  flags.adopt_module_key_flags(settings_module)  # so --helpshort lists them
  cli.run(main)
