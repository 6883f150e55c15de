"""The feature draft: training rollout equals decoding, rollback equals prefill, it learns."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import Context, FeatureDraft
from osd_jax.decoding.prefill import prefill_hidden
from osd_jax.decoding.sampling import GREEDY
from osd_jax.distillation import objectives, rollout_alpha, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.models import eagle, llama
from tests.tiny_models import pair

K = 3


@functools.lru_cache(maxsize=None)
def setup(head=True):
  target, _ = pair()
  config = eagle.FeatureConfig(target.config,
                               tuple(range(0, 64, 2)) + (1, 3) if head else None)
  drafter = FeatureDraft(config, rollout=K)
  params = eagle.init_params(target.params, target.config)
  # Perturb the block so levels differ from a copy of the target's last layer.
  noise = jax.tree.map(lambda x: 0.05 * jax.random.normal(jax.random.key(1), x.shape),
                       params)
  params = jax.tree.map(jnp.add, params, noise)
  tparams = llama.for_decoding(target.params, target.config)
  return target, drafter, params, tparams


def features(target, tokens_1xL):
  hidden, _ = llama.forward(target.params, target.config, tokens_1xL)
  return hidden


def test_rollout_levels_equal_the_proposal_steps():
  """Level s at position j is step s of a proposal made after m = j - s + 2 tokens."""
  target, drafter, params, tparams = setup()
  rng = np.random.default_rng(0)
  head = jnp.asarray(drafter.config.head_token_ids)
  bound = eagle.bind(params, tparams, drafter.config)
  for m in (4, 7, 9):
    # Decoding state after committing c_0..c_{m-1}, with c_m the last token.
    prompt = jnp.asarray(rng.integers(3, 64, (1, m + 1)), jnp.int32)
    hidden, _ = prefill_hidden(target.params, target.config, prompt,
                               jnp.asarray([m]), target.config.init_cache(1, 32))
    state = drafter.prefill(bound, drafter.init_state(1, 32), prompt,
                            jnp.asarray([m + 1]), hidden)
    ctx = Context(jnp.pad(prompt, ((0, 0), (0, 20))), jnp.asarray([m]),
                  jnp.zeros((1,), jnp.int32))
    proposal, _ = drafter.propose(bound, state, ctx, speculative.row_keys(
        jax.random.key(0), 1), K, GREEDY, None)
    # Training sees the sequence the proposal continued, with the target's features.
    tokens = jnp.concatenate([prompt, proposal.tokens], axis=1)
    levels = eagle.rollout(bound, drafter.config, tokens, features(target, tokens), K)
    for s in range(1, K + 1):
      want = eagle.logits(bound, drafter.config, levels[s - 1][:, m + s - 2])
      np.testing.assert_allclose(proposal.logits[:, s - 1][:, head], want[:, head],
                                 rtol=1e-4, atol=1e-4, err_msg=f"m={m} step {s}")


def test_levels_differ():
  """The check above is not vacuous: later levels predict other features."""
  target, drafter, params, tparams = setup()
  tokens = jnp.asarray(np.random.default_rng(1).integers(3, 64, (1, 12)), jnp.int32)
  bound = eagle.bind(params, tparams, drafter.config)
  levels = eagle.rollout(bound, drafter.config, tokens, features(target, tokens), K)
  assert float(jnp.abs(levels[0] - levels[1]).max()) > 1e-3


@pytest.mark.parametrize("ks", [(K,) * 4, (K, 0, 0, K, 0)])
def test_commit_after_a_rejection_equals_a_fresh_prefill(ks):
  """Cache and feature after steps with rejections = prefill of the accepted
  prefix; plain target steps (k = 0) among them included."""
  target, drafter, params, tparams = setup()
  rng = np.random.default_rng(2)
  prompts = jnp.asarray(rng.integers(3, 64, (3, 6)), jnp.int32)
  lens = jnp.asarray([6, 4, 5])
  bound = drafter.prepare(params, tparams)
  state, _ = speculative.start(tparams, bound, prompts, lens, jnp.full((3,), 12),
                               speculative.row_keys(jax.random.key(0), 3),
                               target_config=target.config, drafter=drafter, k=K,
                               cache_size=40)
  step = jax.jit(functools.partial(speculative.speculate_and_verify,
                                   target_config=target.config, drafter=drafter,
                                   sampling=GREEDY), static_argnames="k")
  rejections = 0
  for k in ks:
    state, result = step(tparams, bound, state, k=k)
    rejections += int(((result.num_accepted < K) & result.active).sum())
    m = np.asarray(state.lengths)
    for row in range(3):
      sequence = state.tokens[row:row + 1, :m[row] + 1]
      hidden, _ = prefill_hidden(target.params, target.config, sequence,
                                 jnp.asarray([m[row]]),
                                 target.config.init_cache(1, 40))
      fresh = drafter.prefill(bound, drafter.init_state(1, 40), sequence,
                              jnp.asarray([m[row] + 1]), hidden)
      np.testing.assert_allclose(state.draft.feature[row], fresh.feature[0],
                                 rtol=1e-4, atol=1e-4)
      for got, want in zip(state.draft.cache.valid_entries(row, m[row]),
                           fresh.cache.valid_entries(0, m[row])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert rejections > 0


def buffer_of(target, tokens, gen_start):
  """A buffer holding sequences, their features and the target's full teacher."""
  n, length = tokens.shape
  gen_len = length - int(gen_start.max()) - 1
  hidden, _ = llama.forward(target.params, target.config, tokens)
  logits = llama.logits(target.params, target.config, hidden)
  positions = gen_start[:, None] + jnp.arange(gen_len)
  p = jnp.take_along_axis(jax.nn.softmax(logits, -1), positions[..., None], axis=1)
  ids, probs = jax.lax.top_k(p, 64)
  buffer = Buffer.empty(n, length, gen_len, 64, target.config.hidden_dim)
  return buffer.add(tokens, gen_start, jnp.ones((n, gen_len)), ids, probs,
                    jnp.zeros((n,), jnp.int32), jnp.ones((n,), bool), hidden)


