"""Target-only generation, sampling rules, the Engine host API and the CLI."""

import collections
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.decoding import slots
from osd_jax.decoding.engine import Engine
from osd_jax.decoding.sampling import Sampling
from osd_jax.models import config as configs
from osd_jax.models import llama
from tests import compiles
from tests.tiny_models import word_tokenizer, random_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 64
apply = jax.jit(llama.apply, static_argnames="config")


def tiny_model(seed=3, **overrides) -> LoadedModel:
  # Untied heads: tied random models just repeat their last token.
  fields = dict(vocab_size=VOCAB, num_layers=4, tie_embeddings=False)
  fields.update(overrides)
  config = configs.tiny(**fields)
  return LoadedModel(config, random_params(config, seed), word_tokenizer(VOCAB),
                     f"tiny seed {seed}")


def with_eos(model, eos_id):
  return LoadedModel(model.config.replace(eos_id=eos_id), model.params,
                     model.tokenizer, model.source)


def prompts_of_lengths(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, VOCAB, n)] for n in lengths]


# Compiles dominate on CPU: most tests share this batch and these settings.
PROMPTS = prompts_of_lengths((2, 9, 5))
MAX_NEW = 12


def generate(model, prompt_ids=PROMPTS, max_new_tokens=MAX_NEW,
             sampling=Sampling(), seed=0):
  """Generated ids (EOS included) of each request."""
  engine = Engine(model, sampling=sampling, max_new_tokens=max_new_tokens)
  return [r.token_ids for r in engine.generate_ids(prompt_ids, seed)]


def naive_greedy(model, prompt, max_new_tokens):
  """Argmax of a full forward per token, no cache (padding right is causal-safe).

  Short sequences share one padded width: one compiled forward for all.
  """
  width = max(64, len(prompt) + max_new_tokens)
  sequence = list(prompt)
  for _ in range(max_new_tokens):
    padded = jnp.asarray([sequence + [0] * (width - len(sequence))])
    logits, _ = apply(model.params, model.config, padded)
    sequence.append(int(jnp.argmax(logits[0, len(sequence) - 1])))
    if sequence[-1] == model.config.eos_id:
      break
  return sequence[len(prompt):]


@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.fixture(scope="module")
def greedy(model):
  """The shared greedy run; it never emits EOS (id 2), so every row is full."""
  rows = generate(model)
  assert all(len(row) == MAX_NEW for row in rows)
  return rows


# --- greedy ---------------------------------------------------------------


def test_greedy_equals_argmax_of_full_forward(model, greedy):
  assert greedy == [naive_greedy(model, p, MAX_NEW) for p in PROMPTS]
  assert all(len(set(row)) > 4 for row in greedy)  # the model is not degenerate


def test_batched_generation_equals_one_by_one(model, greedy):
  assert greedy == [generate(model, [p])[0] for p in PROMPTS]


def test_eos_stops_each_row_where_it_appears(model, greedy):
  eos = greedy[0][4]
  stopped = generate(with_eos(model, eos))
  for full, cut in zip(greedy, stopped):
    assert cut == (full[:full.index(eos) + 1] if eos in full else full)
  assert len({len(row) for row in stopped}) > 1  # rows stop at different times


def test_engine_text_stops_before_eos(model, greedy):
  eos = greedy[0][4]
  engine = Engine(with_eos(model, eos), max_new_tokens=MAX_NEW)
  completions = engine.generate([" ".join(f"<{t}>" for t in p) for p in PROMPTS])
  assert completions[0].token_ids[-1] == eos
  for c, prompt in zip(completions, PROMPTS):
    assert c.prompt_ids == prompt
    ids = c.token_ids[:-1] if c.token_ids[-1] == eos else c.token_ids
    assert c.text.split() == [f"<{t}>" for t in ids]
    assert c.metrics == {}


def test_max_new_tokens_one(model, greedy):
  assert generate(model, max_new_tokens=1) == [row[:1] for row in greedy]


# --- sampling ---------------------------------------------------------------


def test_filters_that_keep_one_token_are_greedy(model, greedy):
  one = Sampling(temperature=2.0, top_k=1, top_p=1e-6)
  assert generate(model, sampling=one, seed=3) == greedy


