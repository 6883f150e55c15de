"""The server's start: /health while it compiles, and the compilation cache a
restart reuses."""

import dataclasses
import os
import threading

from starlette.testclient import TestClient

from experiments import compilation_cache
from experiments.server_process import ServerProcess
from osd_jax.checkpoints import loading
from osd_jax.serving import live, online
from osd_jax.serving.api.app import make_app
from osd_jax.serving.api.parse import Limits
from tests import tiny_models
from tests.test_online import MAIN, tiny_pair


def test_health_is_503_while_the_engine_compiles_then_200(monkeypatch):
  compiled = threading.Event()
  monkeypatch.setattr(live.LiveEngine, "_warm_up", lambda self: compiled.wait(60))
  target, draft = tiny_pair()
  engine = live.LiveEngine(target, draft, dataclasses.replace(MAIN, sampling=None),
                           live.LiveConfig(num_slots=2), mesh=online.make_mesh(1))
  limits = Limits(model="tiny", tokenizer=target.tokenizer,
                  vocab_size=target.config.vocab_size, problem=engine.problem,
                  default_max_tokens=engine.default_max_tokens)
  client = TestClient(make_app(engine, limits))  # no lifespan: the test stops it
  ready = threading.Event()
  engine.on_ready = ready.set
  engine.start(background=True)
  try:
    health = client.get("/health")
    assert (health.status_code, health.json()) == (503, {"status": "starting"})
    refused = client.post("/v1/completions", json={"model": "tiny", "prompt": "<5> <6>",
                                                   "max_tokens": 2})
    assert refused.status_code == 503 and "starting" in refused.json()["error"]["message"]
    compiled.set()
    assert ready.wait(60)
    health = client.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
  finally:
    compiled.set()
    engine.stop()


def test_the_cache_folder_names_the_versions_and_the_cpu(tmp_path):
  avx512 = "vendor_id\t: GenuineIntel\nmodel name\t: Xeon\nflags\t\t: sse avx512f amx_tile\n"
  # The clock and the other processors' entries do not matter; the flags do.
  (tmp_path / "a").write_text(avx512 + "cpu MHz\t\t: 3000\n\nprocessor\t: 1\n")
  (tmp_path / "b").write_text(avx512.replace(" avx512f amx_tile", " avx2"))
  (tmp_path / "c").write_text(avx512 + "cpu MHz\t\t: 800\n")
  digest = lambda name: compilation_cache.cpu_digest(str(tmp_path / name))
  assert digest("a") == digest("c") != digest("b")
  key = compilation_cache.host_key()
  import jax  # pylint: disable=import-outside-toplevel
  assert f"jax-{jax.__version__}" in key and compilation_cache.cpu_digest() in key


def test_an_explicit_flag_wins_and_an_empty_one_turns_the_cache_off(tmp_path):
  env = {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}
  directory = compilation_cache.directory
  assert directory(compilation_cache.DEFAULT_ROOT, True, env) == "/elsewhere"
  assert directory(str(tmp_path), False, env) == os.path.join(
      str(tmp_path), compilation_cache.host_key())
  assert directory("", False, env) is None
  default = directory(compilation_cache.DEFAULT_ROOT, True, {})
  assert default.startswith(os.path.expanduser("~/.cache/osd_jax/xla/jax-"))


def _entries(folder) -> set[str]:
  return {p.name for p in folder.rglob("*") if p.is_file()
          and not p.name.endswith("-atime")} if folder.exists() else set()


def test_a_restart_loads_every_program_from_the_default_cache(tmp_path):
  target = tmp_path / "target"
  loading.save_hf(tiny_models.pair()[0], str(target))
  flags = [f"--target={target}", "--k=0", "--nolearn", "--cache_size=64",
           "--max_tokens=16", "--slots=1", "--devices=1", "--served_model_name=tiny"]
  # A home of its own, no suite-wide cache, and every program kept however fast.
  env = lambda home: {"HOME": str(home), "JAX_COMPILATION_CACHE_DIR": None,
                      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  cache = tmp_path / "home" / ".cache" / "osd_jax" / "xla"
  seen = []
  for run, (home, extra) in enumerate([("home", []), ("home", []),
                                       ("other", ["--compilation_cache="])]):
    server = ServerProcess(flags + extra, str(tmp_path / f"server{run}.log"),
                           env=env(tmp_path / home))
    try:
      server.wait_ready(300)
    finally:
      assert server.stop() == 0, server.log()
    seen.append(_entries(cache))
  first, second, _ = seen
  assert first and [p.name for p in cache.iterdir()] == [compilation_cache.host_key()]
  assert second == first  # nothing compiled anew: every program was loaded
  assert not (tmp_path / "other" / ".cache" / "osd_jax").exists()

