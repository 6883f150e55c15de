"""Divergences and teacher distributions against plain numpy, and their properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.distillation import losses, teacher
from osd_jax.distillation.update import DistillConfig

V = 16


def dirichlet(seed, shape=(3, 5), alpha=0.5, zeros=False):
  """Random distributions [*shape, V], optionally with exact zeros."""
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.full(V, alpha), size=shape)
  if zeros:
    p = np.where(rng.random(p.shape) < 0.3, 0.0, p)
    p[..., 0] += 1e-3  # never an all-zero row
    p /= p.sum(-1, keepdims=True)
  return p.astype(np.float32)


def np_kl(p, q):
  p, q = np.float64(p), np.float64(q)
  safe = np.where(p > 0, p, 1.0)
  return np.sum(np.where(p > 0, p * (np.log(safe) - np.log(q)), 0.0), axis=-1)


def np_jsd(p, q, beta):
  m = beta * np.float64(p) + (1 - beta) * np.float64(q)
  return beta * np_kl(p, m) + (1 - beta) * np_kl(q, m)


def np_tvd(p, q):
  return 0.5 * np.abs(np.float64(p) - np.float64(q)).sum(-1)


NUMPY = {
    "fkl": lambda p, q: np_kl(p, q),
    "rkl": lambda p, q: np_kl(q, p),
    "jsd": lambda p, q: np_jsd(p, q, 0.5),
    "tvd": np_tvd,
    "fkl_rkl": lambda p, q: 0.9 * np_kl(p, q) + 0.1 * np_kl(q, p),
}


def student(seed, shape=(3, 5)):
  """Student logits and their softmax q."""
  logits = np.random.default_rng(seed).normal(0, 2, shape + (V,)).astype(np.float32)
  return logits, np.asarray(jax.nn.softmax(logits, axis=-1))


def log_softmax(logits):
  return jax.nn.log_softmax(jnp.asarray(logits), axis=-1)


def test_names_are_the_table():
  assert set(NUMPY) == set(losses.NAMES)


@pytest.mark.parametrize("name", losses.NAMES)
def test_divergence_matches_numpy(name):
  p = dirichlet(0)
  logits, q = student(1)
  got = np.asarray(losses.divergence(name)(jnp.asarray(p), log_softmax(logits)))
  assert got.shape == p.shape[:-1]
  np.testing.assert_allclose(got, NUMPY[name](p, q), rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["fkl", "jsd", "tvd"])
def test_teacher_zeros_are_zero_log_zero(name):
  """0 log 0 = 0: a teacher with exact zeros gives finite, numpy-equal values."""
  p = dirichlet(2, zeros=True)
  assert (p == 0).any()
  logits, q = student(3)
  got = np.asarray(losses.divergence(name)(jnp.asarray(p), log_softmax(logits)))
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, NUMPY[name](p, q), rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("name", losses.NAMES)
def test_zero_iff_equal(name):
  logits, q = student(4)
  f = losses.divergence(name)
  at_equal = np.asarray(f(jnp.asarray(q), log_softmax(logits)))
  np.testing.assert_allclose(at_equal, 0.0, atol=2e-6)
  p = dirichlet(5)
  assert np.all(np.asarray(f(jnp.asarray(p), log_softmax(logits))) > 1e-4)


def test_tvd_is_one_minus_alpha():
  p = dirichlet(6)
  logits, q = student(7)
  tvd = np.asarray(losses.total_variation(jnp.asarray(p), log_softmax(logits)))
  alpha = np.minimum(p, q).sum(-1)
  np.testing.assert_allclose(tvd, 1.0 - alpha, atol=2e-6)
  assert np.all((tvd >= 0) & (tvd <= 1))


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_bounds_and_symmetry(beta):
  """0 <= JSD(beta) <= h(beta), reached on disjoint supports; JSD_b(p,q) = JSD_1-b(q,p)."""
  h = -beta * np.log(beta) - (1 - beta) * np.log(1 - beta)
  p = dirichlet(8, alpha=0.3)
  logits, q = student(9)
  jsd = np.asarray(losses.generalized_jsd(jnp.asarray(p), log_softmax(logits), beta))
  assert np.all(jsd >= 0) and np.all(jsd <= h + 1e-6)
  swapped = losses.generalized_jsd(jnp.asarray(q), jnp.log(jnp.asarray(p)), 1 - beta)
  np.testing.assert_allclose(jsd, swapped, rtol=1e-4, atol=1e-6)
  # Nearly disjoint: p on token 0, q (almost) all on token 1.
  one_hot = np.eye(V, dtype=np.float32)[0]
  far_logits = np.where(np.arange(V) == 1, 40.0, -40.0).astype(np.float32)
  far = losses.generalized_jsd(jnp.asarray(one_hot), log_softmax(far_logits), beta)
  np.testing.assert_allclose(far, h, rtol=1e-4)
  # beta is passed through by name.
  by_name = losses.divergence("jsd", beta=beta)(jnp.asarray(p), log_softmax(logits))
  np.testing.assert_allclose(by_name, jsd, rtol=1e-6)


def test_prototype_mix_is_09_fkl_01_rkl():
  p = dirichlet(10)
  logits, _ = student(11)
  lq = log_softmax(logits)
  mix = losses.prototype_mix(jnp.asarray(p), lq)
  expected = (0.9 * losses.forward_kl(jnp.asarray(p), lq)
              + 0.1 * losses.reverse_kl(jnp.asarray(p), lq))
  np.testing.assert_allclose(mix, expected, rtol=1e-6)
  assert not np.allclose(mix, losses.forward_kl(jnp.asarray(p), lq))


def test_unknown_name_raises():
  with pytest.raises(ValueError, match="Unknown loss"):
    losses.divergence("kl")
  with pytest.raises(ValueError, match="Unknown loss"):
    DistillConfig(loss="js")
  with pytest.raises(ValueError, match="temperature"):
    DistillConfig(temperature=0.0)


def test_temperature_one_is_identity():
  p = dirichlet(12, zeros=True)
  logits, _ = student(13)
  p1, lq1 = losses.tempered(jnp.asarray(p), jnp.asarray(logits), 1.0)
  np.testing.assert_array_equal(p1, p)
  np.testing.assert_allclose(lq1, log_softmax(logits), rtol=1e-6)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_tempers_both_sides(temperature):
  """p_T is proportional to p^(1/T) (zeros stay zero); q_T = softmax(z / T)."""
  p = dirichlet(14, zeros=True)
  logits, _ = student(15)
  p_t, lq_t = losses.tempered(jnp.asarray(p), jnp.asarray(logits), temperature)
  expected = np.float64(p) ** (1.0 / temperature)
  expected /= expected.sum(-1, keepdims=True)
  np.testing.assert_allclose(p_t, expected, rtol=1e-4, atol=1e-7)
  assert np.all(np.asarray(p_t)[p == 0] == 0)
  np.testing.assert_allclose(lq_t, log_softmax(logits / temperature), rtol=1e-5)


def test_forward_kl_gradient_is_q_minus_p():
  p = dirichlet(16)
  logits, q = student(17)
  grad = jax.grad(lambda z: losses.forward_kl(
      jnp.asarray(p), jax.nn.log_softmax(z, axis=-1)).sum())(jnp.asarray(logits))
  np.testing.assert_allclose(grad, q - p, atol=1e-6)


def test_divergences_are_finite_and_differentiable():
  p = dirichlet(18, zeros=True)
  logits, _ = student(19)
  for name in losses.NAMES:
    grad = jax.grad(lambda z: losses.divergence(name)(
        jnp.asarray(p), jax.nn.log_softmax(z, axis=-1)).sum())(jnp.asarray(logits))
    assert np.all(np.isfinite(grad)), name
    assert np.abs(np.asarray(grad)).max() > 0, name


@pytest.mark.parametrize("name", ["fkl", "jsd"])
def test_nan_teacher_gives_nan_divergence(name):
  p = dirichlet(23)
  p[0, 0] = np.nan
  logits, _ = student(24)
  got = np.asarray(losses.divergence(name)(jnp.asarray(p), log_softmax(logits)))
  assert not np.isfinite(got[0, 0])
  assert np.all(np.isfinite(got[1:]))


@pytest.mark.parametrize("name", ["rkl", "tvd", "fkl_rkl"])
def test_nan_teacher_propagates(name):
  p = dirichlet(23)
  p[0, 0] = np.nan
  logits, _ = student(24)
  got = np.asarray(losses.divergence(name)(jnp.asarray(p), log_softmax(logits)))
  assert not np.isfinite(got[0, 0])
  assert np.all(np.isfinite(got[1:]))


# Teacher distributions ------------------------------------------------------


def test_top_k_matches_numpy():
  p = dirichlet(20)
  ids, probs = teacher.top_k(jnp.asarray(p), 4)
  assert ids.dtype == jnp.int32 and ids.shape == p.shape[:-1] + (4,)
  order = np.argsort(-p, axis=-1, kind="stable")[..., :4]
  np.testing.assert_array_equal(ids, order)
  np.testing.assert_array_equal(probs, np.take_along_axis(p, order, -1))



@pytest.mark.parametrize("vocab", [49152, 40000])  # SmolLM2's; not a whole block
@pytest.mark.parametrize("k", [1, 32])
def test_top_k_over_a_large_vocabulary_is_exact(vocab, k):
  """The two-stage top-k (blocks, then their entries) equals numpy's, also
  when most of the top-k crowd into one block and the rest are far apart."""
  rng = np.random.default_rng(vocab + k)
  logits = rng.standard_normal((3, 2, vocab)).astype(np.float32)
  logits[0, 0, 128:128 + k] += 20  # all k in one block
  logits[1, 1, vocab - 3:] += 20  # the tail past the last whole block
  p = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
  ids, probs = teacher.top_k(jnp.asarray(p), k)
  order = np.argsort(-p, axis=-1, kind="stable")[..., :k]
  np.testing.assert_array_equal(ids, order)
  np.testing.assert_array_equal(probs, np.take_along_axis(p, order, -1))

@pytest.mark.parametrize("k", [1, 4, V])
def test_dense_keeps_top_k_and_total_mass(k):
  p = dirichlet(21)
  ids, probs = teacher.top_k(jnp.asarray(p), k)
  full = np.asarray(teacher.dense(ids, probs, V))
  assert full.shape == p.shape
  np.testing.assert_array_equal(np.take_along_axis(full, np.asarray(ids), -1), probs)
  np.testing.assert_allclose(full.sum(-1), 1.0, atol=1e-6)
  if k == V:
    np.testing.assert_array_equal(full, p)
  else:
    # The missing mass is spread evenly over the other tokens, all > 0.
    rest = np.ones_like(full, bool)
    np.put_along_axis(rest, np.asarray(ids), False, -1)
    tail = (1.0 - np.asarray(probs).sum(-1)) / (V - k)
    np.testing.assert_allclose(
        full[rest].reshape(p.shape[:-1] + (V - k,)),
        np.broadcast_to(tail[..., None], p.shape[:-1] + (V - k,)), rtol=1e-5)
    assert np.all(full > 0)


def test_on_support_renormalises():
  p = dirichlet(22)
  support = (0, 3, 5, 7, 15)
  restricted = np.asarray(teacher.on_support(jnp.asarray(p), support))
  expected = p[..., list(support)] / p[..., list(support)].sum(-1, keepdims=True)
  np.testing.assert_allclose(restricted, expected, rtol=1e-6)
  np.testing.assert_allclose(restricted.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_array_equal(teacher.on_support(jnp.asarray(p), None), p)


@pytest.mark.parametrize("k", [1, 4, V])
def test_dense_on_a_support_equals_restricting_the_dense_teacher(k):
  """Built on the draft head's tokens directly, without the full-vocabulary array."""
  p = dirichlet(23)
  ids, probs = teacher.top_k(jnp.asarray(p), k)
  support = (0, 3, 5, 7, 15)
  direct = np.asarray(teacher.dense(ids, probs, V, support))
  assert direct.shape == p.shape[:-1] + (len(support),)
  via_full = np.asarray(teacher.on_support(teacher.dense(ids, probs, V), support))
  np.testing.assert_allclose(direct, via_full, rtol=1e-5, atol=1e-7)
  # Already on the support: on_support leaves it alone.
  np.testing.assert_array_equal(teacher.on_support(jnp.asarray(direct), support), direct)
