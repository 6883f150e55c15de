"""Model flags: --dtype=bfloat16 on a CPU backend warns that float32 is faster;
the draft flags reach the drafter."""

from absl import flags
from absl.testing import flagsaver
import jax
import pytest

from experiments import model_flags
from osd_jax.checkpoints import loading
from osd_jax.decoding import drafts
from tests.test_generation import tiny_model


@pytest.fixture
def no_loading(monkeypatch):
  """loading.load records its dtype instead of reading a model."""
  calls = []
  monkeypatch.setattr(loading, "load", lambda spec, **kw: calls.append(kw))
  return calls


@pytest.mark.parametrize("dtype, warns", [("bfloat16", True), ("float32", False)])
def test_bfloat16_on_cpu_warns(no_loading, caplog, dtype, warns):
  assert jax.default_backend() == "cpu"
  with flagsaver.flagsaver((model_flags.DTYPE, dtype)):
    model_flags.load_target()
  assert no_loading == [{"param_dtype": dtype, "dtype": dtype}]
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  if warns:
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "bfloat16" in warnings[0] and "float32 is much faster" in warnings[0]
  else:
    assert not warnings


def test_the_confidence_threshold_reaches_the_model_draft():
  target = tiny_model()
  saved = dict(draft="derived", draft_layers=["0"], draft_head_vocab=0,
               warm_start="none", hybrid=True, draft_confidence_threshold=0.6)
  with flagsaver.flagsaver(**saved):
    draft = model_flags.load_draft(target)
  assert isinstance(draft.drafter, drafts.HybridDraft)
  assert draft.drafter.base.confidence_threshold == 0.6
  with flagsaver.flagsaver(**dict(saved, draft="eagle", hybrid=False)):
    with pytest.raises(ValueError, match="applies to model drafts"):
      model_flags.load_draft(target)


def test_the_short_proposal_flags_reach_the_drafters():
  target = tiny_model()
  saved = dict(draft="derived", draft_layers=["0"], draft_head_vocab=0,
               warm_start="none", hybrid=True, draft_confidence_threshold=0.6,
               draft_stop_before_unconfident=True, ngram_min=3, ngram_max=5,
               ngram_cap_at_match=False, ngram_history=7,
               ngram_history_min=3, ngram_history_min_share=0.25)
  with flagsaver.flagsaver(**saved):
    hybrid = model_flags.load_draft(target).drafter
  assert hybrid.base.stop_before_unconfident
  assert (hybrid.ngram.min_ngram, hybrid.ngram.max_ngram) == (3, 5)
  assert not hybrid.ngram.cap_at_match
  assert (hybrid.ngram.history, hybrid.ngram.history_min_ngram,
          hybrid.ngram.history_min_share) == (7, 3, 0.25)
  with flagsaver.flagsaver(draft="ngram", hybrid=False, ngram_cap_at_match=True):
    assert model_flags.load_draft(target).drafter.cap_at_match
  for threshold in (0.0, 0.3):
    with flagsaver.flagsaver(**dict(saved, draft_confidence_threshold=threshold)):
      with pytest.raises(ValueError, match="needs --draft_confidence_threshold above 0.5"):
        model_flags.load_draft(target)


def test_a_default_stop_before_waits_for_a_threshold_above_a_half():
  """Left at a default of on, it applies with 0.7 and stands aside with 0.3."""
  target = tiny_model()
  saved = dict(draft="derived", draft_layers=["0"], draft_head_vocab=0,
               warm_start="none", hybrid=False)
  flag = flags.FLAGS["draft_stop_before_unconfident"]
  with flagsaver.flagsaver():
    flags.FLAGS.set_default(flag.name, True)
    assert flag.using_default_value
    for threshold, applies in ((0.7, True), (0.3, False), (0.0, False)):
      with flagsaver.flagsaver(**dict(saved, draft_confidence_threshold=threshold)):
        drafter = model_flags.load_draft(target).drafter
      assert drafter.stop_before_unconfident == applies


def test_the_feature_draft_flags_reach_the_drafter():
  target = tiny_model()
  saved = dict(draft="eagle", hybrid=False, draft_head_vocab=0, warm_start="none",
               draft_confidence_threshold=0.0, eagle_rollout=3, eagle_level_decay=0.5)
  with flagsaver.flagsaver(**saved):
    drafter = model_flags.load_draft(target).drafter
  assert (drafter.rollout, drafter.level_decay) == (3, 0.5)
  for bad in ("-0.1", "1.5"):
    with flagsaver.flagsaver(), pytest.raises(flags.IllegalFlagValueError):
      flags.FLAGS["eagle_level_decay"].parse(bad)


def test_lookup_alone_refuses_the_learned_draft_flags():
  target = tiny_model()
  for name, value in (("warm_start", "chat"), ("draft_confidence_threshold", 0.6),
                      ("draft_layers", ["1"]), ("hybrid_draft_cost", 0.1)):
    with flagsaver.flagsaver(**{"draft": "ngram", "hybrid": False, name: value}):
      with pytest.raises(ValueError, match=f"--{name} applies to a learned draft"):
        model_flags.load_draft(target)
  # Set to off, they are accepted: there is nothing to ignore.
  with flagsaver.flagsaver(draft="ngram", hybrid=False, warm_start="none",
                           draft_confidence_threshold=0.0):
    assert isinstance(model_flags.load_draft(target).drafter, drafts.NGramDraft)


def test_a_serving_default_threshold_leaves_the_feature_draft_alone():
  """serve_with_the_best_draft's threshold is a default for model drafts:
  --draft=eagle works under it, and drafts k tokens."""
  target = tiny_model()
  with flagsaver.flagsaver(draft="eagle", hybrid=False, warm_start="none",
                           draft_head_vocab=0):
    model_flags.serve_with_the_best_draft()  # defaults: what the flags above set stays
    assert model_flags.DRAFT_CONFIDENCE.value == 0.7
    assert isinstance(model_flags.load_draft(target).drafter, drafts.FeatureDraft)


def test_entry_points_refuse_shared_flags_they_do_not_read():
  from absl import app  # pylint: disable=import-outside-toplevel
  from experiments import cli  # pylint: disable=import-outside-toplevel
  cli.refuse_unread(model_flags, model_flags.TARGET_FLAGS, "defaults are fine")
  with flagsaver.flagsaver(draft="ngram", ngram_max=3):
    with pytest.raises(app.UsageError,
                       match="--draft, --ngram_max have no effect here: it times"):
      cli.refuse_unread(model_flags, model_flags.TARGET_FLAGS, "it times the target")
    cli.refuse_unread(model_flags, model_flags.all_flags_but(), "every flag is read")
  assert "draft" in model_flags.all_flags_but(model_flags.TARGET_FLAGS)
  assert "target" not in model_flags.all_flags_but(model_flags.TARGET_FLAGS)
