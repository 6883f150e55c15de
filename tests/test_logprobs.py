"""logprobs and top_logprobs: the target's own log-probs of what was emitted.

One live engine on the tiny pair serves every test here (compiles dominate
on CPU): its log-probs are checked against a plain teacher-forced forward of
the target, then through the HTTP layer with the openai client.
"""

import dataclasses
import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from osd_jax.decoding import speculative
from osd_jax.decoding.drafts import Draft, ModelDraft
from osd_jax.models import llama
from osd_jax.serving import live, online
from osd_jax.serving.api.app import make_app
from osd_jax.serving.api.logprobs import LogprobStream
from osd_jax.serving.api.parse import Limits, parse
from osd_jax.serving.api.text import TextStream
from osd_jax.serving.api.wire import ApiError
from osd_jax.serving.live_request import (Failed, Finished, LiveRequest, RequestParams,
                                          TokenLogprob)
from tests import tiny_models

MAX_LOGPROBS = 5
MAX_TOKENS = 12
CFG = online.OnlineConfig(k=3, sampling=None, max_new_tokens=16, cache_size=64,
                          steps_per_call=2, learn=False, trim_verify=True,
                          max_logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def engine():
  target, draft = tiny_models.pair()
  engine = live.LiveEngine(
      target, Draft(ModelDraft(draft.config), draft.params, draft.source), CFG,
      live.LiveConfig(num_slots=4), mesh=online.make_mesh(1))
  engine.start(warm_up=False)
  try:
    yield engine
  finally:
    engine.stop()


def _serve(engine, prompts, params):
  """Every prompt as one request, all in flight together; per request its
  (ids, TokenLogprobs, stats)."""
  results = [([], [], None) for _ in prompts]
  done = threading.Semaphore(0)

  def listener(i):
    def on_event(event):
      ids, logprobs, _ = results[i]
      if isinstance(event, Failed):
        raise AssertionError(event.message)
      if isinstance(event, Finished):
        results[i] = (ids, logprobs, event.stats)
        done.release()
      else:
        ids.extend(event.ids)
        logprobs.extend(event.logprobs)
    return on_event

  for i, prompt in enumerate(prompts):
    engine.submit(LiveRequest(prompt, params, listener(i)))
  for _ in prompts:
    assert done.acquire(timeout=300)
  return results


def _teacher_forced(target, prompt, output):
  """log_softmax of one uncached target pass over prompt + output, at the
  positions that predicted each output token: [len(output), V]."""
  tokens = jnp.asarray([list(prompt) + list(output)], jnp.int32)
  logits, _ = llama.apply(target.params, target.config, tokens)
  return np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1:-1], axis=-1))


def _assert_exact(target, prompt, ids, logprobs, top_n):
  reference = _teacher_forced(target, prompt, ids)
  assert len(logprobs) == len(ids)
  got = np.array([lp.logprob for lp in logprobs])
  want = reference[np.arange(len(ids)), ids]
  np.testing.assert_allclose(got, want, atol=1e-4)
  top_values, top_ids = jax.lax.top_k(reference, top_n)
  got_ids = np.array([[t for t, _ in lp.top] for lp in logprobs])
  got_values = np.array([[v for _, v in lp.top] for lp in logprobs])
  assert got_ids.shape == (len(ids), top_n)
  np.testing.assert_allclose(got_values, top_values, atol=1e-4)
  # Ids agree wherever the ranking is not a near tie.
  gaps = np.abs(np.diff(np.asarray(top_values), axis=1))
  clear = np.ones_like(got_ids, bool)
  clear[:, :-1] &= gaps > 1e-3
  clear[:, 1:] &= gaps > 1e-3
  np.testing.assert_array_equal(got_ids[clear], np.asarray(top_ids)[clear])


PROMPTS = [[1] + list(np.random.default_rng(i).integers(5, tiny_models.VOCAB, n))
           for i, n in enumerate((4, 9, 15, 6))]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_logprobs_equal_a_teacher_forced_target_pass(engine, temperature):
  params = RequestParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=3,
                         logprobs=3)
  results = _serve(engine, PROMPTS, params)
  proposed = accepted = 0
  for prompt, (ids, logprobs, stats) in zip(PROMPTS, results):
    assert len(ids) == stats.completion_tokens
    _assert_exact(engine.target, prompt, ids, logprobs, 3)
    if temperature == 0.0:  # the emitted token is the target's first choice
      assert [lp.top[0][0] for lp in logprobs] == ids
    proposed += stats.num_draft_tokens
    accepted += stats.num_accepted_tokens
  # Drafts were accepted and rejected: the log-probs come from every kind of
  # verified position (accepted drafts, corrections and bonus tokens).
  assert 0 < accepted < proposed


# The HTTP layer, through the openai client ------------------------------


