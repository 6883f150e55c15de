"""Flags that pick the target and draft models, shared by every experiment."""

import dataclasses

from absl import flags, logging
import jax

from osd_jax import hardware
from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints import loading
from osd_jax.decoding import drafts
from osd_jax.distillation import warm_start
from osd_jax.models import eagle

TARGET = flags.DEFINE_string(
    "target", loading.DEFAULT_TARGET,
    "Target model: 'smollm2' (the embedded SmolLM2-135M-Instruct), a .gguf"
    " file, or a Hugging Face Llama checkpoint directory.")
DRAFT = flags.DEFINE_string(
    "draft", "derived",
    "Draft kind (vLLM's names where they exist): 'derived' (a model cut from"
    " the target by --draft_layers and --draft_head_vocab), 'eagle' (one"
    " decoder block over the target's hidden states, its head the target's,"
    " cut to --draft_head_vocab), 'ngram' (prompt lookup, no parameters), or a"
    " .gguf file or an HF checkpoint directory of a draft model sharing the"
    " target's tokenizer.")
HYBRID = flags.DEFINE_bool(
    "hybrid", False, "Propose the n-gram continuation wherever the context has"
    " a match, and the learned draft elsewhere.")
HYBRID_DRAFT_COST = flags.DEFINE_float(
    "hybrid_draft_cost", None,
    "With --hybrid: the learned draft's pass as a fraction of a target step."
    " The hybrid runs the draft where lookup misses only while the draft tokens"
    " it gets accepted outweigh that cost (and on each request's first steps,"
    " to keep measuring a draft that learns). Default: the ratio of the weights"
    " a token reads in each (what it costs where decoding is memory-bound)."
    " 0 runs the draft wherever lookup misses.", lower_bound=0.0, upper_bound=0.99)
WARM_START = flags.DEFINE_enum(
    "warm_start", "none", ["none", "chat"],
    "Start a learned draft distilled on general chat text (ShareGPT, teacher-"
    "forced): built once, cached under ~/.cache/osd_jax/warm_start. 'none' is"
    " the cold start.")
WARM_START_CONVERSATIONS = flags.DEFINE_integer(
    "warm_start_conversations", 800, "Chat conversations the warm start reads.")
WARM_START_EPOCHS = flags.DEFINE_integer("warm_start_epochs", 2, "Warm-start epochs.")
DRAFT_CONFIDENCE = flags.DEFINE_float(
    "draft_confidence_threshold", 0.0,
    "A model draft stops proposing in a step after a token it gave less than"
    " this probability (Hugging Face's assistant_confidence_threshold); 0"
    " always drafts k tokens. Model drafts only (derived or a checkpoint).")
EAGLE_ROLLOUT = flags.DEFINE_integer(
    "eagle_rollout", 4, "Draft steps the feature draft is trained to roll out.",
    lower_bound=1)
EAGLE_LEVEL_DECAY = flags.DEFINE_float(
    "eagle_level_decay", 1.0, "Weight of the feature draft's rollout step s in its"
    " loss: this to the power s - 1 (1: every step alike). Steps share one block,"
    " and a later step counts only where the earlier ones were accepted.",
    lower_bound=0.0, upper_bound=1.0)
DRAFT_STOP_BEFORE = flags.DEFINE_bool(
    "draft_stop_before_unconfident", False,
    "With --draft_confidence_threshold above 0.5, leave out the draw that fell"
    " below it too, so a step may propose nothing (a default left on applies"
    " only with such a threshold). Only in calls whose verification is"
    " trimmed (--trim_verify, fewer than 4 slots): at full width the draw"
    " costs no target time.")
NGRAM_MAX = flags.DEFINE_integer("ngram_max", 4, "Longest suffix n-gram looked up.")
NGRAM_MIN = flags.DEFINE_integer(
    "ngram_min", 2, "Shortest suffix n-gram looked up (a 1-gram match copies"
    " tokens the target mostly rejects: 0.4-0.5 accepted of 4 on the shift"
    " stream).")
