"""Speculative sampling is exact: its outputs follow the target's distribution.

On a 12-token vocabulary we draw N sequences at once and compare the joint
distribution of the first two generated tokens (EOS first counts as one cell)
with the target's exact distribution, enumerated from its logits. Rejection
sampling is exact for any draft, so every draft kind must pass: a model cut
from the target, an independent random model, one whose head covers half the
vocabulary (q = their softmax), the n-gram draft (q one-hot at the copied
token, or no proposal at all), the hybrid of the two, a draft that stops
early after an unlikely draw, and k = 0 (no draft).
Wrong rules run through the same harness must fail.

Bound on the total variation TV = 1/2 sum_i |f_i - p_i| of the empirical
frequencies f from N i.i.d. samples of p:
  * mean: N f_i is Binomial(N, p_i), so by Jensen
    E|f_i - p_i| <= sd = sqrt(p_i (1 - p_i) / N), hence
    E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N)  (<= 1/2 sqrt(K / N) for K cells);
  * concentration: changing one sample moves TV by at most 1/N, so McDiarmid
    gives P(TV >= E[TV] + t) <= exp(-2 N t^2); t = sqrt(ln(1/delta) / (2N))
    with delta = 1e-6 makes a false failure a one-in-a-million event.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import gate
from osd_jax.decoding.drafts import (Context, HybridDraft, ModelDraft, NGramDraft,
                                     NoDraft)
from osd_jax.decoding.sampling import Sampling
from osd_jax.models import llama
from tests.test_generation import tiny_model

V = 12
EOS = 2
N = 16384
DELTA = 1e-6
# Its last token occurred before: the n-gram draft copies what followed,
# [4, 11], and the target's first token is 4 about half the time.
PROMPT = [10, 11, 4, 11]
COPIED = 4
apply = jax.jit(llama.apply, static_argnames="config")


def model(seed, num_layers, logit_scale):
  """A tiny random model whose head is scaled for peaked, varied distributions."""
  m = tiny_model(seed=seed, vocab_size=V, num_layers=num_layers)
  m.params["lm_head"] = m.params["lm_head"] * logit_scale
  return m


@pytest.fixture(scope="module")
def target():
  return model(seed=11, num_layers=2, logit_scale=2.0)


@pytest.fixture(scope="module")
def draft(target):
  """Near the target (TV 0.2-0.5 per setting): it is accepted often, not always."""
  return draft_lib.derive(target, [1])


def np_probs(logits_xV, sampling):
  """Temperature, then top-k, then the smallest nucleus of mass >= top_p; numpy."""
  z = np.asarray(logits_xV, np.float64) / sampling.temperature
  if sampling.top_k:
    z = np.where(z < np.sort(z, -1)[..., [-sampling.top_k]], -np.inf, z)
  if sampling.top_p < 1:
    p = np.exp(z - z.max(-1, keepdims=True))
    p_desc = -np.sort(-p / p.sum(-1, keepdims=True), -1)
    in_nucleus = np.cumsum(p_desc, -1) - p_desc < sampling.top_p
    z_desc = -np.sort(-z, -1)
    cutoff = np.where(in_nucleus, z_desc, np.inf).min(-1, keepdims=True)
    z = np.where(z < cutoff, -np.inf, z)
  p = np.exp(z - z.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def exact_distribution(target, sampling):
  """P(first two tokens) over (V-1)*V pairs plus one cell for EOS first."""
  logits, _ = apply(target.params, target.config, jnp.asarray([PROMPT]))
  p1 = np_probs(logits[0, -1], sampling)
  seconds = jnp.asarray([PROMPT + [a] for a in range(V)])
  logits, _ = apply(target.params, target.config, seconds)
  p2 = np_probs(logits[:, -1], sampling)  # [first token, second token]
  joint = p1[:, None] * p2
  joint[EOS] = 0.0
  return np.append(joint.ravel(), p1[EOS])


def cells(tokens_Nx2, lengths_N):
  """Cell index of each sample: first * V + second, or V*V for EOS first."""
  first_is_eos = tokens_Nx2[:, 0] == EOS
  assert np.all(lengths_N == np.where(first_is_eos, 1, 2))
  return np.where(first_is_eos, V * V, tokens_Nx2[:, 0] * V + tokens_Nx2[:, 1])


def sample(target, drafter, draft_params, k, sampling, seed=0, trim_verify=False):
  """N runs of 2 new tokens, traced afresh (see the wrong rules): (cells, metrics)."""
  def run(target_params, draft_params, prompts, lens, rng):
    return speculative.generate.__wrapped__(
        target_params, draft_params, prompts, lens, rng,
        target_config=target.config, drafter=drafter, k=k, sampling=sampling,
        max_new_tokens=2, cache_size=len(PROMPT) + 2 + k + 1,
        trim_verify=trim_verify)

  prompts = jnp.tile(jnp.asarray([PROMPT], jnp.int32), (N, 1))
  state = jax.jit(run)(target.params, draft_params, prompts,
                       jnp.full((N,), len(PROMPT), jnp.int32), jax.random.key(seed))
  p = len(PROMPT)
  samples = cells(np.asarray(state.tokens[:, p:p + 2]),
                  np.asarray(state.num_generated))
  return samples, jax.tree.map(lambda x: float(np.sum(x)), state.metrics)


def model_draft(draft):
  return ModelDraft(draft.config), draft.params


def ngram_draft():
  return NGramDraft(V), ()


def hybrid_draft(draft):
  return HybridDraft(ModelDraft(draft.config), NGramDraft(V)), draft.params


def tv_bound(p):
  """E[TV] bound plus the McDiarmid margin (see the module docstring)."""
  mean = 0.5 * np.sum(np.sqrt(p * (1 - p) / N))
  return mean + math.sqrt(math.log(1 / DELTA) / (2 * N))


def empirical_tv(samples, p):
  f = np.bincount(samples, minlength=V * V + 1)[:len(p)] / N
  assert f.sum() == pytest.approx(1.0)  # no sample fell outside the cells
  return 0.5 * np.abs(f - p).sum()


def tv(p, q):
  return 0.5 * np.abs(p - q).sum()


SETTINGS = [  # (sampling, k)
    (Sampling(temperature=1.0), 2),
    (Sampling(temperature=0.7, top_k=5), 3),
    (Sampling(temperature=1.5, top_p=0.8), 2),
]


def test_target_only_sampling_matches_target(target):
  """k = 0: every step is one target call, through the same speculative loop."""
  sampling = SETTINGS[0][0]
  p = exact_distribution(target, sampling)
  samples, metrics = sample(target, NoDraft(V), (), 0, sampling)
  assert metrics.proposed == 0
  assert empirical_tv(samples, p) < tv_bound(p)


def test_harness_rejects_a_wrong_temperature(target):
  """The same test on target-only samples drawn at another temperature fails."""
  p = exact_distribution(target, SETTINGS[0][0])
  samples, _ = sample(target, NoDraft(V), (), 0, Sampling(temperature=1.3))
  assert empirical_tv(samples, p) > tv_bound(p)


@pytest.mark.parametrize("sampling, k", SETTINGS)
def test_speculative_sampling_matches_target(target, draft, sampling, k):
  p = exact_distribution(target, sampling)
  # The draft alone is far from the target: matching p is the rule's doing.
  assert tv(p, exact_distribution(draft, sampling)) > 3 * tv_bound(p)
  samples, metrics = sample(target, *model_draft(draft), k, sampling)
  assert 0 < metrics.accepted < metrics.proposed
  assert empirical_tv(samples, p) < tv_bound(p)


def test_independent_draft_stays_exact(target):
  far = model(seed=12, num_layers=1, logit_scale=2.0)
  sampling, k = SETTINGS[2]
  p = exact_distribution(target, sampling)
  assert tv(p, exact_distribution(far, sampling)) > 0.5
  samples, _ = sample(target, *model_draft(far), k, sampling)
  assert empirical_tv(samples, p) < tv_bound(p)


def test_restricted_head_draft_stays_exact(target):
  head = (0, 2, 4, 6, 8, 10)
  restricted = draft_lib.derive(target, [0], head)
  sampling = Sampling(temperature=1.3, top_k=8)
  p = exact_distribution(target, sampling)
  # q = 0 outside the head: only the residual can produce those tokens.
  is_outside = ~np.isin(np.arange(V), head)
  pairs_VxV = p[:-1].reshape(V, V)
  assert pairs_VxV[is_outside[:, None] | is_outside[None, :]].sum() > 0.2
  samples, _ = sample(target, *model_draft(restricted), 2, sampling)
  assert empirical_tv(samples, p) < tv_bound(p)


def first_token_probs(target, sampling):
  logits, _ = apply(target.params, target.config, jnp.asarray([PROMPT]))
  return np_probs(logits[0, -1], sampling)


def test_ngram_draft_stays_exact(target):
  """q is one-hot at the copied tokens; unmatched steps propose nothing."""
  sampling, k = SETTINGS[1]
  p = exact_distribution(target, sampling)
  p1 = first_token_probs(target, sampling)
  # The copy is accepted sometimes, and often the next step has no match.
  assert 0.2 < p1[COPIED] < 0.8 and p1[~np.isin(np.arange(V), PROMPT)].sum() > 0.2
  ctx = Context(jnp.asarray([PROMPT]), jnp.asarray([len(PROMPT) - 1]),
                jnp.zeros((1,), jnp.int32))
  assert NGramDraft(V).lookup(ctx, 2)[0].tolist() == [[COPIED, PROMPT[-1]]]
  samples, metrics = sample(target, *ngram_draft(), k, sampling)
  assert 0 < metrics.accepted < metrics.proposed < k * metrics.target_calls
  assert empirical_tv(samples, p) < tv_bound(p)


@pytest.mark.parametrize("trim_verify", [False, True])
def test_confident_draft_stays_exact(target, draft, trim_verify):
  """Proposals that stop after an unlikely draw: their length is the draft's
  own doing, so the rule stays exact, and so does verifying only as many
  positions as were proposed."""
  sampling, k = SETTINGS[0]
  p = exact_distribution(target, sampling)
  confident = ModelDraft(draft.config, confidence_threshold=0.3)
  samples, metrics = sample(target, confident, draft.params, k, sampling,
                            trim_verify=trim_verify)
  # Both whole and cut-short proposals occurred.
  assert metrics.target_calls < metrics.proposed < k * metrics.target_calls
  assert empirical_tv(samples, p) < tv_bound(p)


def stop_before_unlikely_draws(target, draft):
  """(TV, bound, metrics) of a draft proposing only draws it gave >= 0.6."""
  sampling, k = SETTINGS[0]
  p = exact_distribution(target, sampling)
  short = ModelDraft(draft.config, confidence_threshold=0.6,
                     stop_before_unconfident=True)
  samples, metrics = sample(target, short, draft.params, k, sampling,
                            trim_verify=True)
  # Some steps proposed nothing, some proposed draws.
  assert 0 < metrics.proposed < metrics.target_calls
  return empirical_tv(samples, p), tv_bound(p), metrics


def test_a_draft_stopping_before_an_unlikely_draw_stays_exact(target, draft):
  """Whether a draw is proposed depends on the draw itself; given that it is,
  q is the one token above the threshold, one-hot, and the rule is exact."""
  tv, bound, _ = stop_before_unlikely_draws(target, draft)
  assert tv < bound


def test_keeping_the_softmax_of_a_selected_draw_fails(target, draft, monkeypatch):
  """The same draft with q its softmax (selection ignored) is not exact."""
  monkeypatch.setattr(ModelDraft, "_given_proposed",
                      lambda self, logits, tokens, sampling: logits)
  tv, bound, _ = stop_before_unlikely_draws(target, draft)
  assert tv > bound


def test_hybrid_draft_stays_exact(target, draft):
  """The copy on matched steps, the model draft's own draws on the others."""
  sampling, k = SETTINGS[2]
  p = exact_distribution(target, sampling)
  p1 = first_token_probs(target, sampling)
  assert 0.2 < p1[COPIED] < 0.8 and p1[~np.isin(np.arange(V), PROMPT)].sum() > 0.2
  samples, metrics = sample(target, *hybrid_draft(draft), k, sampling)
  assert 0 < metrics.accepted < metrics.proposed
  assert empirical_tv(samples, p) < tv_bound(p)