@pytest.fixture(scope="module")
def http(engine):
  target = engine.target
  limits = Limits(model="tiny", tokenizer=target.tokenizer,
                  vocab_size=target.config.vocab_size, problem=engine.problem,
                  default_max_tokens=engine.default_max_tokens, max_n=4,
                  max_logprobs=MAX_LOGPROBS)
  # No lifespan (no `with`): the engine fixture stops the engine.
  return TestClient(make_app(engine, limits))


@pytest.fixture(scope="module")
def client(http):
  return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="none",
                       http_client=http, max_retries=0)


PROMPT = "w5 w9 w17 w33 w8"


def _ids(engine, text: str) -> list[int]:
  """Output text back to ids: the tiny tokenizer's words are its tokens."""
  return engine.target.tokenizer(text)["input_ids"]


def test_completions_logprobs_streamed_and_whole(engine, client):
  whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0, logprobs=3)
  choice = whole.choices[0]
  lp = choice.logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
      len(lp.text_offset) == whole.usage.completion_tokens == MAX_TOKENS
  assert "".join(lp.tokens) == choice.text
  assert all(choice.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
  # Greedy: the emitted token is the first choice, so the top 3 hold it.
  for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    assert len(top) == 3 and top[token] == logprob == max(top.values())
  prompt = _ids(engine, PROMPT)
  reference = _teacher_forced(engine.target, prompt, _ids(engine, choice.text))
  np.testing.assert_allclose(lp.token_logprobs, reference.max(axis=1), atol=1e-4)

  chunks = list(client.completions.create(
      model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3,
      stream=True))
  streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
  assert sum(1 for s in streamed if s.tokens) >= 2  # token groups, each its own
  for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
    assert sum((getattr(s, name) for s in streamed), []) == getattr(lp, name), name
  for c in chunks:  # a chunk carries the log-probs of its own text
    if c.choices[0].logprobs:
      assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text


def test_completions_logprobs_0_is_the_emitted_token_alone(client):
  sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                      temperature=1.0, seed=5, logprobs=0)
  lp = sampled.choices[0].logprobs
  assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
  assert len(lp.tokens) == sampled.usage.completion_tokens


def test_chat_logprobs_with_n_choices_streamed_and_whole(engine, client):
  messages = [{"role": "user", "content": PROMPT}]
  whole = client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, seed=9,
      n=2, logprobs=True, top_logprobs=2)
  prompt = engine.target.tokenizer.apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True, return_dict=False)
  counted = 0
  for choice in whole.choices:
    content = choice.logprobs.content
    counted += len(content)
    if choice.finish_reason == "stop":  # the EOS has an entry, and no text
      content = content[:-1]
    assert "".join(e.token for e in content) == choice.message.content
    for e in content:
      assert len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode())
      assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    ids = _ids(engine, choice.message.content)
    reference = _teacher_forced(engine.target, prompt, ids)
    np.testing.assert_allclose([e.logprob for e in content],
                               reference[np.arange(len(ids)), ids], atol=1e-4)
  assert counted == whole.usage.completion_tokens

  chunks = list(client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, seed=9,
      n=2, logprobs=True, top_logprobs=2, stream=True))
  streamed = [[], []]
  for c in chunks:
    for choice in c.choices:
      if choice.logprobs:
        streamed[choice.index] += choice.logprobs.content
  assert [[e.token for e in s] for s in streamed] == \
      [[e.token for e in c.logprobs.content] for c in whole.choices]


def test_a_stop_string_keeps_the_log_probs_of_the_tokens_used(client):
  full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                   temperature=0, logprobs=1)
  words = full.choices[0].text.split()
  stop = words[3]
  used = next(n for n in range(1, len(words) + 1) if stop in " ".join(words[:n]))
  cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=1, stop=[stop])
  lp = cut.choices[0].logprobs
  # Through the token that completed the stop string, as usage counts them;
  # the engine made more before the cancel reached it.
  assert len(lp.tokens) == cut.usage.completion_tokens == used
  assert lp.tokens == full.choices[0].logprobs.tokens[:used]
  streamed = [c.choices[0].logprobs for c in client.completions.create(
      model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
      stop=[stop], stream=True) if c.choices[0].logprobs]
  assert sum((s.tokens for s in streamed), []) == lp.tokens