NGRAM_HISTORY = flags.DEFINE_integer(
    "ngram_history", 0,
    "Where the sequence itself has no n-gram match, look up in the last N"
    " requests the device served, prompts and outputs (SuffixDecoding's"
    " idea): the lookup adapts to the traffic with no training. Each slot"
    " keeps a copy of N x the slot's positions of tokens, searched every step;"
    " 0 = prompt lookup only.", lower_bound=0)
NGRAM_HISTORY_MIN = flags.DEFINE_integer(
    "ngram_history_min", 2,
    "Shortest n-gram looked up in earlier requests (--ngram_history).",
    lower_bound=1)
NGRAM_HISTORY_SHARE = flags.DEFINE_float(
    "ngram_history_min_share", 0.5,
    "Each earlier request with a match offers what followed its latest one;"
    " the continuation most of them share is proposed, each token only while"
    " at least this share of them agree with it (SuffixDecoding's frequency"
    " counts). 0: the most shared continuation in full. Only in calls whose"
    " verification is trimmed (--trim_verify, fewer than 4 slots): at full"
    " width the whole offer costs no target time.",
    lower_bound=0.0, upper_bound=1.0)
NGRAM_CAP = flags.DEFINE_bool(
    "ngram_cap_at_match", True,
    "After an n-gram match propose at most n tokens, not k. Only in calls whose"
    " verification is trimmed (--trim_verify, fewer than 4 slots): at full"
    " width the rest of the copy costs no target time.")
DRAFT_LAYERS = flags.DEFINE_list(
    "draft_layers", ["0", "1"], "Target layers the derived draft keeps.")
flags.register_validator(
    DRAFT_LAYERS.name, lambda ids: bool(ids) and all(i.isdigit() for i in ids),
    "--draft_layers lists target layer indices, e.g. 0,1.")
DRAFT_HEAD_VOCAB = flags.DEFINE_integer(
    "draft_head_vocab", 8192,
    "Derived draft's head covers this many lowest (most frequent) BPE ids plus"
    " the special tokens; 0 keeps the full vocabulary.", lower_bound=0)
DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"],
    "Parameter and compute dtype (bfloat16 for TPU/GPU).")
TARGET_WEIGHTS = flags.DEFINE_enum(
    "target_weights", "auto", ["auto", "float32", "bfloat16"],
    "How the frozen target stores its weights. bfloat16 under --dtype=float32"
    " runs its matmuls on bfloat16 inputs with float32 accumulation"
    " (activations, caches and softmaxes stay float32): on a CPU with AMX a"
    " pass over 2-9 tokens a row then costs what one token does. auto:"
    " bfloat16 on a CPU with AMX, else --dtype.")

# The flags each part of the model choice reads, for entry points that use
# only some of them (cli.refuse_unread refuses the rest).
TARGET_FLAGS = (TARGET.name, DTYPE.name, TARGET_WEIGHTS.name)
DRAFT_MODEL_FLAGS = (DRAFT.name, DRAFT_LAYERS.name, DRAFT_HEAD_VOCAB.name)
WARM_START_FLAGS = (WARM_START.name, WARM_START_CONVERSATIONS.name, WARM_START_EPOCHS.name)
LOOKUP_FLAGS = (NGRAM_MAX.name, NGRAM_MIN.name, NGRAM_HISTORY.name,
                NGRAM_HISTORY_MIN.name, NGRAM_HISTORY_SHARE.name, NGRAM_CAP.name)
# Read only by calls whose verification is trimmed (Drafter.at_full_width).
TRIMMED_ONLY_FLAGS = (NGRAM_CAP.name, NGRAM_HISTORY_SHARE.name, DRAFT_STOP_BEFORE.name)
# What only a learned draft reads: lookup alone (--draft=ngram) refuses them.
LEARNED_DRAFT_FLAGS = (WARM_START_FLAGS + (HYBRID_DRAFT_COST.name, DRAFT_CONFIDENCE.name,
                       DRAFT_STOP_BEFORE.name, EAGLE_ROLLOUT.name,
                       EAGLE_LEVEL_DECAY.name, DRAFT_LAYERS.name, DRAFT_HEAD_VOCAB.name))


def all_flags_but(*groups: tuple[str, ...]) -> tuple[str, ...]:
  """This module's flags outside `groups`."""
  left = {flag.name for flag in flags.FLAGS.get_flags_for_module(__name__)}
  return tuple(sorted(left.difference(*groups)))


