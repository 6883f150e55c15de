"""The server under load on loopback: target-only, static draft and learning
draft, at a few concurrency levels.

  python -m experiments.bench_serve                       # real target, CPU sizes
  python -m experiments.bench_serve --concurrency=1,8 --requests=8 \
      --server_flags="--target=/path/to/hf_dir --draft=/path/to/draft"

Starts `experiments.serve` for the target alone, up throughout, and for
each other run in turn beside it (two at a time: a learning server holds
about 7 GB on a CPU host), each with its own draft defaults: --k=0 (the
target alone), --nolearn (the draft stays as it started) and learning on,
the last two verifying only the drafted positions that pay at the costs
the server measures at start-up (--position_costs=auto), and each call
speculating or running the target alone, whichever has been faster
(--speculate=auto; learning within --learning_payback, online_unpaid
without it); the *_always runs speculate in every call, and
static_every_position also verifies every drafted position; the *_batch_k
runs draft fewer tokens per step in larger batches. The levels start once
both servers have compiled every program (a server is ready before the
narrower windows' programs, which it compiles while serving).

Each server gets the same shifting query stream (chat endpoint, streamed,
greedy) at each load level: a closed loop of that many clients
(--concurrency), or requests arriving as a Poisson process of a given rate
whatever is in flight (--arrival_rates, open loop). A level's requests go
out in --turns slices; the run and the target-only server take turns on
each slice, in an order that rotates, so the host's drift slows them alike
(bench_serve_turns.py), and each run is compared with the target-only
server's figures from its own turns.

Reports throughput (generated tokens/s over the seconds of the server's
turns) and its ratio to the target-only server at the same level, P50/P99
time to first token and inter-token latency (per request: the time between
its first and last token over its tokens - 1), and alpha: the level's mean
over its requests and the server's rolling alpha when the level ends, the
level's updates, their seconds and share of its serve calls' time, what
speculation saved against the target alone in it, and the share of its
serve calls that ran the target alone.
"""

import asyncio
import json
import os
import shlex
import tempfile
import time

from absl import app, flags
import numpy as np
import openai

from experiments import bench_serve_table, bench_serve_turns, cli
from experiments.server_process import ServerProcess
from osd_jax.data import streams

CONCURRENCY = flags.DEFINE_list(
    "concurrency", ["1", "4", "8"], "Clients in flight (closed loop), one level each;"
    " with --arrival_rates, ignored.")
ARRIVAL_RATES = flags.DEFINE_list(
    "arrival_rates", [], "Open loop instead: requests a second, one level each,"
    " arriving as a Poisson process whatever is in flight (vLLM's"
    " benchmark_serving --request-rate).")
cli.require_positive_ints(CONCURRENCY)
REQUESTS = flags.DEFINE_integer("requests", 32, "Requests per concurrency level.")
TURNS = flags.DEFINE_integer(
    "turns", 2, "Each level's requests go out in this many slices, each served"
    " by the run's server and the target-only one in turn (the order rotating),"
    " so the host's drift over minutes slows both alike; 1: each level's"
    " requests in one go, the two servers still taking turns.")
MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens per request.")
DOMAINS = flags.DEFINE_list("domains", ["math", "sql"], "Query domains, in order.")
SLOTS = flags.DEFINE_integer("slots", 8, "Server decode slots.")
K = flags.DEFINE_integer("k", 4, "Draft tokens per step.")
CACHE_SIZE = flags.DEFINE_integer("cache_size", 256, "Positions per slot.")
UPDATE_INTERVAL = flags.DEFINE_integer("update_interval", 4, "Requests per draft update.")
BATCH_K = flags.DEFINE_string(
    "batch_k", "4:2", "The servers' --batch_k in the *_batch_k runs.")
SERVER_FLAGS = flags.DEFINE_string(
    "server_flags", "", "More flags for experiments.serve (e.g. --target, --draft).")
START_TIMEOUT = flags.DEFINE_integer("start_timeout", 900, "Seconds a server may take"
                                     " to load and compile.")
OUTPUT = flags.DEFINE_string("output", None, "Also write the results as JSON here.")