BAD = [
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs with logprobs false", "/v1/chat/completions",
     {"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    ("top_logprobs above the server's max", "/v1/chat/completions",
     {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("top_logprobs above OpenAI's 20", "/v1/chat/completions",
     {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat logprobs an integer", "/v1/chat/completions", {"logprobs": 2}, "logprobs"),
    ("top_logprobs a string", "/v1/chat/completions",
     {"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ("completions logprobs above 5", "/v1/completions", {"logprobs": 6}, "logprobs"),
    ("completions logprobs negative", "/v1/completions", {"logprobs": -1}, "logprobs"),
    ("completions logprobs true", "/v1/completions", {"logprobs": True}, "logprobs"),
    ("completions logprobs a string", "/v1/completions", {"logprobs": "3"}, "logprobs"),
    ("top_logprobs on completions", "/v1/completions", {"top_logprobs": 2},
     "top_logprobs"),
    ("echo", "/v1/completions", {"logprobs": 1, "echo": True}, "echo"),
]


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_logprobs_requests_are_400s_naming_the_field(http, name, path, body,
                                                         param):
  del name
  body = dict(body, model="tiny", max_tokens=2)
  body.update({"messages": [{"role": "user", "content": PROMPT}]}
              if "chat" in path else {"prompt": PROMPT})
  response = http.post(path, json=body)
  assert response.status_code == 400
  assert response.json()["error"]["param"] == param


def test_a_server_without_logprobs_refuses_them(engine):
  limits = Limits(model="tiny", tokenizer=engine.target.tokenizer,
                  vocab_size=engine.target.config.vocab_size, problem=lambda *_: None,
                  default_max_tokens=lambda _: 4)
  body = json.dumps({"prompt": PROMPT, "logprobs": 0}).encode()
  with pytest.raises(ApiError, match="keeps no log-probs") as refused:
    parse(body, limits, chat=False)
  assert refused.value.param == "logprobs"
  chat = json.dumps({"messages": [{"role": "user", "content": PROMPT}],
                     "logprobs": False}).encode()
  assert parse(chat, limits, chat=True).params.logprobs is None


# Held-back text holds its tokens back -------------------------------------


def test_entries_wait_for_the_text_a_stop_string_might_take():
  tokenizer = tiny_models.tokenizer()
  text = TextStream(tokenizer, eos_id=2, stops=("w7 w9",))
  stream = LogprobStream(tokenizer, text)
  fake = lambda ids: [TokenLogprob(-1.0, ((i, -1.0),)) for i in ids]

  def add(ids):
    stream.add(ids, fake(ids))
    delta = text.add(ids)
    return delta, [e.token for e in stream.take()]

  assert add([5, 6, 7]) == ("w5 w6 ", ["w5", " w6"])  # "w7" may start the stop
  assert add([8]) == ("w7 w8", [" w7", " w8"])
  stream.add([2], fake([2]))
  assert text.add([2]) == "" and [e.token for e in stream.take()] == [" </s>"]


# The feature off ------------------------------------------------------------


def test_the_feature_off_adds_no_state_and_no_compute():
  target, draft = tiny_models.pair()
  drafter = ModelDraft(draft.config)
  served = online.init_state(draft.params, drafter, target.config,
                             dataclasses.replace(CFG, max_logprobs=None),
                             num_devices=1, num_slots=2, seed=0)
  assert served.slots.logprobs is None  # the main job's OnlineConfig default
  target_params = llama.for_decoding(target.params, target.config)
  draft_params = drafter.prepare(draft.params, target_params)
  state = lambda n: speculative.empty_state(target.config, drafter, batch_size=2,
                                            cache_size=32, k=2, max_logprobs=n)
  off, on = state(None), state(3)
  assert on.logprobs.top_ids.shape == (2, 32, 3)
  assert len(jax.tree.leaves(on)) == len(jax.tree.leaves(off)) + 4

  def step(s):
    return speculative.speculate_and_verify(
        target_params, draft_params, s, target_config=target.config,
        drafter=drafter, k=2, sampling=None)[0]

  ops = lambda s: str(jax.make_jaxpr(step)(s))
  assert "top_k" not in ops(off) and "log_softmax" not in ops(off)
  assert "top_k" in ops(on)


def serve_flags_printing(expression: str):
  """A runner of experiments.serve's flags in a fresh process: run(*argv)
  parses argv and prints `expression` (over serve_flags)."""
  script = ("import sys; from absl import flags; from experiments import serve_flags;"
            " flags.FLAGS(['serve'] + sys.argv[1:]);"
            f" print({expression})")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return lambda *argv: subprocess.run([sys.executable, "-c", script, *argv], cwd=root,
                                      capture_output=True, text=True, check=False)


def test_the_server_flag_sets_the_slots_width():
  """--max_logprobs is OnlineConfig.max_logprobs (the slots' top N and the
  limit experiments.serve gives the API); beyond OpenAI's 20 it is refused."""
  run = serve_flags_printing("serve_flags.online_config().max_logprobs")
  assert run("--max_logprobs=3").stdout.split() == ["3"]
  assert run().stdout.split() == ["20"]
  refused = run("--max_logprobs=21")
  assert refused.returncode != 0 and "max_logprobs" in refused.stderr
