"""An OpenAI-compatible server whose draft learns from the traffic it serves.

  python -m experiments.serve --port=8000
  python -m experiments.serve --checkpoint_dir=outputs/serve/ckpt \
      --export_dir=outputs/serve/drafts
  python -m experiments.serve --checkpoint_dir=outputs/serve/ckpt --resume
  python -m experiments.serve --nolearn          # the draft stays as it is

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health (503
while the programs compile, then 200), /metrics and POST /v1/draft/export. SIGTERM or SIGINT lets in-flight
requests finish (up to --drain_s), then checkpoints and exits. See the
README's "Serving" section.
"""

import dataclasses
import signal
import socket

from absl import app, flags
import jax
import uvicorn

from experiments import (cli, compilation_cache, learning_flags, model_flags,
                         serve_flags as sf, step_flags)
from osd_jax.decoding.drafts import Draft, NoDraft
from osd_jax.serving import online
from osd_jax.serving.api.app import make_app
from osd_jax.serving.api.parse import Limits
from osd_jax.serving.checkpoint import Checkpointer
from osd_jax.serving.live import LiveEngine

model_flags.serve_with_the_best_draft()
learning_flags.learn_with_replay()
# Every stream in flight waits for an update's steps: one a call, not four
# (issue 46), and updates may take at most 15 % of the serve calls' time.
flags.set_default(learning_flags.UPDATE_STEPS_PER_CALL, 1)
flags.set_default(learning_flags.LEARNING_BUDGET, 0.15)


class _Server(uvicorn.Server):
  """uvicorn, telling the engine to take no new requests when a signal comes."""

  def __init__(self, config: uvicorn.Config, engine: LiveEngine):
    super().__init__(config)
    self.engine = engine

  def handle_exit(self, sig, frame) -> None:
    self.engine.drain()
    super().handle_exit(sig, frame)


def _listening_socket(host: str, port: int) -> socket.socket:
  """Bound before the long start-up, so a taken port fails at once."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except (OSError, OverflowError) as e:  # taken, not ours, or not a port
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    raise app.UsageError(f"Cannot listen on {host}:{port}: {reason.rstrip('.')}.") from e
  return sock


def main(argv):
  del argv
  compilation_cache.enable_from_flag()
  if sf.RESUME.value and not sf.CHECKPOINT_DIR.value:
    raise app.UsageError("--resume needs --checkpoint_dir.")
  sock = _listening_socket(sf.HOST.value, sf.PORT.value)
  if sf.K.value == 0 and sf.LEARN.value:
    raise app.UsageError("--k=0 serves the target alone, with no draft to learn:"
                         " pass --nolearn.")
  target = model_flags.load_target()
  if sf.K.value == 0:  # the same engine with nothing drafted: the baseline
    draft = Draft(NoDraft(target.config.vocab_size), (), "none")
  else:
    draft = model_flags.load_draft(target)
  if sf.LEARN.value and draft.params == ():
    raise app.UsageError(f"--draft={model_flags.DRAFT.value} has nothing to learn:"
                         " pass --nolearn.")
  mesh = online.make_mesh(cli.device_count(sf.DEVICES.value))
  live = sf.live_config()
  cfg = step_flags.with_position_costs(sf.online_config(), target,
                                       live.num_slots // mesh.size)
  # The warm start's training programs and the cost timing's are not served:
  # dropped, their memory mappings leave room for the serving programs
  # (LiveEngine's plan).
  jax.clear_caches()
  checkpointer = None
  if sf.CHECKPOINT_DIR.value:
    # What a resumed server must share with its checkpoint; learning and the
    # host's measured costs may differ.
    run_config = {"online": {k: v for k, v in dataclasses.asdict(cfg).items()
                             if k not in ("learn", "position_costs")},
                  "target": target.source, "draft": draft.source,
                  "slots": live.num_slots, "devices": mesh.size}
    checkpointer = Checkpointer(sf.CHECKPOINT_DIR.value, run_config,
                                resume=sf.RESUME.value)
  engine = LiveEngine(target, draft, cfg, live, mesh=mesh, checkpointer=checkpointer)
  if engine.resumed_from is not None:
    print(f"resumed from checkpoint {engine.resumed_from}", flush=True)
  name = sf.MODEL_NAME.value or model_flags.TARGET.value
  limits = Limits(model=name, tokenizer=target.tokenizer,
                  vocab_size=target.config.vocab_size, problem=engine.problem,
                  default_max_tokens=engine.default_max_tokens,
                  temperature=sf.TEMPERATURE.value, top_p=sf.TOP_P.value,
                  top_k=sf.TOP_K.value, max_n=live.num_slots,
                  max_logprobs=cfg.max_logprobs)
  server = _Server(uvicorn.Config(make_app(engine, limits), log_level="warning",
                                  access_log=False,
                                  timeout_graceful_shutdown=sf.DRAIN_S.value), engine)
  engine.on_failure = lambda message: setattr(server, "should_exit", True)
  url = f"http://{sf.HOST.value}:{sf.PORT.value}"
  engine.on_ready = lambda: print(
      f"serving {name} at {url}/v1 with {live.num_slots} slots, k={cfg.k},"
      f" learning {'on' if cfg.learn else 'off'}; draft {draft.source}", flush=True)
  # The listener answers while the engine compiles: /health says 503 until then.
  engine.start(warm_up=sf.WARM_UP.value, background=True)
  print(f"listening at {url}; compiling ({url}/health answers 200 when ready)",
        flush=True)
  # uvicorn re-raises the signal it handled once it has shut down; with these
  # the process then ends normally, after the engine's checkpoint.
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: None)
  server.run(sockets=[sock])
  engine.stop()  # already stopped by the app's shutdown, unless it never started
  if checkpointer is not None:
    checkpointer.close()
    print(f"checkpoints in {checkpointer.directory}", flush=True)
  if engine.failure:
    raise SystemExit(f"error: {engine.failure}")


if __name__ == "__main__":
  cli.run(main)