async def _request(client, question: str, record: list) -> None:
  start = time.perf_counter()
  try:
    stream = await client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS.value, temperature=0, stream=True,
        stream_options={"include_usage": True})
  except openai.BadRequestError:  # a prompt too long for --cache_size
    record.append({"refused": True})
    return
  first = last = None
  usage = None
  async for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
      last = time.perf_counter()
      first = first or last
    if chunk.usage is not None:
      usage = chunk.usage
  tokens = usage.completion_tokens
  record.append({"ttft_s": (first or time.perf_counter()) - start,
                 "itl_s": ((last - first) / (tokens - 1)) if first and tokens > 1 else 0.0,
                 "tokens": tokens, "alpha": usage.model_extra["alpha"]})


async def _requests(url: str, questions: list[str], concurrency: int,
                    rate: float = 0.0, seed: int = 0) -> tuple[list[dict], float]:
  """The questions through `concurrency` closed-loop clients, or (`rate` > 0)
  arriving as a Poisson process of that many requests a second, each sent
  when it arrives whatever is in flight: (a record per request, seconds)."""
  client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                              timeout=600)
  todo = list(reversed(questions))
  records: list[dict] = []

  async def worker():
    while todo:
      await _request(client, todo.pop(), records)

  async def arriving(question, at):
    await asyncio.sleep(at)
    await _request(client, question, records)

  start = time.perf_counter()
  if rate > 0:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(questions))
    await asyncio.gather(*(arriving(q, at) for q, at in zip(questions, np.cumsum(gaps))))
  else:
    await asyncio.gather(*(worker() for _ in range(concurrency)))
  seconds = time.perf_counter() - start
  await client.close()
  return records, seconds


# Each run's server flags: the target alone, the draft frozen, the draft
# learning (each row verifying the drafted positions that pay, at the
# costs the server measures); the frozen draft verifying every drafted
# position; and the two drafting fewer tokens in larger batches.
RUNS = {"target": ["--k=0", "--nolearn"], "static": ["--nolearn"], "online": ["--learn"],
        "online_unpaid": ["--learn", "--learning_payback=0"],
        "static_always": ["--nolearn", "--speculate=always"],
        "online_always": ["--learn", "--speculate=always"],
        "static_every_position": ["--nolearn", "--position_costs=off",
                                  "--speculate=always"],
        "static_batch_k": ["--nolearn"], "online_batch_k": ["--learn"]}
RESTART = flags.DEFINE_bool(
    "restart", True, "Also start the last run's server a second time, on the"
    " compilation cache its first start filled, and report how soon it is ready.")
RUN_NAMES = flags.DEFINE_list(
    "runs", ["target", "static", "static_always", "online"],
    f"Servers to run, in order, of {list(RUNS)}.")


def _start(name: str, workdir: str, log: str | None = None,
           compiled: bool = True) -> tuple[ServerProcess, float]:
  """A server for the run `name`, ready (and, with `compiled`, done
  compiling the programs it compiles while serving), and the seconds until
  it was ready."""
  draft = [] if name == "target" else [f"--k={K.value}"]
  draft.append(f"--batch_k={BATCH_K.value if name.endswith('_batch_k') else ''}")
  server = ServerProcess(
      ["--served_model_name=bench", f"--slots={SLOTS.value}", *draft,
       f"--cache_size={CACHE_SIZE.value}", f"--max_tokens={MAX_TOKENS.value}",
       f"--update_interval={UPDATE_INTERVAL.value}", *RUNS[name],
       f"--compilation_cache={os.path.join(workdir, 'xla')}",
       *shlex.split(SERVER_FLAGS.value)], os.path.join(workdir, log or f"server_{name}.log"))
  try:
    start = time.perf_counter()
    server.wait_ready(START_TIMEOUT.value)
    ready_s = time.perf_counter() - start
    print(f"[{name}] server ready in {ready_s:.0f} s", flush=True)
    # The levels measure serving, not serving beside the compiler.
    rest = server.wait_compiled(START_TIMEOUT.value) if compiled else None
    if rest:
      print(f"[{name}] and {rest[0]} more programs compiled while serving, in"
            f" {rest[1]:.0f} s", flush=True)
  except BaseException:
    server.stop()
    raise
  return server, ready_s


