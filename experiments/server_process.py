"""`python -m experiments.serve` in a child process on a loopback port (tests, benchmarks)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What serving/live.py says as it becomes ready, and once it has compiled
# the rest of its programs.
_COMPILING_WHILE_SERVING = "compile while serving"
_COMPILED_WHILE_SERVING = re.compile(
    r"compiled the other (\d+) programs while serving, in (\d+) s")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def free_port() -> int:
  """A loopback port nobody listens on right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
  """Prometheus text to {name or name{labels}: value}."""
  out = {}
  for line in text.splitlines():
    match = _SAMPLE.match(line.strip())
    if match and not line.startswith("#"):
      out[match.group(1)] = float(match.group(2))
  return out


class ServerProcess:
  """A server child process; its output goes to `log_path`."""

  def __init__(self, flags: list[str], log_path: str, port: int | None = None,
               env: dict[str, str | None] | None = None):
    """`env` adds to (or, with None, removes from) this process's environment."""
    self.port = port or free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log_path = log_path
    env = {key: value for key, value in {**os.environ, **(env or {})}.items()
           if value is not None}
    env["PYTHONPATH"] = _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    with open(log_path, "w") as log:
      self.process = subprocess.Popen(
          [sys.executable, "-m", "experiments.serve", "--host=127.0.0.1",
           f"--port={self.port}", *flags],
          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          cwd=_REPO, env=env)

  def log(self) -> str:
    with open(self.log_path) as f:
      return f.read()

  def wait_ready(self, timeout: float) -> None:
    """Until /health answers 200; raises with the server's log if it dies or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
      try:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
          if r.status == 200:
            return
      except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
      time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

  def wait_compiled(self, timeout: float) -> tuple[int, float] | None:
    """After wait_ready: until the programs the server compiles while it
    serves are compiled (the narrower windows'); (how many, their seconds)
    as it reports them, or None where it compiled none that way."""
    deadline = time.monotonic() + timeout
    while _COMPILING_WHILE_SERVING in self.log():
      found = _COMPILED_WHILE_SERVING.search(self.log())
      if found:
        return int(found.group(1)), float(found.group(2))
      if self.process.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"server compiling while serving exited or took over"
                           f" {timeout} s:\n{self.log()}")
      time.sleep(0.5)
    return None

  def get(self, path: str) -> str:
    with urllib.request.urlopen(self.url + path, timeout=30) as r:
      return r.read().decode()

  def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
    """(status, JSON body) of a POST, error statuses included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(request, timeout=60) as r:
        return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
      return e.code, json.loads(e.read())

  def metrics(self) -> dict[str, float]:
    return parse_metrics(self.get("/metrics"))

  def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    """Sends `sig`, waits for the exit (kills it past the timeout); the exit status."""
    if self.process.poll() is None:
      self.process.send_signal(sig)
      try:
        self.process.wait(timeout)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    return self.process.returncode