# Values that turn a learned draft's option off: setting one is never refused.
_OFF = {WARM_START.name: "none", DRAFT_CONFIDENCE.name: 0.0, DRAFT_STOP_BEFORE.name: False,
        HYBRID_DRAFT_COST.name: 0.0}


def _given(names: tuple[str, ...]) -> list[str]:
  """Those of `names` the command line set, to anything but off."""
  return [name for name in names if not flags.FLAGS[name].using_default_value
          and flags.FLAGS[name].value != _OFF.get(name, object())]


def serve_with_the_best_draft() -> None:
  """Defaults of an entry point that serves traffic: the draft bench_drafts
  picked (README, "Every draft kind"). The derived draft, warm-started on chat
  text, behind n-gram lookup wherever the context has a match; it proposes
  only draws it gave at least 0.7, so where lookup finds nothing a step often
  proposes nothing and verification (trimmed) costs one target step; and
  the draft runs there only while its accepted tokens pay for its pass
  (--hybrid_draft_cost). Lookup also searches the last 64 requests the
  device served. Call at
  import time, before flags parse."""
  flags.set_default(HYBRID, True)
  flags.set_default(WARM_START, "chat")
  flags.set_default(DRAFT_CONFIDENCE, 0.7)
  flags.set_default(DRAFT_STOP_BEFORE, True)
  flags.set_default(NGRAM_HISTORY, 64)


def warn_if_slow_dtype() -> None:
  """Warns that --dtype=bfloat16 on a CPU backend is several times slower."""
  if DTYPE.value == "bfloat16" and jax.default_backend() == "cpu":
    # Measured on a Xeon with AVX-512 and AMX: see docs/measurements.md.
    logging.warning(
        "--dtype=bfloat16 is meant for TPU and GPU; on CPU float32 is much"
        " faster (measured: a SmolLM2 target step took 170-195 ms in bfloat16,"
        " 30-45 ms in float32).")


def target_weight_dtype() -> str:
  """The dtype --target_weights names ("auto" resolved on this host)."""
  if TARGET_WEIGHTS.value != "auto":
    return TARGET_WEIGHTS.value
  return "bfloat16" if hardware.bfloat16_matmuls_are_fast() else DTYPE.value


def load_target() -> loading.LoadedModel:
  """The model named by --target: weights as --target_weights, compute in --dtype."""
  warn_if_slow_dtype()
  return loading.load(TARGET.value, param_dtype=target_weight_dtype(),
                      dtype=DTYPE.value)


def load_draft_model(target: loading.LoadedModel,
                     kind: str | None = None) -> loading.LoadedModel:
  """The draft model named by --draft, checked against the target's tokenizer."""
  kind = kind or DRAFT.value
  if kind == "derived":
    head = (draft_lib.frequent_token_ids(target.tokenizer, DRAFT_HEAD_VOCAB.value)
            if DRAFT_HEAD_VOCAB.value else None)
    return draft_lib.derive(target, [int(i) for i in DRAFT_LAYERS.value], head)
  return draft_lib.paired(
      target, loading.load(kind, param_dtype=DTYPE.value, dtype=DTYPE.value))