def test_sampling_follows_the_seed(model):
  hot = Sampling(temperature=1.5)
  a = generate(model, sampling=hot, seed=1)
  assert a == generate(model, sampling=hot, seed=1)
  assert a != generate(model, sampling=hot, seed=2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Sampling(**kwargs)


def test_filters_keep_the_right_tokens():
  logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))
  kept = lambda s: np.isfinite(np.asarray(s.filtered_logits(logits)))[0].tolist()
  assert kept(Sampling(temperature=1.0, top_k=2)) == [False, True, False, True, False]
  # Nucleus: the fewest top tokens whose mass reaches top_p.
  assert kept(Sampling(temperature=1.0, top_p=0.7)) == [False, True, False, True, False]
  assert kept(Sampling(temperature=1.0, top_p=0.71)) == [False, True, False, True, True]
  assert kept(Sampling(temperature=1.0, top_k=100)) == [True] * 5
  probs = np.asarray(Sampling(temperature=0.5, top_k=3).probs(logits))
  expected = np.array([0, 0.4**2, 0, 0.3**2, 0.15**2]) / (0.4**2 + 0.3**2 + 0.15**2)
  np.testing.assert_allclose(probs[0], expected, rtol=1e-5, atol=1e-7)


# --- engine ---------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=-1), "k must be >= 0"),
    (dict(k=2), "needs a draft"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_engine_settings(model, kwargs, message):
  with pytest.raises(ValueError, match=message):
    Engine(model, **kwargs)


@pytest.mark.parametrize("k, prompt_len, max_new_tokens, cache_size, message", [
    (0, 0, 4, None, "at least 1 token; got an empty one"),
    (2, 0, 4, None, "at least 1 token; got an empty one"),
    (0, 500, 13, None, "Prompt of 500 tokens .* exceeds the context of 512"),
    (3, 500, 10, None, "Prompt of 500 tokens .* exceeds the context of 512"),
    (2, 20, 12, 32, "exceeds the engine's 32-position slots"),
])
def test_bad_prompts(model, k, prompt_len, max_new_tokens, cache_size, message):
  """Any bad request in the list fails the call up front, before any compile."""
  engine = Engine(model, model if k else None, k=k, max_new_tokens=max_new_tokens,
                  cache_size=cache_size)
  prompts = prompts_of_lengths([5, prompt_len])
  with pytest.raises(ValueError, match=message):
    engine.generate_ids(prompts)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_that_just_fits(model, k):
  """prompt + max_new_tokens + k == the context: served, and served right."""
  prompt = prompts_of_lengths([500])
  engine = Engine(model, model if k else None, k=k, max_new_tokens=12 - k)
  [result] = engine.generate_ids(prompt)
  assert result.token_ids == naive_greedy(model, prompt[0], 12 - k)


def test_prompt_buckets_are_half_octaves():
  """Prompts pad to powers of two or the midpoints: at most 1.5x their length
  past 64 tokens; windows keep powers of two."""
  assert [slots.prompt_bucket(n, 4096) for n in (1, 64, 65, 96, 97, 129, 193, 257, 385)] \
      == [64, 64, 96, 96, 128, 192, 256, 384, 512]
  assert all(slots.prompt_bucket(n, 4096) < 1.5 * n for n in range(65, 4097))
  assert slots.bucket(65, 4096) == 128


def test_prompt_bucket_never_outgrows_the_context():
  """97 tokens would pad to a bucket of 128 > 100 positions: the bucket is cut."""
  short = tiny_model(max_positions=100)
  prompt = prompts_of_lengths([97])
  assert slots.prompt_bucket(97, short.config.max_positions) == 100
  assert generate(short, prompt, max_new_tokens=3) == [naive_greedy(short, prompt[0], 3)]


# --- continuous batching ------------------------------------------------------

# More requests than slots, lengths 1..15: slots are refilled many times.
STREAM = prompts_of_lengths((1, 7, 3, 12, 2, 9, 5, 1, 15, 4, 8), seed=1)


@pytest.fixture(scope="module")
def stream_model(model):
  """The model with an EOS it emits at different steps of different requests."""
  rows = [naive_greedy(model, p, MAX_NEW) for p in STREAM]
  first_at = collections.defaultdict(set)
  for row in rows:
    for token in set(row):
      first_at[token].add(row.index(token))
  eos = max(first_at, key=lambda t: len(first_at[t]))
  return with_eos(model, eos)


@pytest.fixture(scope="module")
def stream_expected(stream_model):
  rows = [naive_greedy(stream_model, p, MAX_NEW) for p in STREAM]
  assert len({len(r) for r in rows}) > 3 and MAX_NEW in {len(r) for r in rows}
  return rows


def stream_engine(model, k, num_slots=3):
  draft = draft_lib.derive(model, [0, 1]) if k else None
  return Engine(model, draft, k=k, max_new_tokens=MAX_NEW, num_slots=num_slots,
                steps_per_call=2)


@pytest.mark.parametrize("k", [0, 2])
def test_stream_through_few_slots_equals_one_by_one(stream_model, stream_expected, k):
  engine = stream_engine(stream_model, k)
  served = [r.token_ids for r in engine.generate_ids(STREAM)]
  assert served == stream_expected
  assert [engine.generate_ids([p])[0].token_ids for p in STREAM] == stream_expected


def test_refilled_slot_keeps_no_trace_of_its_last_request(model):
  """A request after a long one in the same slot: same tokens, same metrics."""
  engine = stream_engine(model, k=2, num_slots=1)
  long_one, request = prompts_of_lengths([40, 3], seed=2)
  # Its stale cache and tokens lie past every position the request reaches.
  assert len(long_one) > len(request) + MAX_NEW
  [alone] = engine.generate_ids([request])
  _, after = engine.generate_ids([long_one, request])
  assert after.token_ids == alone.token_ids
  assert after.metrics == alone.metrics
  assert 0 < alone.metrics["acceptance_rate"] < 1  # the draft cache mattered


def test_generate_hands_a_freed_slot_back_at_once_when_requests_wait(model):
  """With `refill`, a call ends in the step a slot finishes, not after `steps`."""
  engine = Engine(model, max_new_tokens=MAX_NEW, num_slots=2)
  cfg = engine.slot_config(64)
  target_params, draft_params = engine._params()  # pylint: disable=protected-access
  prompt = jnp.asarray([PROMPTS[1] + [0] * (64 - len(PROMPTS[1]))])

  def after_one_call(refill):
    state = slots.init(cfg)
    for slot, budget in enumerate((3, MAX_NEW)):
      state = slots.insert(target_params, draft_params, state, prompt,
                           jnp.int32(len(PROMPTS[1])), jnp.int32(budget),
                           jnp.int32(slot), jax.random.key(slot), cfg=cfg)
    state = slots.generate(target_params, draft_params, state, refill, cfg=cfg,
                           steps=8, window=64)
    return np.asarray(state.done).tolist(), np.asarray(state.num_generated).tolist()

  # Target-only: one token a step. The short request ends with its 3rd token.
  assert after_one_call(True) == ([True, False], [3, 3])
  assert after_one_call(False) == ([True, False], [3, 8])


def test_a_call_over_the_first_slots_equals_one_over_all_and_leaves_the_rest(model):
  """generate(batch=2) on requests in slots 0 and 1 of 4: those slots decode as
  in a call over all four, and slots 2 and 3 stay bit-identical."""
  engine = Engine(model, draft_lib.derive(model, [0]), k=2, max_new_tokens=MAX_NEW,
                  num_slots=4)
  cfg = engine.slot_config(64)
  target_params, draft_params = engine._params()  # pylint: disable=protected-access

  def filled():
    state = slots.init(cfg)
    for slot, ids in enumerate(PROMPTS[:3]):  # slot 2 holds a third request...
      prompt = jnp.asarray([ids + [0] * (64 - len(ids))])
      state = slots.insert(target_params, draft_params, state, prompt,
                           jnp.int32(len(ids)), jnp.int32(MAX_NEW), jnp.int32(slot),
                           jax.random.key(slot), cfg=cfg)
    # ...that the host has freed (a client hung up): a call need not cover it.
    return state.replace(done=state.done.at[2].set(True))

  before = filled()  # never donated: compared against
  whole = slots.generate(target_params, draft_params, filled(), cfg=cfg, steps=4,
                         window=64)
  part = slots.generate(target_params, draft_params, filled(), cfg=cfg, steps=4,
                        window=64, batch=2)
  assert np.asarray(part.num_generated)[:2].min() > 1  # it decoded
  for name in ("tokens", "num_generated", "done"):
    assert np.array_equal(np.asarray(getattr(part, name))[:2],
                          np.asarray(getattr(whole, name))[:2]), name
  for got, want in zip(jax.tree.leaves(part.metrics), jax.tree.leaves(whole.metrics)):
    np.testing.assert_allclose(np.asarray(got)[:2], np.asarray(want)[:2], rtol=1e-5)
  # Rows 2 and 3 of every array (caches: kv_heads rows per slot) are untouched.
  for name in ("tokens", "done", "prompt_lens", "budget", "lengths"):
    assert np.array_equal(np.asarray(getattr(part, name))[2:],
                          np.asarray(getattr(before, name))[2:]), name
  heads = model.config.num_kv_heads
  for got, old in zip(part.target_cache.k + part.draft.v,
                      before.target_cache.k + before.draft.v):
    assert np.array_equal(np.asarray(got)[2 * heads:], np.asarray(old)[2 * heads:])
  assert not np.array_equal(np.asarray(part.target_cache.k[0])[:2 * heads],
                            np.asarray(before.target_cache.k[0])[:2 * heads])


class CompileCounter:
  """Programs compiled (or loaded from the persistent cache)."""

  def __init__(self):
    self.compiles = 0

  def count(self):
    self.compiles += 1


def test_long_stream_compiles_once_per_bucket_and_window(model, monkeypatch):
  """An insert compiles only for a new prompt bucket, a generate for a new window."""
  counter, calls = CompileCounter(), []

  def counted(fn, name, shape_of):
    def call(*args, **kwargs):
      before = counter.compiles
      out = fn(*args, **kwargs)
      calls.append(((name, shape_of(args, kwargs)), counter.compiles - before))
      return out
    return call

  monkeypatch.setattr(slots, "insert", counted(
      slots.insert, "insert", lambda args, kwargs: args[3].shape[1]))
  monkeypatch.setattr(slots, "generate", counted(
      slots.generate, "generate", lambda args, kwargs: kwargs["window"]))
  rng = np.random.default_rng(3)
  stream = prompts_of_lengths(rng.integers(1, 100, 24), seed=3)
  engine = Engine(model, draft_lib.derive(model, [0]), k=2, max_new_tokens=8,
                  num_slots=3, steps_per_call=3, cache_size=256)
  with compiles.counting(counter.count):
    results = engine.generate_ids(stream)
  assert all(1 <= len(r.token_ids) <= 8 for r in results)
  seen = set()
  for key, built in calls:
    assert built <= (key not in seen), (key, built)
    seen.add(key)
  assert {w for (name, w) in seen if name == "insert"} == {64, 96}
  assert len({w for (name, w) in seen if name == "generate"}) >= 2


def test_chat_needs_a_template(model):
  with pytest.raises(ValueError, match="chat template"):
    Engine(model).generate(["<5> <6>"], chat=True)


# --- the real model ---------------------------------------------------------

REAL_PROMPTS = ["The capital of France is",
                "Write a short poem about the sea and the wind at night:",
                "def fibonacci(n):"]


@pytest.mark.real_model
def test_real_greedy_continuation_is_paris(smollm2):
  [completion] = Engine(smollm2, max_new_tokens=16).generate([REAL_PROMPTS[0]])
  assert completion.text.startswith(" Paris")


@pytest.mark.real_model
def test_real_batched_generation_equals_one_by_one(smollm2):
  engine = Engine(smollm2, max_new_tokens=16)
  batched = engine.generate(REAL_PROMPTS)
  assert len({len(c.prompt_ids) for c in batched}) == len(REAL_PROMPTS)
  for c in batched:
    [alone] = engine.generate([c.prompt])
    assert c.token_ids == alone.token_ids


@pytest.mark.real_model
def test_cli_json_output(smollm2):
  """python -m experiments.generate, end to end, speculative with the derived draft."""
  prompts = REAL_PROMPTS[:2]
  command = [sys.executable, "-m", "experiments.generate", "--output=json",
             "--max_new_tokens=3", "--k=2", "--warm_start=none",
             *(f"--prompt={p}" for p in prompts)]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  assert [r["prompt"] for r in rows] == prompts
  engine = Engine(smollm2, max_new_tokens=16)  # compiled already for batch 1
  expected = [engine.generate([p])[0] for p in prompts]
  for row, target in zip(rows, expected):
    assert row["token_ids"] == target.token_ids[:3]  # greedy: draft changes nothing
    assert row["text"] == smollm2.tokenizer.decode(row["token_ids"])
    assert 0.0 <= row["alpha"] <= 1.0
    assert 0.0 <= row["acceptance_rate"] <= 1.0
    assert row["tokens_per_target_call"] >= 1.0
