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
