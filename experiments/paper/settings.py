"""Sizes and knobs of the paper's experiments, and the flags that set them."""

import dataclasses

from absl import flags

from osd_jax.decoding.sampling import Sampling
from osd_jax.distillation import offline
from osd_jax.distillation.update import DistillConfig
from osd_jax.serving import online

EXPERIMENTS = ("main", "shift", "categories", "speedup")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Sizes and knobs of every experiment; defaults fit an hour on a 2-core CPU."""

  domains: tuple[str, ...] = ("sql", "math", "code")  # main, shift, speedup
  num_train: int = 64  # main/speedup: stream length = offline training prompts
  num_eval: int = 24  # held-out prompts per data set
  segment_length: int = 32  # shift: requests per domain
  fractions: tuple[float, ...] = (0.3, 0.5, 0.7, 1.0)
  category_domains: tuple[str, ...] = ("chat",)
  category_key: str = "language"  # or "domain" (per topic)
  categories: tuple[str, ...] = ("en", "zh", "ru")
  requests_per_category: int = 64
  k: int = 4
  max_new_tokens: int = 32
  prompt_len: int = 160
  batch_size: int = 8
  update_interval: int = 8
  # Online replay: each update takes update_steps optimizer steps, each on
  # `minibatch` samples drawn from a kept ring of `buffer_capacity` (the
  # last requests served). 4 steps of 8 every 8 requests spend what offline
  # distillation spends on the same stream (epochs x prompts samples);
  # --update_steps=1 --minibatch=0 --buffer_capacity=8 --nokeep_buffer is
  # the paper's one step on the cleared buffer.
  update_steps: int = 4
  minibatch: int = 8
  buffer_capacity: int = 32
  keep_buffer: bool = True
  epochs: int = 4
  learning_rate: float = 1e-3
  loss: str = "fkl"
  sample_source: str = "served"
  teacher_topk: int = 32
  window: int = 32  # requests in the online "last window"
  speedup_max_k: int = 8  # v is measured for k = 1..this
  timing_repeats: int = 5
  seed: int = 0
  manual_dir: str = ""

  def __post_init__(self):
    DistillConfig(loss=self.loss)  # raises on an unknown loss
    online.OnlineConfig(sample_source=self.sample_source)  # and on a bad source
    if self.category_key not in ("language", "domain"):
      raise ValueError(f"category_key must be language|domain, got {self.category_key!r}.")
    if not all(0.0 < f <= 1.0 for f in self.fractions):
      raise ValueError(f"fractions must lie in (0, 1], got {self.fractions}.")

  @classmethod
  def quick(cls, **overrides) -> "Settings":
    """A few minutes on the real model: every size cut down."""
    fields = dict(domains=("sql", "math"), num_train=16, num_eval=8,
                  segment_length=16, fractions=(0.5, 1.0),
                  categories=("en", "zh"), requests_per_category=16,
                  max_new_tokens=16, epochs=3, window=8, speedup_max_k=0,
                  timing_repeats=3)
    fields.update(overrides)
    return cls(**fields)

  def online_config(self, num_drafts: int = 1) -> online.OnlineConfig:
    # The ring holds at least a whole interval, in whole batches.
    capacity = self.batch_size * -(-max(self.update_interval, self.buffer_capacity)
                                   // self.batch_size)
    return online.OnlineConfig(
        k=self.k, sampling=Sampling(), max_new_tokens=self.max_new_tokens,
        cache_size=self.cache_size, update_interval=self.update_interval,
        update_steps=self.update_steps, minibatch=self.minibatch,
        buffer_capacity=capacity, clear_after_update=not self.keep_buffer,
        teacher_k=self.teacher_topk,
        sample_source=self.sample_source, num_drafts=num_drafts,
        distill=self.distill_config())

  @property
  def cache_size(self) -> int:
    """Slot positions: the longest prompt drawn, its new tokens and k."""
    return self.prompt_len + self.max_new_tokens + self.k

  def offline_config(self) -> offline.OfflineConfig:
    return offline.OfflineConfig(
        sample_source=self.sample_source, sampling=Sampling(),
        max_new_tokens=self.max_new_tokens, prompt_len=self.prompt_len,
        teacher_k=self.teacher_topk, epochs=self.epochs,
        batch_size=self.batch_size, collect_batch_size=self.batch_size,
        distill=self.distill_config())

  def distill_config(self) -> DistillConfig:
    return DistillConfig(loss=self.loss, learning_rate=self.learning_rate)


_HELP = {
    "domains": "Data sets (make_stream names) of main, shift and speedup.",
    "num_train": "main/speedup: online stream length = offline training prompts.",
    "num_eval": "Held-out prompts per data set.",
    "segment_length": "shift: requests per segment (refused if fewer prompts"
                      " fit --prompt_len).",
    "fractions": "shift: parts of each segment the static drafts see in advance.",
    "category_domains": "categories: data sets the per-category stream draws from.",
    "category_key": "categories: route by 'language' or 'domain' (topic).",
    "categories": "categories: the categories, in order.",
    "requests_per_category": "categories: requests per category.",
    "k": "Draft tokens per speculative step.",
    "max_new_tokens": "Tokens generated per request.",
    "prompt_len": "Prompt capacity in tokens; longer prompts are not drawn.",
    "batch_size": "Requests per batch (and offline minibatch).",
    "update_interval": "Online: requests between draft updates.",
    "update_steps": "Online: optimizer steps per update.",
    "minibatch": "Online: samples per step, drawn from the ring (0: all of it).",
    "buffer_capacity": "Online: samples the ring keeps (at least an interval).",
    "keep_buffer": "Online: keep the ring across updates (False: clear it).",
    "epochs": "Offline distillation epochs.",
    "learning_rate": "Draft learning rate, offline and online (paper: 1e-4).",
    "loss": "Divergence (fkl, rkl, jsd, tvd, fkl_rkl).",
    "sample_source": "Where training tokens come from (served, draft, mixed_*).",
    "teacher_topk": "Teacher top-k kept per position; 0 recomputes the teacher.",
    "window": "Requests in the online last-window alpha.",
    "speedup_max_k": "speedup: measure the target's k+1-token cost for k up to this.",
    "timing_repeats": "speedup: repeats per cost measurement.",
    "seed": "Stream and sampling seed.",
    "manual_dir": "Folder of the paper's data sets (spider, gsm8k, ...).",
}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """--experiment, --output_dir, --quick and one flag per Settings field."""
  flags.DEFINE_enum("experiment", "main", list(EXPERIMENTS), "Which experiment.",
                    flag_values=flag_values)
  flags.DEFINE_string("output_dir", "outputs/paper", "Where tables and figures go.",
                      flag_values=flag_values)
  flags.DEFINE_bool("quick", False, "A few minutes: shrink every size not set"
                    " explicitly.", flag_values=flag_values)
  flags.DEFINE_string("compilation_cache", "",
                      "Persistent XLA compilation cache directory (e.g."
                      " ~/.cache/osd_jax/xla); '' disables.", flag_values=flag_values)
  for field in dataclasses.fields(Settings):
    default, name = field.default, field.name
    if isinstance(default, tuple):
      flags.DEFINE_list(name, [str(x) for x in default], _HELP[name],
                        flag_values=flag_values)
    elif isinstance(default, bool):
      flags.DEFINE_bool(name, default, _HELP[name], flag_values=flag_values)
    elif isinstance(default, int):
      flags.DEFINE_integer(name, default, _HELP[name], flag_values=flag_values)
    elif isinstance(default, float):
      flags.DEFINE_float(name, default, _HELP[name], flag_values=flag_values)
    else:
      flags.DEFINE_string(name, default, _HELP[name], flag_values=flag_values)


def settings_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Settings:
  """Settings (quick ones with --quick), overridden by every flag given."""
  changes = {}
  for field in dataclasses.fields(Settings):
    if flag_values[field.name].present:
      value = flag_values[field.name].value
      if isinstance(field.default, tuple):
        cast = float if field.name == "fractions" else str
        value = tuple(cast(x) for x in value)
      changes[field.name] = value
  if flag_values["quick"].value:
    return Settings.quick(**changes)
  return Settings(**changes)
