"""The OpenAI-compatible server, driven through the official openai client on loopback.

Compiles dominate on CPU, so one tiny-pair server serves the whole module;
the last test stops it with SIGTERM under load and resumes it (a persistent
compilation cache makes the restart cheap). Greedy answers are checked
against the Engine's target-only decoding, which experiments.generate runs.
"""

import asyncio
import signal
import time

import numpy as np
import openai
import pytest
from safetensors.numpy import load_file

from experiments.server_process import ServerProcess
from osd_jax.checkpoints import loading
from osd_jax.checkpoints import tokenizer as tokenizers
from osd_jax.decoding.engine import Engine
from tests import tiny_models

MAX_TOKENS = 12
# The server's own draft and learning defaults (hybrid, confidence stop,
# replay one step a call) stay on, but for the warm start, a distillation on
# chat text for real targets, and the learning budget: a tiny model's update
# costs many of its serve calls, and the tests count updates.
TINY_FLAGS = ["--warm_start=none", "--k=2", "--cache_size=64", "--max_tokens=16", "--steps_per_call=4",
              "--slots=8", "--devices=2", "--update_interval=4", "--buffer_capacity=8",
              "--learning_budget=0", "--checkpoint_every=0", "--drain_s=30",
              # Every call speculates: the counts tests read do not depend on
              # the clock (tests/test_call_choice.py covers --speculate=auto).
              "--speculate=always", "--learning_payback=0"]
NUM_LOAD = 64


def _prompts(count: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(f"w{i}" for i in rng.integers(5, tiny_models.VOCAB,
                                                 rng.integers(3, 20)))
          for _ in range(count)]


LOAD_PROMPTS = _prompts(NUM_LOAD, seed=1)
PROMPT = LOAD_PROMPTS[0]


class Served:
  """A running server, an Engine on the same target, and greedy references."""

  def __init__(self, server: ServerProcess, model: str, target, engine: Engine):
    self.server, self.model, self.target, self.engine = server, model, target, engine
    self.client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                max_retries=0, timeout=120)
    self._greedy: dict[tuple[int, ...], str] = {}

  def ids(self, prompt: str, chat: bool = False) -> list[int]:
    return tokenizers.encode(self.target.tokenizer, [prompt], chat)[0]

  def greedy(self, prompts: list[str], chat: bool = False) -> list[str]:
    """The Engine's greedy text of each prompt (all computed in one call)."""
    ids = [tuple(self.ids(p, chat)) for p in prompts]
    missing = sorted({i for i in ids if i not in self._greedy})
    if missing:
      eos = self.target.config.eos_id
      for key, result in zip(missing, self.engine.generate_ids([list(i) for i in missing])):
        out = result.token_ids[:-1] if result.token_ids[-1:] == [eos] else result.token_ids
        self._greedy[key] = self.target.tokenizer.decode(out, skip_special_tokens=False)
    return [self._greedy[i] for i in ids]

  def complete(self, prompt: str, **kwargs):
    """A completion, greedy and MAX_TOKENS long unless kwargs say otherwise."""
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}
    return self.client.completions.create(model=self.model, prompt=prompt, **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  root = tmp_path_factory.mktemp("server")
  target, draft = tiny_models.pair()
  loading.save_hf(target, str(root / "target"))
  loading.save_hf(draft, str(root / "draft"))
  flags = [f"--target={root / 'target'}", f"--draft={root / 'draft'}", *TINY_FLAGS,
           f"--checkpoint_dir={root / 'ckpt'}", f"--export_dir={root / 'export'}",
           f"--compilation_cache={root / 'xla'}", "--served_model_name=tiny"]
  server = ServerProcess(flags, str(root / "server.log"))
  try:
    loaded = loading.load(str(root / "target"))
    served = Served(server, "tiny", loaded,
                    Engine(loaded, k=0, max_new_tokens=MAX_TOKENS, num_slots=8))
    served.greedy(LOAD_PROMPTS)  # compiles and decodes while the server starts
    server.wait_ready(240)
    served.flags, served.root = flags, root
    yield served
  finally:
    server.stop()


def _speculative_usage_is_sane(usage, k: int = 2) -> None:
  extra = usage.model_extra
  assert 0.0 <= extra["alpha"] <= 1.0
  assert 0.0 <= extra["acceptance_rate"] <= 1.0
  assert 0.0 <= extra["mean_accepted_length"] <= k
  # A pass checks 1..k drafted tokens: fewer after an unlikely draw.
  assert extra["num_drafts"] <= extra["num_draft_tokens"] <= k * extra["num_drafts"]
  assert sum(extra["num_accepted_tokens_per_pos"]) == extra["num_accepted_tokens"]


def test_greedy_completion_equals_the_engine(tiny):
  response = tiny.complete(PROMPT)
  assert response.choices[0].text == tiny.greedy([PROMPT])[0]
  assert response.choices[0].finish_reason == "length"
  assert response.usage.prompt_tokens == len(tiny.ids(PROMPT))
  assert response.usage.completion_tokens == MAX_TOKENS
  _speculative_usage_is_sane(response.usage)


def test_streamed_chunks_concatenate_to_the_whole_text(tiny):
  # 16 tokens take two engine calls at least (4 steps of k + 1 = 3 tokens each).
  chunks = list(tiny.complete(PROMPT, max_tokens=16, stream=True,
                              stream_options={"include_usage": True}))
  whole = tiny.complete(PROMPT, max_tokens=16)
  assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
  finish = [c.choices[0].finish_reason for c in chunks if c.choices]
  assert finish[-1] == whole.choices[0].finish_reason and not any(finish[:-1])
  assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
  assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2  # token groups


def test_chat_endpoint_applies_the_chat_template(tiny):
  messages = [{"role": "user", "content": PROMPT}]
  response = tiny.client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
  chat_ids = tiny.ids(PROMPT, chat=True)
  assert chat_ids != tiny.ids(PROMPT) and response.usage.prompt_tokens == len(chat_ids)
  assert response.choices[0].message.content == tiny.greedy([PROMPT], chat=True)[0]
  stream = tiny.client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
      stream=True)
  streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
  assert streamed == response.choices[0].message.content


