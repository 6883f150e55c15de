"""How soon the server answers /health 200: a first start on an empty
compilation cache, then a restart on the cache it filled (issue 46's goals:
5 minutes and 60 s on a 2-core CPU).

  python -m experiments.bench_start                       # the README's defaults
  python -m experiments.bench_start --server_flags="--cache_size=512 --slots=4"

Each start runs `experiments.serve` with the given flags and its own empty
cache folder (a new user's first start: the verification cost table is
timed too). The server is stopped once its programs are all compiled: the
ones it compiles while serving too, whose time it reports.
"""

import os
import shlex
import tempfile
import time

from absl import flags

from experiments import cli
from experiments.server_process import ServerProcess

SERVER_FLAGS = flags.DEFINE_string("server_flags", "", "Flags for experiments.serve.")
TIMEOUT = flags.DEFINE_integer("timeout", 1800, "Seconds a start may take.")
FIRST_GOAL_S, SECOND_GOAL_S = 300, 60


def _start(flags_: list[str], log: str) -> tuple[float, str]:
  """(Seconds until /health answered 200, what the server compiled while
  serving after that.)"""
  server = ServerProcess(flags_, log)
  try:
    start = time.perf_counter()
    server.wait_ready(TIMEOUT.value)
    ready_s = time.perf_counter() - start
    rest = server.wait_compiled(TIMEOUT.value)
    return ready_s, (f"then {rest[0]} more programs in {rest[1]:.0f} s while serving"
                     if rest else "no programs compiled while serving")
  finally:
    server.stop(timeout=300)


def main(argv):
  del argv
  with tempfile.TemporaryDirectory(prefix="bench_start_") as workdir:
    flags_ = [f"--compilation_cache={os.path.join(workdir, 'xla')}",
              "--served_model_name=bench", *shlex.split(SERVER_FLAGS.value)]
    print(f"experiments.serve {' '.join(flags_)}", flush=True)
    first, first_rest = _start(flags_, os.path.join(workdir, "first.log"))
    print(f"first start: ready in {first:.0f} s ({first_rest})", flush=True)
    second, second_rest = _start(flags_, os.path.join(workdir, "second.log"))
    print(f"second start: ready in {second:.0f} s ({second_rest})", flush=True)
  print(f"first start {first:.0f} s = {first / FIRST_GOAL_S:.2f}x the {FIRST_GOAL_S} s"
        f" goal; second {second:.0f} s = {second / SECOND_GOAL_S:.2f}x the"
        f" {SECOND_GOAL_S} s goal; second / first {second / first:.2f}")


if __name__ == "__main__":
  cli.run(main)
