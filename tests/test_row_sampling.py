"""Per-row sampling: requests with their own settings share a batch, each exact.

One batch of N rows in three groups (greedy; temperature 0.7 with top-p 0.9;
temperature 1.3 with top-k 5) decodes speculatively with a draft that
differs from the target. Greedy rows must give the argmax; each sampled
group's first token must follow the target's distribution under that
group's own settings (total variation within a McDiarmid bound at 1e-6).
The same harness with the groups' settings swapped must fail.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.decoding import sampling as sampling_lib
from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import ModelDraft
from osd_jax.decoding.sampling import RowSampling, Sampling
from osd_jax.models import llama
from tests.test_generation import tiny_model

V = 16
N = 3 * 4096
PROMPT = [5, 9, 4, 7]
GROUPS = (Sampling(), Sampling(0.7, 0, 0.9), Sampling(1.3, 5, 1.0))


def models():
  target = tiny_model(seed=11, vocab_size=V, num_layers=2)
  target.params["lm_head"] = target.params["lm_head"] * 2.0  # peaked, varied
  return target, draft_lib.derive(target, [1])


def rows_of(groups) -> RowSampling:
  per = N // len(groups)
  pick = lambda f, dtype: jnp.asarray(np.repeat([f(g) for g in groups], per), dtype)
  return RowSampling(pick(lambda g: g.temperature, jnp.float32),
                     pick(lambda g: g.top_k, jnp.int32),
                     pick(lambda g: g.top_p, jnp.float32))


def first_tokens(target, draft, rows: RowSampling, seed=0) -> np.ndarray:
  """Each row's first generated token, all rows in one speculative call (k=2)."""
  drafter = ModelDraft(draft.config)
  tparams = llama.for_decoding(target.params, target.config)
  dparams = drafter.prepare(draft.params, tparams)
  prompts = jnp.tile(jnp.asarray([PROMPT], jnp.int32), (N, 1))
  state, _ = speculative.start(
      tparams, dparams, prompts, jnp.full((N,), len(PROMPT)), jnp.full((N,), 1),
      speculative.row_keys(jax.random.key(seed), N), target_config=target.config,
      drafter=drafter, k=2, cache_size=16, sampling=rows)
  state, _ = jax.jit(speculative.speculate_and_verify, static_argnames=(
      "target_config", "drafter", "k", "sampling"))(
          tparams, dparams, state, target_config=target.config, drafter=drafter,
          k=2, sampling=None)
  return np.asarray(state.tokens[:, len(PROMPT)])


def exact(target, sampling: Sampling) -> np.ndarray:
  logits, _ = llama.apply(target.params, target.config, jnp.asarray([PROMPT]))
  return np.asarray(sampling.probs(logits[0, -1]), np.float64)


def tv_bound(p: np.ndarray, n: int, delta: float = 1e-6) -> float:
  """E[TV] <= 1/2 sum sqrt(p(1-p)/n), plus McDiarmid's sqrt(ln(1/delta) / 2n)."""
  return 0.5 * np.sqrt(p * (1 - p) / n).sum() + math.sqrt(math.log(1 / delta) / (2 * n))


def check(tokens, target, groups):
  """Greedy groups give the argmax; sampled groups are within the TV bound."""
  per = N // len(groups)
  failures = []
  for i, sampling in enumerate(groups):
    got = tokens[i * per:(i + 1) * per]
    p = exact(target, sampling)
    if sampling.is_greedy:
      if not np.all(got == np.argmax(p)):
        failures.append((i, "greedy rows differ from the argmax"))
      continue
    freq = np.bincount(got, minlength=V) / per
    tv = 0.5 * np.abs(freq - p).sum()
    if tv > tv_bound(p, per):
      failures.append((i, f"TV {tv:.4f} > bound {tv_bound(p, per):.4f}"))
  return failures


def test_each_row_follows_its_own_settings():
  target, draft = models()
  assert check(first_tokens(target, draft, rows_of(GROUPS)), target, GROUPS) == []


def test_the_harness_fails_when_rows_use_the_wrong_settings():
  target, draft = models()
  swapped = (GROUPS[0], GROUPS[2], GROUPS[1])  # groups 1 and 2 draw each other's way
  tokens = first_tokens(target, draft, rows_of(swapped))
  assert len(check(tokens, target, GROUPS)) == 2


def test_row_sampling_filters_equal_the_static_ones():
  logits = jax.random.normal(jax.random.key(3), (3, 5, V)) * 3
  for sampling in GROUPS + (Sampling(1.0, 3, 0.5),):
    rows = RowSampling.fill(sampling, 3)
    np.testing.assert_allclose(rows.probs(logits), sampling.probs(logits),
                               rtol=1e-5, atol=1e-7)


def test_argmax_and_categorical_equal_jax_ones():
  """The blocked argmax gives jnp.argmax's index (ties to the lowest, masked
  rows, a width that is no multiple of the block); categorical is
  jax.random.categorical's draw bit for bit."""
  key = jax.random.key(7)
  for shape in ((1, 5, 49152), (8, 3, 300), (4, 128), (2, 7)):
    x = jax.random.normal(key, shape) * 3
    cases = (x, jnp.round(x),  # many ties
             x.at[..., -1].set(100.0),  # the max in the padded last block
             jnp.full(shape, -jnp.inf))  # a fully masked row: index 0
    for case in cases:
      np.testing.assert_array_equal(sampling_lib.argmax(case), jnp.argmax(case, axis=-1))
    keys = jax.random.split(key, shape[0])
    np.testing.assert_array_equal(
        jax.vmap(sampling_lib.categorical)(keys, x),
        jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(keys, x))
  nan_row = jnp.zeros((1, 300)).at[0, 3].set(jnp.nan)
  assert 0 <= int(sampling_lib.argmax(nan_row)[0]) < 300