def test_stop_string_cuts_the_text_and_frees_the_slot(tiny):
  full = tiny.greedy([PROMPT])[0]
  stop = full.split()[3]
  expected = full[:full.find(stop)]
  response = tiny.complete(PROMPT, stop=[stop])
  assert response.choices[0].text == expected
  assert response.choices[0].finish_reason == "stop"
  # Tokens through the one that completed the stop string, not all 12.
  assert response.usage.completion_tokens == len(expected.split()) + 1
  streamed = "".join(c.choices[0].text for c in tiny.complete(PROMPT, stop=stop,
                                                               stream=True))
  assert streamed == expected


def test_sampling_parameters_are_honoured(tiny):
  response = tiny.complete(PROMPT, temperature=0.9, top_p=0.8, seed=7,
                           extra_body={"top_k": 5})
  words = response.choices[0].text.split()
  assert 1 <= len(words) <= MAX_TOKENS
  assert all(w.startswith("w") or w.startswith("<") for w in words)


def test_models_health_and_metrics_endpoints(tiny):
  assert [m.id for m in tiny.client.models.list().data] == ["tiny"]
  assert tiny.server.get("/health") == '{"status":"ok"}'
  metrics = tiny.server.metrics()
  for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
               "vllm:spec_decode_num_accepted_tokens_total",
               'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"}',
               "osd:draft_updates_total", "osd:draft_updates_skipped_total",
               "osd:rolling_alpha", "osd:queue_depth", "osd:slots_in_use"):
    assert name in metrics, name
  assert metrics["osd:slots"] == 8


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "w5",', 400),
    ("not an object", "/v1/completions", b'["w5"]', 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "w5"}, 404),
    ("max_tokens 0", "/v1/completions", {"prompt": "w5", "max_tokens": 0}, 400),
    ("max_tokens over the limit", "/v1/completions", {"prompt": "w5", "max_tokens": 17}, 400),
    ("max_tokens beyond the context", "/v1/completions",
     {"prompt": " ".join(["w9"] * 50), "max_tokens": 16}, 400),
    ("prompt over the context", "/v1/completions", {"prompt": " ".join(["w9"] * 70)}, 400),
    ("n over the slots", "/v1/completions", {"prompt": "w5", "n": 9}, 400),
    ("n 0", "/v1/completions", {"prompt": "w5", "n": 0}, 400),
    ("n a string", "/v1/completions", {"prompt": "w5", "n": "2"}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("token id out of range", "/v1/completions", {"prompt": [5, 999]}, 400),
    ("batch of prompts", "/v1/completions", {"prompt": ["w5", "w6"]}, 400),
    ("temperature below 0", "/v1/completions", {"prompt": "w5", "temperature": -1}, 400),
    ("top_p 0", "/v1/completions", {"prompt": "w5", "top_p": 0}, 400),
    ("max_tokens a string", "/v1/completions", {"prompt": "w5", "max_tokens": "9"}, 400),
    ("logprobs above OpenAI's 5", "/v1/completions", {"prompt": "w5", "logprobs": 6}, 400),
    ("echo", "/v1/completions", {"prompt": "w5", "echo": True}, 400),
    ("five stops", "/v1/completions", {"prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("empty message content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": ""}]}, 400),
    ("unknown role", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "w5"}]}, 400),
    ("unknown route", "/v1/edits", {"prompt": "w5"}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_its_4xx_and_the_server_keeps_serving(tiny, name, path, body,
                                                               status):
  del name
  got, error = tiny.server.post(path, body)
  assert got == status
  assert set(error["error"]) >= {"message", "type", "param", "code"}
  assert error["error"]["message"]
  assert tiny.complete(PROMPT, max_tokens=2).choices[0].text.split() == \
      tiny.greedy([PROMPT])[0].split()[:2]


def test_openai_client_raises_on_bad_requests(tiny):
  with pytest.raises(openai.NotFoundError):
    tiny.client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
  with pytest.raises(openai.BadRequestError, match="n must be in"):
    tiny.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=9)


