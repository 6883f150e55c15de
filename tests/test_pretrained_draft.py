"""A pretrained draft of its own, as users pair them (Qwen2.5-7B with
Qwen2.5-0.5B): one tokenizer, other sizes, and embedding tables padded to
other row counts. Served exactly, learned online, resumed, exported.

The pair is the Qwen2 conformance fixture (tests/fixtures/families/): a
2-layer target of 376 rows and a 1-layer, narrower draft of 364 rows, both
for the same 360-token tokenizer.
"""

import contextlib
import dataclasses
import io
import os
import shutil

import jax
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints import layout, loading
from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import Draft, ModelDraft
from osd_jax.decoding.engine import Engine
from osd_jax.distillation.update import DistillConfig
from osd_jax.models import llama
from osd_jax.serving import driver, online
from osd_jax.serving.checkpoint import Checkpointer
from tests import test_sampling_exactness as harness
from tests.test_families import FIXTURES, reference

pytestmark = pytest.mark.filterwarnings(  # orbax's asyncio helpers at exit
    "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def target():
  return loading.load(os.path.join(FIXTURES, "qwen2"))


@pytest.fixture(scope="module")
def small():
  return loading.load(os.path.join(FIXTURES, "qwen2_draft"))


def prompts() -> list[list[int]]:
  ref = reference("qwen2")
  return [ref[f"prompt_ids_{i}"].tolist()[:40] for i in range(4)]


@pytest.mark.parametrize("direction", ["fewer_rows", "more_rows"])
def test_greedy_speculation_with_a_pretrained_draft_equals_target_only(
    target, small, direction):
  """A draft with fewer rows than the target, and (roles swapped) one with more."""
  if direction == "more_rows":
    target, small = small, target
  assert small.config.vocab_size != target.config.vocab_size
  plain = Engine(target, max_new_tokens=12).generate_ids(prompts())
  spec = Engine(target, small, k=3, max_new_tokens=12)
  fitted = spec.draft.drafter.config
  assert fitted.vocab_size == target.config.vocab_size
  assert max(fitted.head_token_ids) < min(small.config.vocab_size,
                                           target.config.vocab_size)
  out = spec.generate_ids(prompts())
  assert [c.token_ids for c in out] == [c.token_ids for c in plain]
  assert spec.totals.proposed > 0


def test_fitted_draft_keeps_its_logits_and_gives_extra_rows_probability_0(target, small):
  fitted = draft_lib.paired(target, small)
  ids = np.asarray([prompts()[0]])
  own = np.asarray(llama.apply(small.params, small.config, ids)[0])
  ours = np.asarray(llama.apply(fitted.params, fitted.config, ids)[0])
  rows = small.config.vocab_size
  np.testing.assert_allclose(ours[..., :rows], own, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ours[..., rows:], llama.MASKED_LOGIT)


def test_a_draft_of_another_tokenizer_is_refused_in_one_line(target, tmp_path):
  path = str(tmp_path / "other")
  shutil.copytree(os.path.join(FIXTURES, "llama3"), path)  # the llama-bpe tokenizer
  with pytest.raises(layout.CheckpointError, match="other ids") as e:
    Engine(target, loading.load(path), k=2)
  assert "\n" not in str(e.value)


# --- online learning and resume -----------------------------------------------

CFG = online.OnlineConfig(
    k=3, max_new_tokens=8, cache_size=64, steps_per_call=2, update_interval=2,
    buffer_capacity=4, teacher_k=8, distill=DistillConfig(learning_rate=1e-2))
TEXTS = ["The capital of France is", "def add(a, b):", "SELECT name FROM users",
         "Natalia sold 48 clips", "Pi is 3.14159", "I'm sure they'll come.",
         "The capital of Italy is", "print(add(12, 30))", "ORDER BY name;",
         "half as many in May"]


DETERMINISTIC = ("request", "alpha", "accepted", "proposed", "new_tokens", "loss")


class Interrupt(Exception):
  pass


def serve(target, small, directory, *, resume: bool, stop_after=None):
  """The stream through the driver, learning online: (draft params, records)."""
  fitted = draft_lib.paired(target, small)
  draft = Draft(ModelDraft(fitted.config), fitted.params, fitted.source)
  records, state = [], None

  def on_request(record):
    if stop_after is not None and len(records) == stop_after:
      raise Interrupt
    records.append({k: v for k, v in record.items() if k in DETERMINISTIC})

  checkpointer = Checkpointer(directory, {"online": dataclasses.asdict(CFG)},
                              resume=resume)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      for state in driver.serve_stream(
          target, draft, [driver.Query(t) for t in TEXTS], CFG, num_slots=2,
          mesh=online.make_mesh(1), chat=False, checkpointer=checkpointer,
          checkpoint_every=2, on_request=on_request):
        pass
    params = jax.tree.map(np.asarray, state.draft_params)
    updates = int(np.asarray(state.num_updates).sum())
  except Interrupt:
    params, updates = None, 0
  finally:
    checkpointer.close()
  return params, records, updates


def test_online_learning_and_resume_with_a_pretrained_draft(target, small, tmp_path):
  whole, records, updates = serve(target, small, str(tmp_path / "a"), resume=False)
  assert updates >= 2 and len(records) == len(TEXTS)
  untrained = draft_lib.paired(target, small).params
  # The state holds each layer's weights apart (online.per_layer).
  assert not np.allclose(whole["layers"][0]["wq"], untrained["layers"]["wq"][0])
  serve(target, small, str(tmp_path / "b"), resume=False, stop_after=5)
  resumed, rest, _ = serve(target, small, str(tmp_path / "b"), resume=True)
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)
  by_request = {r["request"]: r for r in records}
  assert rest and all(r == by_request[r["request"]] for r in rest)