def test_a_gated_hybrid_stays_exact(target, draft, monkeypatch):
  """With no exploration and cost 0.9 the draft serves a row's second step
  only if the row's first proposal had a token accepted: the decision reads
  past draws (never the step's own), and the samples still follow p."""
  monkeypatch.setattr(gate, "EXPLORE_STEPS", 0)
  sampling, k = SETTINGS[2]
  p = exact_distribution(target, sampling)
  drafter = HybridDraft(ModelDraft(draft.config), NGramDraft(V), draft_cost=0.9)
  samples, metrics = sample(target, drafter, draft.params, k, sampling)
  ungated, _ = sample(target, *hybrid_draft(draft), k, sampling)
  assert 0 < metrics.accepted < metrics.proposed
  assert not np.array_equal(samples, ungated)  # the gate changed what was drawn
  assert empirical_tv(samples, p) < tv_bound(p)


def test_a_gated_hybrid_exploring_lookup_misses_stays_exact(target, draft,
                                                            monkeypatch):
  """Exploring every lookup miss (a schedule of past lookups), the closed
  gate still serves a row's second step: what is drawn changes, p holds."""
  monkeypatch.setattr(gate, "EXPLORE_STEPS", 0)
  sampling, k = SETTINGS[2]
  p = exact_distribution(target, sampling)
  closed = HybridDraft(ModelDraft(draft.config), NGramDraft(V), draft_cost=0.9)
  exploring = HybridDraft(ModelDraft(draft.config), NGramDraft(V), draft_cost=0.9,
                          explore_every=1)
  samples, metrics = sample(target, exploring, draft.params, k, sampling)
  without, fewer = sample(target, closed, draft.params, k, sampling)
  assert metrics.proposed > fewer.proposed  # it explored where the gate was shut
  assert not np.array_equal(samples, without)
  assert empirical_tv(samples, p) < tv_bound(p)