def test_n_choices_are_independent_requests_with_usage_summed(tiny):
  greedy = tiny.complete(PROMPT, n=3)
  assert [c.index for c in greedy.choices] == [0, 1, 2]
  assert [c.text for c in greedy.choices] == tiny.greedy([PROMPT]) * 3
  assert greedy.usage.prompt_tokens == len(tiny.ids(PROMPT))  # counted once
  assert greedy.usage.completion_tokens == 3 * MAX_TOKENS
  _speculative_usage_is_sane(greedy.usage)
  sampled = tiny.complete(PROMPT, n=3, temperature=1.0, max_tokens=16)
  texts = [c.text for c in sampled.choices]
  assert len(set(texts)) > 1  # 16 draws from a random model: never all alike
  tokens = sum(len(tiny.ids(t)) for t in texts)  # words are tokens here
  assert sampled.usage.completion_tokens == tokens
  chat = tiny.client.chat.completions.create(
      model="tiny", messages=[{"role": "user", "content": PROMPT}], n=2,
      max_tokens=MAX_TOKENS, temperature=0)
  assert [c.message.content for c in chat.choices] == tiny.greedy([PROMPT], chat=True) * 2


def test_n_choices_stream_by_index(tiny):
  chunks = list(tiny.complete(PROMPT, n=3, stream=True,
                              stream_options={"include_usage": True}))
  texts, finishes = ["", "", ""], [[], [], []]
  for chunk in chunks:
    for choice in chunk.choices:
      texts[choice.index] += choice.text
      if choice.finish_reason:
        finishes[choice.index].append(choice.finish_reason)
  assert texts == tiny.greedy([PROMPT]) * 3
  assert finishes == [["length"]] * 3
  assert chunks[-1].usage.completion_tokens == 3 * MAX_TOKENS


async def _load(served: Served, prompts: list[str], concurrency: int, timeout: float):
  """Every prompt once, at most `concurrency` in flight; responses or exceptions."""
  client = openai.AsyncOpenAI(base_url=served.server.url + "/v1", api_key="none",
                              max_retries=0, timeout=timeout)
  gate = asyncio.Semaphore(concurrency)

  async def one(prompt):
    async with gate:
      return await client.completions.create(model=served.model, prompt=prompt,
                                             max_tokens=MAX_TOKENS, temperature=0)

  try:
    return await asyncio.wait_for(
        asyncio.gather(*(one(p) for p in prompts), return_exceptions=True), timeout)
  finally:
    await client.close()


def test_concurrent_load_is_answered_exactly_and_counted(tiny):
  before = tiny.server.metrics()
  responses = asyncio.run(_load(tiny, LOAD_PROMPTS, NUM_LOAD, timeout=150))
  after = tiny.server.metrics()
  errors = [r for r in responses if isinstance(r, BaseException)]
  assert not errors, errors[:3]
  assert [r.choices[0].text for r in responses] == tiny.greedy(LOAD_PROMPTS)
  delta = lambda name: after[name] - before[name]
  # Learnt during the load: every 4 finished requests, but once per call when
  # more finish together (the count then restarts at 0), so at most 11 each.
  assert delta("osd:draft_updates_total") >= NUM_LOAD // 11
  assert after["osd:draft_updates_skipped_total"] == 0
  # The learning compute, beside the serving time it is a share of. Every
  # call speculates: nothing is held against plain calls.
  assert 0 < delta("osd:update_seconds_total") < delta("osd:serve_seconds_total")
  assert after["osd:speculation_saved_seconds"] == 0
  total = lambda key: sum(r.usage.model_extra[key] if key in r.usage.model_extra
                          else getattr(r.usage, key) for r in responses)
  assert delta("vllm:spec_decode_num_drafts_total") == total("num_drafts")
  assert delta("vllm:spec_decode_num_draft_tokens_total") == total("num_draft_tokens")
  assert delta("vllm:spec_decode_num_accepted_tokens_total") == total("num_accepted_tokens")
  assert delta("vllm:prompt_tokens_total") == total("prompt_tokens")
  assert delta("vllm:generation_tokens_total") == total("completion_tokens")
  for i in range(2):
    name = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'
    assert delta(name) == sum(r.usage.model_extra["num_accepted_tokens_per_pos"][i]
                              for r in responses)
  assert sum(delta(f'vllm:request_success_total{{finished_reason="{r}"}}')
             for r in ("stop", "length")) == NUM_LOAD
  assert after["osd:slots_in_use"] == 0 and after["osd:queue_depth"] == 0


