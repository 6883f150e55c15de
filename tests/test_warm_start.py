"""The warm-start cache: built once, reused, rebuilt when anything it depends on changes."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from osd_jax import hardware
from osd_jax.decoding.drafts import Draft, FeatureDraft, ModelDraft
from osd_jax.distillation import warm_start
from osd_jax.models import eagle
from tests.tiny_models import pair

CFG = warm_start.WarmStartConfig(conversations=8, seq_len=24, epochs=2, batch_size=4,
                                 teacher_k=8)


def sequences(seed=0, n=8):
  rng = np.random.default_rng(seed)
  return [([int(t) for t in rng.integers(5, 64, 20)], 6) for _ in range(n)]


def build(root, target, draft, cfg=CFG, log=None):
  lines = []
  out = warm_start.load_or_build(target, draft, cfg, cache_root=str(root),
                                 log=log or lines.append, sequences=sequences())
  return out, lines


def model_draft():
  target, d = pair()
  return target, Draft(ModelDraft(d.config), d.params, d.source)


def flat(params):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])


def test_built_once_then_reused(tmp_path):
  target, draft = model_draft()
  built, lines = build(tmp_path, target, draft)
  assert any("distilling" in line for line in lines)
  assert not np.array_equal(flat(built.params), flat(draft.params))  # it trained
  again, lines = build(tmp_path, target, draft)
  assert any("cached draft" in line for line in lines)
  np.testing.assert_array_equal(flat(again.params), flat(built.params))
  assert len(os.listdir(tmp_path)) == 1


@pytest.mark.parametrize("change", ["setting", "target", "draft", "host"])
def test_a_change_rebuilds(tmp_path, change, monkeypatch):
  target, draft = model_draft()
  build(tmp_path, target, draft)
  cfg = CFG
  if change == "setting":
    cfg = dataclasses.replace(CFG, epochs=1)
  elif change == "host":  # one whose matrix units make it learn in bfloat16
    monkeypatch.setattr(hardware, "bfloat16_matmuls_are_fast", lambda: True)
  elif change == "target":
    target = dataclasses.replace(target, params=jax.tree.map(lambda x: x * 1.01,
                                                             target.params))
  else:
    draft = dataclasses.replace(draft, params=jax.tree.map(lambda x: x * 1.01,
                                                           draft.params))
  _, lines = build(tmp_path, target, draft, cfg)
  assert any("distilling" in line for line in lines)
  assert len(os.listdir(tmp_path)) == 2


def test_the_same_weights_elsewhere_reuse_the_cache(tmp_path):
  target, draft = model_draft()
  build(tmp_path, target, draft)
  moved = dataclasses.replace(target, source="/another/folder/model.gguf")
  _, lines = build(tmp_path, moved, dataclasses.replace(draft, source="moved"))
  assert any("cached draft" in line for line in lines)
  assert len(os.listdir(tmp_path)) == 1


@pytest.mark.parametrize("damage", ["flip_bytes", "truncate", "meta"])
def test_a_corrupt_cache_is_reported_and_rebuilt(tmp_path, damage):
  target, draft = model_draft()
  built, _ = build(tmp_path, target, draft)
  [key] = os.listdir(tmp_path)
  weights = tmp_path / key / "params.npz"
  if damage == "flip_bytes":
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
  elif damage == "truncate":
    weights.write_bytes(weights.read_bytes()[:100])
  else:
    (tmp_path / key / "meta.json").write_text("{not json")
  rebuilt, lines = build(tmp_path, target, draft)
  assert any(("checksum" in line or "cannot read" in line) and "rebuilding" in line
             for line in lines), lines
  assert any("distilling" in line for line in lines)
  # Rebuilt, not silently used: the same training gives the same weights again.
  np.testing.assert_allclose(flat(rebuilt.params), flat(built.params), atol=1e-6)


def test_feature_draft_warm_start_lowers_its_loss(tmp_path):
  target, _ = pair()
  draft = Draft(FeatureDraft(eagle.FeatureConfig(target.config), rollout=2),
                eagle.init_params(target.params, target.config), "eagle")
  lines = []
  warm_start.load_or_build(target, draft, dataclasses.replace(CFG, epochs=4),
                           cache_root=str(tmp_path), log=lines.append,
                           sequences=sequences(n=16))
  losses = [float(line.rsplit(" ", 1)[-1]) for line in lines if "epoch" in line]
  assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_a_draft_without_parameters_is_refused(tmp_path):
  from osd_jax.decoding.drafts import NGramDraft  # pylint: disable=import-outside-toplevel
  target, _ = pair()
  with pytest.raises(ValueError, match="nothing to warm-start"):
    warm_start.load_or_build(target, Draft(NGramDraft(64), (), "ngram"), CFG,
                             cache_root=str(tmp_path))
