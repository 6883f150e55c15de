"""Flags that pick the target and draft models, shared by every experiment."""

from absl import flags, logging
import jax

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints import loading

TARGET = flags.DEFINE_string(
    "target", loading.DEFAULT_TARGET,
    "Target model: 'smollm2' (the embedded SmolLM2-135M-Instruct), a .gguf"
    " file, or a Hugging Face Llama checkpoint directory.")
DRAFT = flags.DEFINE_string(
    "draft", "derived",
    "Draft model: 'derived' (cut from the target by --draft_layers and"
    " --draft_head_vocab), a .gguf file or an HF checkpoint directory.")
DRAFT_LAYERS = flags.DEFINE_list(
    "draft_layers", ["0", "1"], "Target layers the derived draft keeps.")
DRAFT_HEAD_VOCAB = flags.DEFINE_integer(
    "draft_head_vocab", 8192,
    "Derived draft's head covers this many lowest (most frequent) BPE ids plus"
    " the special tokens; 0 keeps the full vocabulary.")
DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"],
    "Parameter and compute dtype (bfloat16 for TPU/GPU).")


def warn_if_slow_dtype() -> None:
  """Warns that --dtype=bfloat16 on a CPU backend is several times slower."""
  if DTYPE.value == "bfloat16" and jax.default_backend() == "cpu":
    # Measured on a Xeon with AVX-512 and AMX: see docs/measurements.md.
    logging.warning(
        "--dtype=bfloat16 is meant for TPU and GPU; on CPU float32 is much"
        " faster (measured: a SmolLM2 target step took 170-195 ms in bfloat16,"
        " 30-45 ms in float32).")


def load_target() -> loading.LoadedModel:
  """The model named by --target in --dtype."""
  warn_if_slow_dtype()
  return loading.load(TARGET.value, param_dtype=DTYPE.value, dtype=DTYPE.value)


def load_draft(target: loading.LoadedModel) -> loading.LoadedModel:
  """The draft named by --draft, checked against the target's tokenizer."""
  if DRAFT.value == "derived":
    head = (draft_lib.frequent_token_ids(target.tokenizer, DRAFT_HEAD_VOCAB.value)
            if DRAFT_HEAD_VOCAB.value else None)
    return draft_lib.derive(target, [int(i) for i in DRAFT_LAYERS.value], head)
  draft = loading.load(DRAFT.value, param_dtype=DTYPE.value, dtype=DTYPE.value)
  loading.check_pair(target, draft)
  return draft