def _levels(servers: dict[str, ServerProcess], levels: list[tuple[int, float]],
            questions: list[str]) -> list[dict]:
  """Each level's figures for every server, its requests served in turns."""
  results = []
  for i, (concurrency, rate) in enumerate(levels):
    n = REQUESTS.value
    level = _level_name(concurrency, rate)
    records = {name: [] for name in servers}
    seconds = dict.fromkeys(servers, 0.0)
    deltas = {name: dict.fromkeys(bench_serve_turns.COUNTERS, 0.0) for name in servers}
    for turn, part in enumerate(bench_serve_turns.slices(questions[i * n:(i + 1) * n],
                                                          TURNS.value)):
      for name in bench_serve_turns.order(list(servers), turn):
        before = servers[name].metrics()
        got, took = asyncio.run(_requests(servers[name].url, part, concurrency, rate,
                                          seed=1000 * i + turn))
        change = bench_serve_turns.counter_deltas(before, servers[name].metrics())
        records[name] += got
        seconds[name] += took
        deltas[name] = {key: deltas[name][key] + change[key] for key in change}
    for name, server in servers.items():
      result = bench_serve_turns.figures(records[name], seconds[name], deltas[name])
      result.update(run=name, concurrency=concurrency, arrival_rate=rate, level=level,
                    rolling_alpha=server.metrics()["osd:rolling_alpha"])
      results.append(result)
      print(f"[{name}] {level}: {result['tokens_per_s']:.1f} tokens/s", flush=True)
  return results


def _level_name(concurrency: int, rate: float) -> str:
  return f"{rate:g} req/s" if rate > 0 else f"{concurrency} clients"


def main(argv):
  del argv
  try:
    rates = [float(r) for r in ARRIVAL_RATES.value]
  except ValueError as e:
    raise app.UsageError(f"--arrival_rates takes numbers: {e}") from e
  if any(not 0 < r < float("inf") for r in rates):
    raise app.UsageError(f"--arrival_rates must be positive, got {rates}.")
  if rates and CONCURRENCY.present:
    raise app.UsageError("Pass --concurrency (closed loop) or --arrival_rates"
                         " (open loop), not both.")
  if TURNS.value < 1:
    raise app.UsageError(f"--turns must be at least 1, got {TURNS.value}.")
  levels = ([(0, r) for r in rates] if rates else
            [(int(c), 0.0) for c in CONCURRENCY.value])
  total = REQUESTS.value * len(levels)
  queries = streams.make_stream("shift", DOMAINS.value, total, seed=0)
  questions = [q.prompt for q in queries]
  unknown = set(RUN_NAMES.value) - set(RUNS)
  if unknown or "target" not in RUN_NAMES.value:
    raise app.UsageError(f"--runs must include target and name only {list(RUNS)}.")
  workdir = tempfile.mkdtemp(prefix="osd_bench_serve_")
  # Two servers up at a time: the target-only one stays, each other run's
  # comes and goes (a learning server holds about 7 GB on a CPU host).
  results, ready = [], {}
  target, ready["target"] = _start("target", workdir)
  try:
    others = [n for n in RUN_NAMES.value if n != "target"]
    if not others:
      results = _levels({"target": target}, levels, questions)
    for name in others:
      server, ready[name] = _start(name, workdir)
      try:
        pair = _levels({"target": target, name: server}, levels, questions)
      finally:
        server.stop()
      results += [dict(r, beside=name) for r in pair]
  finally:
    target.stop()
  print(f"{TURNS.value} turns a level, each run taking turns with the target-only"
        f" server:")
  print(bench_serve_table.table(results))
  starts = ", ".join(f"{name} {s:.0f} s" for name, s in ready.items())
  print(f"ready after start (the runs, in order, share one compilation cache:"
        f" a new one unless --server_flags names another): {starts}")
  if RESTART.value:  # the last server again, on the programs it cached
    name = RUN_NAMES.value[-1]
    server, again = _start(name, workdir, log=f"server_{name}_again.log",
                           compiled=False)
    server.stop()
    print(f"ready after a restart of {name} (its programs cached): {again:.0f} s")
  print(f"server logs in {workdir}")
  if OUTPUT.value:
    with open(OUTPUT.value, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  cli.run(main)