def load_draft(target: loading.LoadedModel, kind: str | None = None,
               hybrid: bool | None = None) -> drafts.Draft:
  """The drafter and parameters that --draft and --hybrid name (or kind, hybrid).

  A --draft that cannot use a draft flag the command line set is refused; a
  caller naming `kind` (a bench comparing kinds) applies each flag where it can.
  """
  refused = _given if kind is None else lambda names: []
  kind = kind or DRAFT.value
  if hybrid is None:
    # A serving entry point's default --hybrid is for learned drafts: lookup
    # alone turns it off, unless the command line asked for both.
    hybrid = HYBRID.value and (kind != "ngram" or not flags.FLAGS[HYBRID.name]
                               .using_default_value)
  lookup = drafts.NGramDraft(target.config.vocab_size, NGRAM_MAX.value,
                             NGRAM_MIN.value, NGRAM_CAP.value, NGRAM_HISTORY.value,
                             NGRAM_HISTORY_MIN.value, NGRAM_HISTORY_SHARE.value)
  if kind == "ngram":
    if hybrid:
      raise ValueError("--hybrid needs a learned draft, not --draft=ngram.")
    if given := refused(LEARNED_DRAFT_FLAGS):
      raise ValueError(f"--{given[0]} applies to a learned draft, not --draft=ngram.")
    return drafts.Draft(lookup, (), f"ngram {NGRAM_MIN.value}..{NGRAM_MAX.value}"
                        + (", capped at the match" if NGRAM_CAP.value else "")
                        + (f", in the last {NGRAM_HISTORY.value} requests too"
                           if NGRAM_HISTORY.value else ""))
  if kind == "eagle":
    if given := refused((DRAFT_CONFIDENCE.name, DRAFT_STOP_BEFORE.name)):
      raise ValueError(f"--{given[0]} applies to model drafts (derived or a"
                       " checkpoint), not --draft=eagle.")
    draft = feature_draft(target, EAGLE_ROLLOUT.value, EAGLE_LEVEL_DECAY.value)
  else:
    model = load_draft_model(target, kind)
    draft = drafts.Draft(drafts.ModelDraft(model.config), model.params, model.source)
  # A checkpoint is a pretrained draft already: a serving entry point's
  # default warm start is for drafts cut from the target.
  pretrained = kind not in ("derived", "eagle")
  if not (pretrained and flags.FLAGS[WARM_START.name].using_default_value):
    draft = warm_started(target, draft)
  stop_before = DRAFT_STOP_BEFORE.value and DRAFT_CONFIDENCE.value > 0.5
  if (DRAFT_STOP_BEFORE.value and not stop_before
      and not flags.FLAGS[DRAFT_STOP_BEFORE.name].using_default_value):
    raise ValueError("--draft_stop_before_unconfident needs"
                     " --draft_confidence_threshold above 0.5 (then at most one"
                     f" token is confident), got {DRAFT_CONFIDENCE.value}.")
  # A serving entry point's default threshold is for model drafts: the
  # feature draft keeps drafting k tokens.
  if DRAFT_CONFIDENCE.value and isinstance(draft.drafter, drafts.ModelDraft):
    # After the warm start: serving-only, so it does not key the cache.
    draft = dataclasses.replace(draft, drafter=dataclasses.replace(
        draft.drafter, confidence_threshold=DRAFT_CONFIDENCE.value,
        stop_before_unconfident=stop_before))
  if hybrid:
    cost = HYBRID_DRAFT_COST.value
    if cost is None:
      cost = draft.drafter.config.decode_params() / target.config.decode_params()
    return drafts.Draft(drafts.HybridDraft(draft.drafter, lookup, cost), draft.params,
                        f"{draft.source} + ngram"
                        + (f", gated at {cost:.3f} of a target step" if cost else "")
                        + (f" (and {NGRAM_HISTORY.value} served requests)"
                           if NGRAM_HISTORY.value else ""))
  return draft


def feature_draft(target: loading.LoadedModel, rollout: int,
                  level_decay: float) -> drafts.Draft:
  """A new feature draft (--draft=eagle) trained to roll out `rollout` steps,
  level s weighing `level_decay ** (s - 1)`."""
  head = (draft_lib.frequent_token_ids(target.tokenizer, DRAFT_HEAD_VOCAB.value)
          if DRAFT_HEAD_VOCAB.value else None)
  return drafts.Draft(
      drafts.FeatureDraft(eagle.FeatureConfig(target.config, head), rollout=rollout,
                          level_decay=level_decay),
      eagle.init_params(target.params, target.config),
      f"eagle block on {target.source}" + (f", head {len(head)} tokens" if head else ""))


def warm_started(target: loading.LoadedModel, draft: drafts.Draft) -> drafts.Draft:
  """The draft warm-started on chat text when --warm_start=chat, else as it is."""
  if WARM_START.value != "chat":
    return draft
  return warm_start.load_or_build(target, draft, warm_start.WarmStartConfig(
      conversations=WARM_START_CONVERSATIONS.value, epochs=WARM_START_EPOCHS.value))