# --- wrong rules must fail the same test -------------------------------------


def _rule(is_accepted, residual):
  """An acceptance rule with _accept's signature, from its two formulas."""

  def accept(proposal, target_logits, keys_B, sampling):
    drafted = proposal.tokens
    b, k = drafted.shape
    p, q = sampling.probs(target_logits), sampling.probs(proposal.logits)
    split = jax.vmap(jax.random.split)(keys_B)
    at = lambda x: jnp.take_along_axis(x[:, :k], drafted[..., None], -1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(split[:, 0])
    is_real = jnp.arange(k) < proposal.num_proposed[:, None]
    n = jnp.cumprod(is_accepted(u, at(p), at(q)) & is_real, axis=1).sum(axis=1)
    q_padded = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)
    q_row = jnp.where(n < proposal.num_proposed, n, k)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(q_padded, q_row[:, None, None], axis=1)[:, 0]
    r = residual(p_n, q_n)
    r = jnp.where(r.sum(-1, keepdims=True) > 0, r, p_n)
    draw = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r)))
    return n, draw(split[:, 1], r).astype(jnp.int32), jnp.zeros((b, k))

  return accept


_RESIDUAL = lambda p, q: jnp.maximum(p - q, 0.0)
WRONG_RULES = {
    "always_accept": _rule(lambda u, p, q: jnp.ones_like(u, bool), _RESIDUAL),
    "inverted_ratio": _rule(lambda u, p, q: u * p < q, _RESIDUAL),  # min(1, q/p)
    "resample_from_p": _rule(lambda u, p, q: u * q < p, lambda p, q: p),
}


def test_the_rule_written_out_passes(target, draft, monkeypatch):
  """The harness's own rule, written right, passes: the wrong ones fail for
  their formulas, not for how they are plugged in."""
  sampling, k = SETTINGS[0]
  monkeypatch.setattr(speculative, "_accept", _rule(lambda u, p, q: u * q < p,
                                                    _RESIDUAL))
  p = exact_distribution(target, sampling)
  samples, _ = sample(target, *model_draft(draft), k, sampling)
  assert empirical_tv(samples, p) < tv_bound(p)


@pytest.mark.parametrize("name, kind", [
    *((name, "model") for name in sorted(WRONG_RULES)),
    ("resample_from_p", "ngram")])
def test_wrong_acceptance_rule_fails_the_bound(target, draft, monkeypatch, name,
                                               kind):
  sampling, k = SETTINGS[0]
  monkeypatch.setattr(speculative, "_accept", WRONG_RULES[name])
  p = exact_distribution(target, sampling)
  drafter = model_draft(draft) if kind == "model" else ngram_draft()
  assert empirical_tv(sample(target, *drafter, k, sampling)[0], p) > tv_bound(p)
