"""One process of tests/test_multihost.py: a short online stream on a tiny pair.

Started by the test as a separate OS process (JAX_PLATFORMS=cpu and a fake
device count in XLA_FLAGS), either alone or as one of several processes
joined by jax.distributed through experiments.multihost_flags:

  python tests/multihost_worker.py --out_dir=D [--checkpoint_dir=C]
      [--multihost --coordinator=127.0.0.1:PORT --num_processes=2 --process_id=I]
      [--interleave]

With --checkpoint_dir the stream is checkpointed every 4 served requests
and interrupted (an exception from the record callback, on every process
alike) after 14 records; a fresh run_stream then resumes from the last
checkpoint, requests in flight included, and serves the rest. Records the
interrupted run emitted after that checkpoint are dropped: the resumed run
emits them again. Without it the stream runs straight through.
--interleave orders the mesh so that the processes' devices alternate (as a
topology-aware mesh may), so that no host feeds a contiguous block of slots.
Only process 0 writes into --out_dir: the final draft params (params.npz),
the per-request records (records.json) and a Reporter's JSONL. Every process
prints a digest line of what it computed, for the test to compare across
processes.
"""

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
from osd_jax.decoding.drafts import Draft, ModelDraft
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

SLOTS = 8  # one per device
NUM_REQUESTS = 24
EVERY = 4  # served requests between checkpoints
INTERRUPT_AFTER = 14  # records emitted before the first run is stopped
LONG_PROMPT = 20  # this request's prompt cannot fit a slot: an error record
CHARS = string.ascii_lowercase + " "
CFG = online.OnlineConfig(
    k=3, max_new_tokens=8, cache_size=32, steps_per_call=2, update_interval=4,
    buffer_capacity=2, teacher_k=8, distill=DistillConfig(learning_rate=1e-2))
TIMING = driver.CLOCK_FIELDS


class Interrupt(Exception):
  pass


class Saves(Checkpointer):
  """Notes how many records had been emitted when each checkpoint was written."""

  def __init__(self, *args, records, **kwargs):
    super().__init__(*args, **kwargs)
    self.records, self.saved = records, [0]

  def save(self, step, state, host):
    super().save(step, state, host)
    self.saved.append(len(self.records))


def tokenizer() -> transformers.PreTrainedTokenizerFast:
  """One token per character: <pad> 0, <s> 1, </s> 2, then a-z and space."""
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
  vocab.update({c: i + 3 for i, c in enumerate(CHARS)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
      eos_token="</s>", unk_token="<pad>")


def models_pair() -> tuple[LoadedModel, Draft]:
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
  cut = draft_lib.derive(target, [0])
  return target, Draft(ModelDraft(cut.config), cut.params, cut.source)


def queries() -> list[driver.Query]:
  rng = np.random.default_rng(1)
  out = []
  for i in range(NUM_REQUESTS):
    length = 25 if i == LONG_PROMPT else int(rng.integers(3, 12))  # fits: <= 21
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
  # A choice one host vetoes is no host's (driver.serve_in_turns relies on it).
  log(f"all agree: {distributed.all_agree(True)},"
      f" {distributed.all_agree(jax.process_index() == 0)}")
  records = []

  def run(stop_after=None, **kwargs):
    def on_request(record):
      if stop_after is not None and len(records) == stop_after:
        raise Interrupt
      records.append({k: v for k, v in record.items() if k not in TIMING})
    return driver.run_stream(target, draft, stream, CFG, num_slots=SLOTS, mesh=mesh,
                             seed=0, chat=False, on_request=on_request, **kwargs)

  if CHECKPOINT_DIR.value:
    run_config = {"online": str(CFG), "slots": SLOTS}
    first = Saves(CHECKPOINT_DIR.value, run_config, resume=False, records=records)
    try:
      run(stop_after=INTERRUPT_AFTER, checkpointer=first, checkpoint_every=EVERY)
      raise AssertionError("the first run was not interrupted")
    except Interrupt:
      pass
    first.close()
    del records[first.saved[-1]:]  # the resumed run emits these again
    log(f"interrupted after {INTERRUPT_AFTER} records, {len(records)} checkpointed")
    resumed = Checkpointer(CHECKPOINT_DIR.value, run_config, resume=True)
    state = run(checkpointer=resumed, checkpoint_every=EVERY)
    resumed.close()
  else:
    state = run()
  log("stream served")
  params = distributed.gather(state.draft_params)
  counters = distributed.gather((state.num_updates, state.num_skipped))
  records_digest = hashlib.sha256(json.dumps(records, sort_keys=True).encode()
                                  ).hexdigest()[:16]
  print(f"DIGEST process={jax.process_index()} params={digest(params)}"
        f" records={records_digest} updates={int(counters[0][0])}"
        f" skipped={int(counters[1][0])}", flush=True)
  if distributed.is_primary():
    reporter = Reporter(OUT_DIR.value, "online", total=len(stream),
                        tensorboard=False)
    for record in records:
      reporter(record)
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