def test_client_that_hangs_up_never_stalls_the_engine(tiny):
  def finished(metrics):
    return sum(metrics[f'vllm:request_success_total{{finished_reason="{r}"}}']
               for r in ("stop", "length", "abort"))

  before = finished(tiny.server.metrics())
  stream = tiny.complete(PROMPT, stream=True, max_tokens=16)
  next(iter(stream))  # the first chunk, then the client goes away
  stream.close()
  assert tiny.complete(PROMPT).choices[0].text == tiny.greedy([PROMPT])[0]
  # The engine frees the hung-up request's slot at its next turn. A request is
  # counted in the same update that frees its slot (ServerMetrics.observe), so
  # the scrape that first counts both shows no slot in use.
  deadline = time.monotonic() + 10
  after = tiny.server.metrics()
  while finished(after) < before + 2 and time.monotonic() < deadline:
    time.sleep(0.1)
    after = tiny.server.metrics()
  assert finished(after) == before + 2 and after["osd:slots_in_use"] == 0


async def _streams_cut_by_sigterm(served: Served, prompts: list[str]):
  """Streams every prompt, SIGTERM once tokens flow: (texts or exceptions, in flight)."""
  client = openai.AsyncOpenAI(base_url=served.server.url + "/v1", api_key="none",
                              max_retries=0, timeout=60)
  flowing = asyncio.Event()

  async def one(prompt):
    stream = await client.completions.create(model=served.model, prompt=prompt,
                                             max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True)
    parts = []
    async for chunk in stream:
      if chunk.choices and chunk.choices[0].text:
        parts.append(chunk.choices[0].text)
        flowing.set()
    return "".join(parts)

  tasks = [asyncio.create_task(one(p)) for p in prompts]
  await asyncio.wait_for(flowing.wait(), 60)
  served.server.process.send_signal(signal.SIGTERM)
  in_flight = sum(not t.done() for t in tasks)
  try:
    return (await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90),
            in_flight)
  finally:
    await client.close()


def test_sigterm_during_load_checkpoints_and_resume_keeps_the_draft(tiny):
  prompts = _prompts(24, seed=2)
  expected = tiny.greedy(prompts)
  results, in_flight = asyncio.run(_streams_cut_by_sigterm(tiny, prompts))
  assert in_flight > 0
  for result, want in zip(results, expected):
    if isinstance(result, BaseException):
      assert isinstance(result, openai.APIError), repr(result)  # a clean error
    else:
      assert result == want
  assert any(isinstance(r, str) for r in results)
  assert tiny.server.stop(timeout=60) == 0, tiny.server.log()
  log = tiny.server.log()
  exported = log.split("draft exported to ")[1].split()[0]
  updates = int(exported.rsplit("updates-", 1)[1])
  assert updates > 0
  assert any(p.name.isdigit() for p in (tiny.root / "ckpt").iterdir())
  draft_at_exit = load_file(f"{exported}/model.safetensors")
  start = load_file(str(tiny.root / "draft" / "model.safetensors"))
  assert any(not np.array_equal(draft_at_exit[k], start[k]) for k in start)  # it learnt

  resumed = ServerProcess(tiny.flags + ["--resume"], str(tiny.root / "resumed.log"),
                          port=tiny.server.port)  # tiny.client's address
  try:
    resumed.wait_ready(180)
    assert "resumed from checkpoint" in resumed.log()
    status, body = resumed.post("/v1/draft/export", {"name": "resumed"})
    assert status == 200, body
    draft_now = load_file(f"{body['path']}/model.safetensors")
    assert draft_now.keys() == draft_at_exit.keys()
    for key, value in draft_at_exit.items():
      assert np.array_equal(draft_now[key], value), key  # bit-equal
    assert resumed.metrics()["osd:draft_updates_total"] == updates
    assert tiny.complete(PROMPT).choices[0].text == tiny.greedy([PROMPT])[0]
  finally:
    assert resumed.stop() == 0