def test_distillation_lowers_the_loss_and_raises_agreement():
  target, drafter, params, tparams = setup(head=False)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(3, 64, (8, 20)), jnp.int32)
  buffer = buffer_of(target, tokens, jnp.full((8,), 5))
  cfg = update.DistillConfig(learning_rate=3e-3)
  opt = update.init_opt_state(params, cfg)
  distill = jax.jit(functools.partial(objectives.distill, drafter, tparams,
                                      target.config, cfg=cfg, steps=30))
  before = distill(params, opt, buffer)[2]
  params2, _, _, skipped = distill(params, opt, buffer)
  after = distill(params2, opt, buffer)[2]
  assert int(skipped) == 0
  assert float(after) < 0.8 * float(before), (before, after)


def test_rollout_alpha_is_each_steps_acceptance_after_a_right_prefix():
  """rollout_alpha's level s equals step s of proposals decoded one token at a
  time, fed the text's own tokens, from every start inside the generation."""
  target, drafter, params, tparams = setup()
  rng = np.random.default_rng(4)
  length, gen_start = 14, 4
  tokens = jnp.asarray(rng.integers(3, 64, (1, length)), jnp.int32)
  generated = (jnp.arange(length - 1) < length - 1 - gen_start)[None]  # 9 tokens
  got = rollout_alpha.level_sums(params, tparams, tokens, jnp.asarray([gen_start]),
                                 generated.astype(jnp.float32), drafter=drafter,
                                 target_config=target.config, depth=K)
  bound = eagle.bind(params, tparams, drafter.config)
  hidden = features(target, tokens)
  p = jax.nn.softmax(llama.logits(target.params, target.config, hidden), -1)[0]
  head = np.asarray(drafter.config.head_token_ids)
  # One program each (prefill reads the whole text, but only the first m + 1
  # tokens count: the cache keeps m positions and the feature comes from m - 1).
  prefill = jax.jit(lambda n: drafter.prefill(bound, drafter.init_state(1, 32),
                                              tokens, n, hidden))
  step = jax.jit(lambda token, feature, cache: eagle.forward(
      bound, drafter.config, token, feature[:, None], cache))
  want = np.zeros((K, 3))
  for m in range(gen_start, length - 1):  # a proposal after c_0..c_m
    state = prefill(jnp.asarray([m + 1]))
    feature, cache = state.feature, state.cache
    for s in range(1, min(K, length - 1 - m) + 1):
      if s > 1:  # the text's token, with the previous step's feature
        out, cache = step(tokens[:, m + s - 1:m + s], feature, cache)
        feature = out[:, 0]
      q = jax.nn.softmax(eagle.head_logits(bound, feature), -1)[0]
      alpha = float(jnp.minimum(p[m + s - 1, head], q).sum())
      agree = float(head[int(jnp.argmax(q))] == int(tokens[0, m + s]))
      want[s - 1] += (alpha, agree, 1.0)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
  assert want[:, 0].min() < want[:, 2].min() - 0.5  # not all accepted


def test_level_decay_weighs_the_later_rollout_steps():
  """Step s of the rollout weighs decay ** (s - 1): each step's own sums come
  from rollouts one step shorter (decay 1), and decay 0 is rollout 1."""
  target, drafter, params, tparams = setup(head=False)
  tokens = jnp.asarray(np.random.default_rng(5).integers(3, 64, (4, 16)), jnp.int32)
  buffer = buffer_of(target, tokens, jnp.full((4,), 5))
  p = update.teacher_probs(tparams, target.config, buffer)
  sums = lambda **change: np.asarray(objectives.loss_sum(
      dataclasses.replace(drafter, **change), params, tparams, buffer, p,
      update.DistillConfig()))
  upto = [np.zeros(2)] + [sums(rollout=s) for s in range(1, K + 1)]
  each = [upto[s] - upto[s - 1] for s in range(1, K + 1)]  # (loss, weight) of step s
  assert each[1][0] / each[1][1] != pytest.approx(each[0][0] / each[0][1], rel=1e-3)
  for decay in (0.0, 0.5):
    want = sum(decay ** s * x for s, x in enumerate(each))
    np.testing.assert_allclose(sums(level_decay=decay), want, rtol=1e-5)
