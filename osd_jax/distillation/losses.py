"""Divergences between the teacher (target) and the student (draft), by name.

Each takes teacher probabilities p and student logits over the same last axis
and returns one value per position. 0 * log 0 is taken as 0 everywhere.
"""

import functools

import jax
import jax.numpy as jnp

# The prototype's online "jsd" is not a JSD: a fixed forward/reverse KL mix.
PROTOTYPE_MIX = 0.9


# Masks test `p != 0`, not `p > 0`: a NaN teacher must give a NaN loss (and a
# skipped update), never read as probability 0.
def _log(p):
  return jnp.log(jnp.where(p != 0, p, 1.0))


def kl(p: jax.Array, q: jax.Array) -> jax.Array:
  """KL(p || q) = sum_v p (log p - log q)."""
  return jnp.sum(jnp.where(p != 0, p * (_log(p) - _log(q)), 0.0), axis=-1)


def forward_kl(p, log_q):
  """KL(p || q): mode-covering; the gradient is cross-entropy to the teacher."""
  return jnp.sum(jnp.where(p != 0, p * (_log(p) - log_q), 0.0), axis=-1)


def reverse_kl(p, log_q):
  """KL(q || p): mode-seeking."""
  q = jnp.exp(log_q)
  return jnp.sum(q * (log_q - jnp.log(jnp.maximum(p, 1e-30))), axis=-1)


def generalized_jsd(p, log_q, beta: float = 0.5):
  """DistillSpec's JSD(beta) = beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q."""
  q = jnp.exp(log_q)
  m = beta * p + (1.0 - beta) * q
  return beta * kl(p, m) + (1.0 - beta) * kl(q, m)


def total_variation(p, log_q):
  """TVD = 0.5 sum |p - q| = 1 - sum min(p, q): minimising it maximises alpha."""
  return 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1)


def prototype_mix(p, log_q):
  """0.9 FKL + 0.1 RKL, what the OSD prototype calls "jsd"."""
  return (PROTOTYPE_MIX * forward_kl(p, log_q)
          + (1.0 - PROTOTYPE_MIX) * reverse_kl(p, log_q))


NAMES = ("fkl", "rkl", "jsd", "tvd", "fkl_rkl")


def divergence(name: str, beta: float = 0.5):
  """The divergence function f(p, log_q) -> [...] named `name`."""
  table = {"fkl": forward_kl, "rkl": reverse_kl,
           "jsd": functools.partial(generalized_jsd, beta=beta),
           "tvd": total_variation, "fkl_rkl": prototype_mix}
  if name not in table:
    raise ValueError(f"Unknown loss {name!r}; choose one of {NAMES}.")
  return table[name]


def tempered(p: jax.Array, student_logits: jax.Array, temperature: float):
  """Teacher probs and student log-probs at a distillation temperature."""
  if temperature == 1.0:
    return p, jax.nn.log_softmax(student_logits, axis=-1)
  p_t = jax.nn.softmax(_log(p) / temperature + jnp.where(p != 0, 0.0, -jnp.inf),
                       axis=-1)
  return p_t, jax.nn.log_softmax(student_logits / temperature, axis=-1)
