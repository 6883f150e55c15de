"""One process of tests/test_multihost.py: a short online stream on a tiny pair.

Started by the test as a separate OS process (JAX_PLATFORMS=cpu and a fake
device count in XLA_FLAGS), either alone or as one of several processes
joined by jax.distributed through experiments.multihost_flags:

  python tests/multihost_worker.py --out_dir=D [--checkpoint_dir=C]
      [--multihost --coordinator=127.0.0.1:PORT --num_processes=2 --process_id=I]
      [--interleave]

With --checkpoint_dir the stream is served in two parts: the first 16
requests with orbax checkpoints, then a fresh run_stream that resumes from
the checkpoint and serves the rest. Without it the stream runs straight
through. --interleave orders the mesh so that the processes' devices
alternate (as a topology-aware mesh may), so that no host feeds a contiguous
block of rows. Only process 0 writes into --out_dir: the final draft params
(params.npz), the per-request records (records.json) and a Reporter's JSONL.
Every process prints a digest line of what it computed, for the test to
compare across processes.
"""

import functools
import hashlib
import json
import os
import string
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags, logging
import jax
import numpy as np
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from experiments import multihost_flags
from osd_jax.checkpoints import draft as draft_lib
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.distillation.update import DistillConfig
from osd_jax.models import config as configs
from osd_jax.models import llama
from osd_jax.serving import distributed, driver, online
from osd_jax.serving.checkpoint import Checkpointer
from osd_jax.serving.report import Reporter

OUT_DIR = flags.DEFINE_string("out_dir", None, "Where process 0 writes results.")
CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Serve in two parts with a checkpoint and resume.")
INTERLEAVE = flags.DEFINE_bool(
    "interleave", False, "Order the mesh so that processes alternate, device by"
    " device: no host owns a contiguous block of rows.")

BATCH_SIZE = 8
NUM_REQUESTS = 24
FIRST_PART = 16  # requests served before the resume (two full batches)
LONG_PROMPT = 20  # this request's prompt exceeds prompt_len: skipped
CHARS = string.ascii_lowercase + " "
CFG = online.OnlineConfig(
    k=3, max_new_tokens=8, prompt_len=16, update_interval=4, buffer_capacity=2,
    teacher_k=8, distill=DistillConfig(learning_rate=1e-2))


def tokenizer() -> transformers.PreTrainedTokenizerFast:
  """One token per character: <pad> 0, <s> 1, </s> 2, then a-z and space."""
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
  vocab.update({c: i + 3 for i, c in enumerate(CHARS)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
      eos_token="</s>", unk_token="<pad>")


def models_pair() -> tuple[LoadedModel, LoadedModel]:
  """A random 2-layer target (numpy-filled, same on every host) and a 1-layer draft."""
  config = configs.tiny(vocab_size=32, num_layers=2, tie_embeddings=False)
  shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))
  rng = np.random.default_rng(0)

  def fill(path, leaf):
    name = path[-1].key
    if name.endswith("norm"):
      return np.ones(leaf.shape, leaf.dtype)
    fan_in = 1 if name == "embed" else leaf.shape[-2]
    return (2 * rng.standard_normal(leaf.shape) / np.sqrt(fan_in)).astype(leaf.dtype)

  params = jax.tree_util.tree_map_with_path(fill, shapes)
  target = LoadedModel(config, params, tokenizer(), "tiny random target")
  return target, draft_lib.derive(target, [0])


def queries() -> list[driver.Query]:
  rng = np.random.default_rng(1)
  out = []
  for i in range(NUM_REQUESTS):
    length = 20 if i == LONG_PROMPT else int(rng.integers(3, 12))
    out.append(driver.Query("".join(rng.choice(list(CHARS[:-1]), length))))
  return out


def digest(*trees) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(trees):
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()[:16]


def main(argv):
  try:
    work(argv)
  except BaseException:  # pylint: disable=broad-except
    # Exit at once: jax.distributed's shutdown at exit would wait on the peers.
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access


def work(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every step at INFO
  # Both run_streams of the checkpointed run share one compiled step.
  online.make_step = functools.lru_cache(online.make_step)
  start = time.perf_counter()
  log = lambda what: print(f"[{time.perf_counter() - start:5.1f} s] {what}",
                           flush=True)
  multihost_flags.maybe_initialize()
  log(f"process {jax.process_index()}/{jax.process_count()}:"
      f" {jax.local_device_count()} local of {jax.device_count()} devices")
  assert jax.device_count() == 8, jax.devices()
  target, draft = models_pair()
  stream = queries()
  mesh = online.make_mesh()
  if INTERLEAVE.value:
    rank = {d: i for p in range(jax.process_count())
            for i, d in enumerate(jax.local_devices(process_index=p))}
    devices = sorted(mesh.devices, key=lambda d: (rank[d], d.process_index))
    mesh = jax.sharding.Mesh(np.array(devices), (online.AXIS,))
  log("mesh rows by process: "
      + "".join(str(d.process_index) for d in mesh.devices))
  primary = distributed.is_primary()
  records = []
  reporter = (Reporter(OUT_DIR.value, "online", tensorboard=False, every=8)
              if primary else None)

  def on_request(record):
    records.append(record)
    if reporter is not None:
      reporter(record)

  run = lambda requests, **kw: driver.run_stream(
      target, draft, requests, CFG, batch_size=BATCH_SIZE, mesh=mesh, seed=0,
      chat=False, on_request=on_request, **kw)
  if CHECKPOINT_DIR.value:
    run_config = {"online": str(CFG), "batch_size": BATCH_SIZE}
    first = Checkpointer(CHECKPOINT_DIR.value, run_config, resume=False)
    run(stream[:FIRST_PART], checkpointer=first, checkpoint_every=8)
    first.close()
    log("first part served and checkpointed")
    resumed = Checkpointer(CHECKPOINT_DIR.value, run_config, resume=True)
    state = run(stream, checkpointer=resumed, checkpoint_every=8)
    resumed.close()
  else:
    state = run(stream)
  log("stream served")
  params = distributed.gather(state.draft_params)
  counters = distributed.gather((state.num_updates, state.num_skipped))
  records_digest = hashlib.sha256(json.dumps(
      [{k: v for k, v in r.items() if k not in ("batch_seconds", "batch")}
       for r in records], sort_keys=True).encode()).hexdigest()[:16]
  print(f"DIGEST process={jax.process_index()} params={digest(params)}"
        f" records={records_digest} updates={int(counters[0][0])}"
        f" skipped={int(counters[1][0])}", flush=True)
  if primary:
    reporter.close()
    flat = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
            jax.tree_util.tree_leaves_with_path(params)}
    np.savez(os.path.join(OUT_DIR.value, "params.npz"), **flat)
    with open(os.path.join(OUT_DIR.value, "records.json"), "w") as f:
      json.dump(records, f)
  log("WORKER DONE")


if __name__ == "__main__":
  flags.mark_flag_as_required("out_dir")
  app.run(main)
