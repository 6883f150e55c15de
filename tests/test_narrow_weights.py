"""A frozen target stored in bfloat16 under float32 compute (--target_weights):
its products take bfloat16 inputs with float32 accumulation, through the
AMX path on 2+ rows and the float32 copy on one row, and decoding stays
exact whichever path a step takes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import flagsaver

from experiments import model_flags
from osd_jax import hardware
from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.decoding.engine import Engine
from osd_jax.distillation import update
from osd_jax.models import llama
from tests.test_generation import REAL_PROMPTS, prompts_of_lengths, tiny_model
from tests.test_online_update import learn, make_buffer, start
from tests.test_speculative import hybrid_draft


def narrowed(model: LoadedModel) -> LoadedModel:
  """The same model with every weight rounded to bfloat16, compute float32."""
  params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), model.params)
  return LoadedModel(model.config.replace(param_dtype="bfloat16"), params,
                     model.tokenizer, model.source + ", bfloat16 weights")


def rounded_product(x, kernel):
  """What the narrow product computes: bfloat16 inputs, exact float32 math."""
  x16 = np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float32)
  return x16.astype(np.float64) @ np.asarray(kernel, np.float32).astype(np.float64)


@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 3, 48), (5, 48)])
@pytest.mark.parametrize("with_wide", [False, True])
def test_a_narrow_kernel_multiplies_bfloat16_inputs_in_float32(shape, with_wide):
  x = jax.random.normal(jax.random.key(0), shape)
  kernel = jax.random.normal(jax.random.key(1), (48, 40)).astype(jnp.bfloat16)
  wide = kernel.astype(jnp.float32) if with_wide else None
  out = jax.jit(llama.matmul)(x, kernel, wide)
  assert out.dtype == jnp.float32 and out.shape == shape[:-1] + (40,)
  np.testing.assert_allclose(out, rounded_product(x, kernel), rtol=1e-5, atol=1e-5)
  # Unrounded inputs would give another answer: the test can tell them apart.
  exact = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
  assert np.abs(exact - rounded_product(x, kernel)).max() > 1e-3


def test_a_kernel_as_wide_as_its_input_multiplies_as_before():
  x = jax.random.normal(jax.random.key(0), (3, 16))
  kernel = jax.random.normal(jax.random.key(1), (16, 8))
  np.testing.assert_array_equal(llama.matmul(x, kernel), x @ kernel)
  x16 = x.astype(jnp.bfloat16)
  assert llama.matmul(x16, kernel).dtype == jnp.bfloat16  # --dtype=bfloat16


def test_the_cpu_decoding_layout_keeps_float32_copies_of_narrow_weights_only():
  model = tiny_model()
  assert not any(k.endswith(llama.WIDE) for k in llama.for_decoding(
      model.params, model.config)["layers"][0])
  narrow = narrowed(model)
  layout = llama.for_decoding(narrow.params, narrow.config)
  layer = layout["layers"][0]
  for name in ("wqkv", "wo", "w_gate_up", "w_down"):
    assert layer[name].dtype == jnp.bfloat16
    np.testing.assert_array_equal(layer[name + llama.WIDE], layer[name].astype(jnp.float32))
  assert "attn_norm" + llama.WIDE not in layer  # vectors are read whole anyway
  assert "lm_head" + llama.WIDE in layout
  np.testing.assert_array_equal(layout["embed" + llama.WIDE],
                                layout["embed"].astype(jnp.float32))
  again = llama.for_decoding(layout, narrow.config)  # idempotent
  assert jax.tree.structure(again) == jax.tree.structure(layout)


def widened_tables(layout, config) -> int:
  """Ops of a compiled 4-step decode loop whose result is a float32
  [vocab, hidden] table (parameters and the loop's carried values aside)."""
  def decode(params, tokens, cache):
    def step(_, carry):
      tokens, cache = carry
      logits, cache = llama.apply(params, config, tokens, cache)
      return logits[:, -1:].argmax(-1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, 4, step, (tokens, cache))[0]
  cache = config.init_cache(2, 16)
  hlo = jax.jit(decode).lower(layout, jnp.ones((2, 1), jnp.int32),
                              cache).compile().as_text()
  made = re.findall(rf"= f32\[{config.vocab_size},{config.hidden_dim}\]\{{[^}}]*\}} ([\w-]+)\(",
                    hlo)
  return sum(op not in ("parameter", "get-tuple-element", "bitcast") for op in made)


def test_a_decode_step_gathers_embeddings_without_widening_the_table():
  """XLA on CPU gathers from a bfloat16 table by widening all of it, hoisted
  out of the decode loop; the layout's float32 copy of the embedding (read
  by llama.embed_rows) avoids that. Without the copy the compiled loop
  widens the table: the check can tell."""
  narrow = narrowed(tiny_model())
  layout = llama.for_decoding(narrow.params, narrow.config)
  assert widened_tables(layout, narrow.config) == 0
  if jax.default_backend() == "cpu":
    without = {k: v for k, v in layout.items() if k != "embed" + llama.WIDE}
    assert widened_tables(without, narrow.config) > 0


def test_a_derived_draft_of_a_narrow_target_learns_in_float32():
  draft = draft_lib.derive(narrowed(tiny_model()), [0, 1])
  assert draft.config.param_dtype == "float32"
  assert {w.dtype for w in jax.tree.leaves(draft.params)} == {jnp.dtype(jnp.float32)}


def test_learning_in_bfloat16_matmuls_keeps_float32_weights():
  """matmul_dtype=bfloat16: the draft's kernels enter its products in
  bfloat16 (close to the float32 update, not equal); weights, moments and
  the embedding stay float32."""
  buffer, _ = make_buffer(teacher_k=4)
  updates = {}
  for dtype in ("float32", "bfloat16"):
    cfg = update.DistillConfig(learning_rate=1e-2, matmul_dtype=dtype)
    params, opt_state = start(cfg)
    params, opt_state, loss, skipped = learn(params, opt_state, buffer, cfg)
    assert int(skipped) == 0
    assert {w.dtype for w in jax.tree.leaves((params, opt_state))
            if hasattr(w, "dtype") and w.ndim} == {jnp.dtype(jnp.float32)}
    updates[dtype] = (float(loss), params)
  (loss32, p32), (loss16, p16) = updates["float32"], updates["bfloat16"]
  np.testing.assert_allclose(loss16, loss32, rtol=2e-2)
  assert loss16 != loss32  # the products did change precision
  for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
    np.testing.assert_allclose(a, b, atol=2e-2)


def test_the_learning_matmul_dtype_follows_the_host(monkeypatch):
  cfg = update.DistillConfig()
  kernel = {"embed": jnp.ones((4, 2)), "w": jnp.ones((2, 3)), "norm": jnp.ones(3)}
  assert update.learning_matmul_dtype(cfg) is None  # conftest: as without AMX
  assert update.with_matmul_dtype(kernel, None) is kernel
  monkeypatch.setattr(hardware, "bfloat16_matmuls_are_fast", lambda: True)
  assert update.learning_matmul_dtype(cfg) == "bfloat16"
  assert update.learning_matmul_dtype(update.DistillConfig(matmul_dtype="float32")) == "float32"
  cast = update.with_matmul_dtype(kernel, "bfloat16")
  assert [cast[k].dtype for k in ("embed", "w", "norm")] == [jnp.float32, jnp.bfloat16,
                                                             jnp.float32]
  with pytest.raises(ValueError, match="matmul_dtype"):
    update.DistillConfig(matmul_dtype="float16")


def greedy_one_slot(model, draft, prompts, k, max_new_tokens):
  engine = Engine(model, draft, k=k, max_new_tokens=max_new_tokens, num_slots=1)
  return [r.token_ids for r in engine.generate_ids(prompts)]


def test_narrow_target_speculation_equals_its_greedy_decoding():
  """One slot: target-only steps take the one-row (float32 copy) path, the
  verification of k + 1 tokens the multi-row (bfloat16) path."""
  target = narrowed(tiny_model())
  prompts = prompts_of_lengths((3, 8), seed=5)
  expected = greedy_one_slot(target, None, prompts, 0, 12)
  for draft in (draft_lib.derive(target, [0, 1]), hybrid_draft(draft_lib.derive(target, [0]))):
    assert greedy_one_slot(target, draft, prompts, 3, 12) == expected


@pytest.mark.parametrize("choice, amx, dtype, expected", [
    ("auto", True, "float32", "bfloat16"), ("auto", False, "float32", "float32"),
    ("auto", False, "bfloat16", "bfloat16"), ("float32", True, "float32", "float32"),
    ("bfloat16", False, "float32", "bfloat16")])
def test_target_weights_flag(monkeypatch, choice, amx, dtype, expected):
  monkeypatch.setattr(hardware, "bfloat16_matmuls_are_fast", lambda: amx)
  with flagsaver.flagsaver((model_flags.TARGET_WEIGHTS, choice), (model_flags.DTYPE, dtype)):
    assert model_flags.target_weight_dtype() == expected


@pytest.mark.real_model
def test_real_narrow_target_speculation_equals_its_greedy_decoding(smollm2):
  """SmolLM2 in bfloat16 weights, one slot, derived and hybrid drafts, k = 3."""
  target = narrowed(smollm2)
  prompts = [smollm2.tokenizer(p)["input_ids"] for p in REAL_PROMPTS[:2]]
  expected = greedy_one_slot(target, None, prompts, 0, 16)
  head = draft_lib.frequent_token_ids(smollm2.tokenizer, 8192)
  derived = draft_lib.derive(target, [0, 1], head)
  for draft in (derived, hybrid_draft(derived)):
    assert greedy_one_slot(target, draft, prompts, 3, 16) == expected


@pytest.mark.parametrize("value, fast", [("0", False), ("1", True)])
def test_the_override_decides_and_a_bad_one_is_refused(monkeypatch, value, fast):
  monkeypatch.setenv(hardware.OVERRIDE, value)
  assert hardware.bfloat16_matmuls_are_fast() is fast
  monkeypatch.setenv(hardware.OVERRIDE, "yes")
  with pytest.raises(ValueError, match=hardware.OVERRIDE):
    hardware.bfloat16_matmuls_are_fast()
