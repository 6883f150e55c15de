"""An exported restricted-head draft is the same model in transformers as in osd-jax."""

import jax
import numpy as np
import pytest
import transformers

from osd_jax.checkpoints import loading
from osd_jax.models import llama
from tests import tiny_models

PROMPT = [1, 7, 12, 30, 5, 9, 44]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """The tiny pair's draft (40 of 64 tokens in its head) and where it was saved."""
  _, draft = tiny_models.pair()
  path = str(tmp_path_factory.mktemp("draft"))
  loading.save_hf(draft, path)
  return draft, path


@pytest.fixture(scope="module")
def torch_model(exported):
  torch = pytest.importorskip("torch")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      exported[1], dtype=torch.float32)
  return torch, model


def split_vocab(draft):
  head = list(draft.config.head_token_ids)
  outside = sorted(set(range(draft.config.vocab_size)) - set(head))
  return head, outside


def ours(draft) -> np.ndarray:
  """osd-jax's logits at the prompt's last position (outside the head: masked)."""
  logits, _ = llama.apply(draft.params, draft.config, jax.numpy.asarray([PROMPT]))
  return np.asarray(logits[0, -1])


def test_generation_config_suppresses_the_tokens_outside_the_head(exported):
  draft, path = exported
  head, outside = split_vocab(draft)
  assert outside and len(head) == 40
  generation = transformers.GenerationConfig.from_pretrained(path)
  assert generation.suppress_tokens == outside
  assert generation.eos_token_id == draft.config.eos_id
  assert loading.load(path).config == draft.config  # osd-jax reads it back exactly


def test_generate_draws_from_the_distribution_osd_jax_draws_from(exported, torch_model):
  draft, _ = exported
  torch, model = torch_model
  head, outside = split_vocab(draft)
  expected = np.asarray(jax.nn.softmax(ours(draft)))
  ids = torch.tensor([PROMPT])
  # Assisted generation hands the draft the target's generation config; the
  # draft's own suppress_tokens still apply, since that config leaves it unset.
  for config in (None, transformers.GenerationConfig()):
    out = model.generate(ids, generation_config=config, max_new_tokens=1,
                         do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    theirs = torch.softmax(out.scores[0][0], -1).numpy()
    np.testing.assert_allclose(theirs[head], expected[head], rtol=1e-4, atol=1e-7)
    assert not theirs[outside].any() and not expected[outside].any()


def test_a_raw_forward_gives_the_other_tokens_logit_zero(exported, torch_model):
  """What a tool that ignores generation_config.json sees (see the README)."""
  draft, _ = exported
  torch, model = torch_model
  head, outside = split_vocab(draft)
  with torch.no_grad():
    logits = model(torch.tensor([PROMPT])).logits[0, -1].numpy()
  np.testing.assert_allclose(logits[head], ours(draft)[head], rtol=1e-4, atol=1e-4)
  assert not logits[outside].any()