def test_target_only_server_answers_as_the_engine(tiny, tmp_path):
  """--k=0 serves the target alone (the benchmark's baseline): the same greedy
  text, and no drafts in the usage. It needs --nolearn, in one line."""
  target = [f for f in tiny.flags if f.startswith("--target=")]
  refused = ServerProcess([*target, "--k=0"], str(tmp_path / "refused.log"))
  assert refused.process.wait(120) != 0
  assert "--k=0 serves the target alone" in refused.log()
  rest = [f for f in TINY_FLAGS if not f.startswith("--k=")]
  server = ServerProcess([*target, *rest, "--k=0", "--nolearn",
                          "--served_model_name=tiny",
                          f"--compilation_cache={tiny.root / 'xla'}"],
                         str(tmp_path / "server.log"))
  try:
    server.wait_ready(240)
    served = Served(server, "tiny", tiny.target, tiny.engine)
    response = served.complete(PROMPT)
    assert response.choices[0].text == tiny.greedy([PROMPT])[0]
    assert response.usage.model_extra["num_drafts"] == 0
    assert "draft none" in server.log()
  finally:
    assert server.stop() == 0


def test_programs_past_the_map_limit_are_refused_in_one_line(tmp_path):
  """With a host limit (a stand-in for /proc/sys/vm/max_map_count) that not
  even one program fits, the server says so and what to change, before it
  compiles anything."""
  target, draft = tiny_models.pair()
  loading.save_hf(target, str(tmp_path / "target"))
  loading.save_hf(draft, str(tmp_path / "draft"))
  (tmp_path / "max_map_count").write_text("3000\n")
  server = ServerProcess([f"--target={tmp_path / 'target'}",
                          f"--draft={tmp_path / 'draft'}", *TINY_FLAGS],
                         str(tmp_path / "server.log"),
                         env={"OSD_JAX_MAX_MAP_COUNT_PATH": str(tmp_path / "max_map_count")})
  assert server.process.wait(120) == 1
  log = server.log()
  errors = [line for line in log.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "Traceback" not in log, log
  assert "vm.max_map_count = 3,000" in errors[0] and "--cache_size" in errors[0]
  assert "compiling" not in log


@pytest.fixture(scope="module")
def smollm2_server(smollm2, tmp_path_factory):
  root = tmp_path_factory.mktemp("real_server")
  # No lookup in served requests, and no gate (its means outlive requests):
  # the seeded sample below must see the same proposals twice.
  flags = ["--nolearn", "--ngram_history=0", "--hybrid_draft_cost=0",
           "--warm_start=none", "--k=2",
           "--cache_size=64", "--max_tokens=16",
           "--steps_per_call=2", "--slots=2", "--devices=1", "--served_model_name=smollm2"]
  server = ServerProcess(flags, str(root / "server.log"))
  try:
    served = Served(server, "smollm2", smollm2,
                    Engine(smollm2, k=0, max_new_tokens=16, num_slots=2))
    served.greedy(["The capital of France is"])
    served.greedy(["What is the capital of France?"], chat=True)
    server.wait_ready(300)
    yield served
  finally:
    # Killed: a stop would wait for the program it is compiling while serving
    # (30 s of the real model's); the SIGTERM test stops the tiny one gracefully.
    server.stop(signal.SIGKILL)


@pytest.mark.real_model
def test_real_model_server_matches_generate(smollm2_server):
  served, prompt, question = smollm2_server, "The capital of France is", \
      "What is the capital of France?"
  whole = served.client.completions.create(model="smollm2", prompt=prompt, max_tokens=16,
                                           temperature=0)
  assert whole.choices[0].text == served.greedy([prompt])[0]
  _speculative_usage_is_sane(whole.usage)
  streamed = served.client.completions.create(model="smollm2", prompt=prompt,
                                              max_tokens=16, temperature=0, stream=True)
  assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
  chat = served.client.chat.completions.create(
      model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=16,
      temperature=0)
  assert chat.choices[0].message.content == served.greedy([question], chat=True)[0]
  # With the draft frozen, a seed makes a sampled answer reproducible.
  sampled = [served.client.completions.create(
      model="smollm2", prompt=prompt, max_tokens=16, temperature=0.8, seed=11)
      .choices[0].text for _ in range(2)]
  assert sampled[0] == sampled[1]
