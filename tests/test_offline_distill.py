"""Offline distillation: what is collected, that training lowers the loss, the CLI."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import offline_distill
from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints import loading
from osd_jax.decoding.engine import Engine
from osd_jax.distillation import offline
from osd_jax.serving import driver
from tests import tiny_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NEW = 6
CFG = offline.OfflineConfig(max_new_tokens=MAX_NEW, prompt_len=16, epochs=6,
                            batch_size=4, collect_batch_size=4)


@pytest.fixture(scope="module")
def models():
  return tiny_models.pair()


@pytest.fixture(scope="module")
def prompts(models):
  target, _ = models
  rng = np.random.default_rng(1)
  texts = [" ".join(f"w{i}" for i in rng.integers(5, 64, rng.integers(2, 12)))
           for _ in range(10)]
  return driver.encode_prompts(target, texts, chat=True)


def collect(models, prompts, **changes):
  target, draft = models
  cfg = dataclasses.replace(CFG, **changes)
  return offline.collect(target.params, target.config, draft.params,
                         draft.config, prompts, cfg, log=lambda _: None)


def continuations(data):
  """Generated ids per row, cut at the weighted (generated) length."""
  tokens, starts = np.asarray(data.tokens), np.asarray(data.gen_start) + 1
  lengths = np.asarray(data.loss_weight).sum(1).astype(int)
  return [row[s:s + n].tolist() for row, s, n in zip(tokens, starts, lengths)]


def greedy(model, prompts):
  return [r.token_ids for r in Engine(model, max_new_tokens=MAX_NEW).generate_ids(prompts)]


@pytest.fixture(scope="module")
def served(models, prompts):
  return collect(models, prompts)


def test_served_source_is_the_targets_greedy_text(models, prompts, served):
  target, _ = models
  assert served.capacity == len(prompts)
  assert np.array_equal(np.asarray(served.tokens)[:, :3], np.asarray(
      [p[:3] for p in prompts]))
  assert continuations(served) == greedy(target, prompts)
  # The teacher's top-1 at every generated position is the greedy token.
  weight = np.asarray(served.loss_weight) > 0
  top1 = np.asarray(served.teacher_ids)[..., 0]
  gen = np.stack([row[s + 1:s + 1 + MAX_NEW] for row, s in zip(
      np.asarray(served.tokens), np.asarray(served.gen_start))])
  assert np.array_equal(top1[weight], gen[weight])
  assert np.all(np.asarray(served.teacher_probs).sum(-1) <= 1 + 1e-5)


def test_draft_source_is_the_drafts_greedy_text(models, prompts):
  _, draft = models
  data = collect(models, prompts, sample_source="draft")
  assert continuations(data) == greedy(draft, prompts)


@pytest.mark.parametrize("source", ["mixed_token", "mixed_request"])
def test_mixed_sources_at_their_extremes(models, prompts, served, source):
  all_target = collect(models, prompts, sample_source=source, source_mix=1.0)
  all_draft = collect(models, prompts, sample_source=source, source_mix=0.0)
  assert continuations(all_target) == continuations(served)
  assert continuations(all_draft) == continuations(
      collect(models, prompts, sample_source="draft"))


def test_long_prompts_are_dropped(models, prompts):
  data = collect(models, prompts + [list(range(5, 30))])
  assert data.capacity == len(prompts)


def test_kept_teacher_equals_recomputed_teacher(models, served, prompts):
  """Top-64 of a 64-token vocabulary is the whole distribution: same loss."""
  target, draft = models
  full = collect(models, prompts, teacher_k=64)
  none = full.replace(teacher_ids=full.teacher_ids[..., :0],
                      teacher_probs=full.teacher_probs[..., :0])
  loss = lambda data, cfg: offline.mean_loss(
      draft.params, target.params, target.config, draft.config, data, cfg)
  assert loss(full, CFG) == pytest.approx(
      loss(none, dataclasses.replace(CFG, teacher_k=0)), rel=1e-4)


def test_mean_loss_does_not_depend_on_minibatch_padding(models, served):
  target, draft = models
  loss = lambda size: offline.mean_loss(
      draft.params, target.params, target.config, draft.config, served,
      dataclasses.replace(CFG, batch_size=size))
  assert loss(3) == pytest.approx(loss(4), rel=1e-5)


@pytest.fixture(scope="module")
def distilled(models, prompts):
  target, draft = models
  return offline.distill(target.params, target.config, draft.params,
                         draft.config, prompts, CFG, log=lambda _: None)


def test_distillation_lowers_the_loss_on_its_data(models, distilled):
  target, draft = models
  after = offline.mean_loss(distilled.params, target.params, target.config,
                            draft.config, distilled.data, CFG)
  assert after < 0.8 * distilled.loss_before
  assert distilled.epoch_losses[-1] < distilled.epoch_losses[0]
  # The caller's draft is untouched (the step donates a copy).
  assert offline.mean_loss(draft.params, target.params, target.config,
                           draft.config, distilled.data, CFG) == pytest.approx(
                               distilled.loss_before)


def test_distillation_raises_alpha_on_its_prompts(models, prompts, distilled):
  target, draft = models
  alpha = lambda params: offline.static_alpha(
      target.params, target.config, params, draft.config, prompts, k=3,
      sampling=CFG.sampling, max_new_tokens=MAX_NEW, prompt_len=16,
      batch_size=4)["alpha"]
  assert alpha(distilled.params) > alpha(draft.params)


def test_static_alpha_of_the_target_as_its_own_draft_is_one(models, prompts):
  target, _ = models
  same = draft_lib.derive(target, range(target.config.num_layers))
  measured = offline.static_alpha(
      target.params, target.config, same.params, same.config, prompts, k=3,
      sampling=CFG.sampling, max_new_tokens=MAX_NEW, prompt_len=16, batch_size=4)
  assert measured["requests"] == len(prompts)
  assert measured["alpha"] == pytest.approx(1.0, abs=1e-4)
  assert measured["acceptance_rate"] == pytest.approx(1.0)


def test_checkpoint_round_trip(models, distilled, tmp_path):
  _, draft = models
  offline_distill.save_draft(str(tmp_path), distilled.params, draft.config)
  restored = offline_distill.restore_draft(str(tmp_path), draft.params)
  jax.tree.map(np.testing.assert_array_equal, restored, distilled.params)


def test_config_rejects_unknown_source():
  with pytest.raises(ValueError, match="sample_source"):
    offline.OfflineConfig(sample_source="oracle")


def test_cli_end_to_end(models, tmp_path):
  """python -m experiments.offline_distill on a tiny HF target and a prompts file."""
  target, _ = models
  target_dir, out, hf = (str(tmp_path / n) for n in ("target", "out", "hf"))
  loading.save_hf(target, target_dir)
  prompts_file = tmp_path / "prompts.txt"
  prompts_file.write_text("\n".join(f"w{i} w{i + 3} w{i + 7}" for i in range(5, 17)))
  command = [sys.executable, "-m", "experiments.offline_distill",
             f"--target={target_dir}", "--draft_layers=0", "--draft_head_vocab=40",
             f"--prompts_file={prompts_file}", "--num_train=12", "--epochs=3",
             "--batch_size=4", "--max_new_tokens=5", "--prompt_len=16",
             f"--output_dir={out}", f"--hf_dir={hf}", "--compilation_cache="]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "epoch 3/3" in done.stdout
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert summary["samples"] == 12
  assert summary["epoch_losses"][-1] < summary["loss_before"]
  exported = loading.load(hf)
  loading.check_pair(target, exported)
  assert exported.config.head_token_ids == tuple(range(40))
  restored = offline_distill.restore_draft(out, exported.params)
  jax.tree.map(np.testing.assert_allclose, restored, exported.params)
  derived = draft_lib.derive(target, [0], range(40))
  assert not np.allclose(exported.params["lm_head"], derived.params["lm_head"])