def test_learned_pretrained_draft_exports_in_its_family_and_serves(target, small,
                                                                   tmp_path):
  fitted = draft_lib.paired(target, small)
  loading.save_hf(fitted, str(tmp_path))
  back = loading.load(str(tmp_path))
  assert back.config == fitted.config and back.config.family == "qwen2"
  spec = Engine(target, back, k=3, max_new_tokens=12)
  plain = Engine(target, max_new_tokens=12)
  assert ([c.token_ids for c in spec.generate_ids(prompts())]
          == [c.token_ids for c in plain.generate_ids(prompts())])


# --- exact sampling with other row counts (the TV harness) --------------------


def harness_pair(draft_rows: int):
  """The TV harness's target and an independent draft of `draft_rows` rows,
  fitted to the target's 12."""
  target = harness.model(seed=11, num_layers=2, logit_scale=2.0)
  other = harness.model(seed=12, num_layers=1, logit_scale=2.0)
  other = other.__class__(other.config.replace(vocab_size=draft_rows), {
      **other.params, "embed": np.resize(other.params["embed"], (draft_rows, 32)),
      "lm_head": np.resize(other.params["lm_head"], (32, draft_rows))},
      other.tokenizer, "other rows")
  fitted = draft_lib.fit_vocabulary(other, harness.V)
  assert fitted.config.vocab_size == harness.V
  return target, fitted


@pytest.mark.parametrize("draft_rows", [9, 14])
def test_sampling_with_a_draft_of_other_rows_stays_exact(draft_rows):
  """At temperature 1 a draft of 9 rows (no mass on the target's last 3
  tokens) and one of 14 (its 2 extra rows dropped) sample the target's
  distribution."""
  target, fitted = harness_pair(draft_rows)
  sampling = harness.Sampling(temperature=1.0)
  p = harness.exact_distribution(target, sampling)
  pairs = p[:-1].reshape(harness.V, harness.V)
  if draft_rows < harness.V:  # only the residual can give the draft's missing tokens
    assert pairs[draft_rows:].sum() + pairs[:, draft_rows:].sum() > 0.05
  samples, metrics = harness.sample(target, ModelDraft(fitted.config), fitted.params,
                                    2, sampling)
  assert 0 < metrics.accepted < metrics.proposed
  assert harness.empirical_tv(samples, p) < harness.tv_bound(p)


def test_a_wrong_rule_with_a_draft_of_other_rows_fails_the_bound(monkeypatch):
  """The same harness on the same pair fails a wrong rule (the residual
  replaced by p: the draft's missing tokens come out too rarely)."""
  target, fitted = harness_pair(9)
  monkeypatch.setattr(speculative, "_accept", harness.WRONG_RULES["resample_from_p"])
  sampling = harness.Sampling(temperature=1.0)
  p = harness.exact_distribution(target, sampling)
  samples, _ = harness.sample(target, ModelDraft(fitted.config), fitted.params, 2,
                              sampling)
  assert harness.empirical_tv(samples, p) > harness.tv_bound(p)


# --- entry points -------------------------------------------------------------


def test_a_checkpoint_draft_is_warm_started_only_when_asked(target, monkeypatch):
  """A serving entry point's default warm start (chat) is for drafts cut from
  the target; a pretrained checkpoint is served as it is unless asked."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from absl.testing import flagsaver  # pylint: disable=import-outside-toplevel
  from experiments import model_flags  # pylint: disable=import-outside-toplevel
  started = []
  monkeypatch.setattr(model_flags, "warm_started",
                      lambda t, d: started.append(d.source) or d)
  path = os.path.join(FIXTURES, "qwen2_draft")
  name = model_flags.WARM_START.name
  with flagsaver.flagsaver(draft=path, hybrid=False):
    flags.FLAGS.set_default(name, "chat")  # as serving entry points set it
    try:
      draft = model_flags.load_draft(target)
      assert not started and draft.drafter.config.vocab_size == 376
      with flagsaver.flagsaver(**{name: "chat"}):  # given on the command line
        model_flags.load_draft(target)
      assert len(started) == 1
    finally:
      flags.FLAGS.set_default(name, "none")
