"""The online state keeps a model draft's layers in arrays of their own.

Stacked [layers, ...], the weights were sliced into fresh copies by every
serve and insert call (online.per_layer); these tests pin the layout, and
that an export of it is the export of the stacked weights.
"""

import numpy as np

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints import layout
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.decoding.drafts import ModelDraft
from osd_jax.models import config as configs
from osd_jax.serving import online
from tests.tiny_models import random_params, word_tokenizer


def _two_layer_draft():
  config = configs.tiny(vocab_size=32, num_layers=3, tie_embeddings=False)
  target = LoadedModel(config, random_params(config, 5), word_tokenizer(32), "tiny")
  return target, draft_lib.derive(target, [0, 2])


def test_the_online_state_holds_each_draft_layer_in_arrays_of_its_own():
  target, draft = _two_layer_draft()
  cfg = online.OnlineConfig(k=2, max_new_tokens=4, cache_size=32, num_drafts=2)
  state = online.init_state(draft.params, ModelDraft(draft.config), target.config,
                            cfg, num_devices=1, num_slots=1, seed=0)
  layers = state.draft_params["layers"]
  assert isinstance(layers, list) and len(layers) == 2
  for i, layer in enumerate(layers):
    for name, w in layer.items():
      stacked = np.asarray(draft.params["layers"][name][i])
      assert w.shape == (2,) + stacked.shape  # one copy per draft
      np.testing.assert_array_equal(np.asarray(w[1]), stacked)


def test_other_drafts_parameters_are_left_as_they_are():
  assert online.per_layer(()) == ()
  weights = {"fc": np.ones((2, 2))}
  assert online.per_layer(weights) is weights


def test_an_export_of_the_per_layer_weights_is_the_stacked_export():
  _, draft = _two_layer_draft()
  stacked = layout.params_to_hf(draft.params, draft.config)
  per_layer = layout.params_to_hf(online.per_layer(draft.params), draft.config)
  assert stacked.keys() == per_layer.keys()
  for name, tensor in stacked.items():
    np.testing.assert_array_equal(per_layer[name], tensor, err_msg=name)
