"""Host side of the online loop: route, batch and feed requests, collect metrics.

The host never touches parameters: it tokenizes, pads, calls the compiled
step and reads back per-request metrics. Batches hold requests of one draft
(category), so multiple drafts need no per-row parameter gather.
"""

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from osd_jax.checkpoints import tokenizer as tokenizers
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.serving import distributed, online
from osd_jax.serving.checkpoint import Checkpointer


# Per-row running sums of speculative.Metrics (the others are per position).
ROW_METRICS = ("proposed", "accepted", "target_calls", "emitted", "alpha_sum",
               "alpha_count")


@dataclasses.dataclass(frozen=True)
class Query:
  """One request of a stream; `category` routes it to a draft."""

  prompt: str
  category: str = "default"
  domain: str = ""


@dataclasses.dataclass
class Batcher:
  """Per-draft queues of request indices; a full queue becomes a batch."""

  batch_size: int
  queues: dict[int, list[int]]
  next_request: int = 0

  def feed(self, draft_of: Callable[[int], int], num_requests: int):
    """Yields (draft, indices) in stream order, partial batches at the end."""
    while self.next_request < num_requests:
      index = self.next_request
      self.next_request += 1
      queue = self.queues.setdefault(draft_of(index), [])
      queue.append(index)
      if len(queue) == self.batch_size:
        self.queues[draft_of(index)] = []
        yield draft_of(index), queue
    for draft in sorted(self.queues):
      if self.queues[draft]:
        queue, self.queues[draft] = self.queues[draft], []
        yield draft, queue


def encode_prompts(model: LoadedModel, prompts: Sequence[str],
                   chat: bool) -> list[list[int]]:
  """Token ids per prompt, through the chat template when asked."""
  return tokenizers.encode(model.tokenizer, prompts, chat, model.source)


def _pad_batch(ids: list[list[int]], batch_size: int, width: int, pad_id: int):
  """[batch, width] prompts, lengths, and which rows are real requests."""
  prompts = np.full((batch_size, width), pad_id, np.int32)
  lens = np.full((batch_size,), 2, np.int32)  # dummy rows: a 2-token prompt
  for row, seq in enumerate(ids):
    prompts[row, :len(seq)] = seq
    lens[row] = len(seq)
  is_real = np.arange(batch_size) < len(ids)
  return prompts, lens, is_real


def run_stream(target: LoadedModel, draft: LoadedModel, queries: Sequence[Query],
               cfg: online.OnlineConfig, *, batch_size: int,
               mesh: jax.sharding.Mesh, seed: int = 0, chat: bool = True,
               categories: Sequence[str] = ("default",),
               checkpointer: Checkpointer | None = None,
               checkpoint_every: int = 0,
               on_request: Callable[[dict], None] = lambda record: None,
               state: online.OnlineState | None = None):
  """Serves `queries` in order, learning online; returns the final state.

  `on_request` receives one metrics record per served request, in the order
  they finish. Prompts longer than cfg.prompt_len are skipped and reported.
  """
  if batch_size % mesh.size:
    raise ValueError(f"batch_size {batch_size} must be a multiple of the"
                     f" {mesh.size} devices.")
  draft_of_category = {c: i for i, c in enumerate(categories)}
  if cfg.num_drafts not in (1, len(categories)):
    raise ValueError(f"{cfg.num_drafts} drafts for {len(categories)} categories.")

  def draft_of(index: int) -> int:
    if cfg.num_drafts == 1:
      return 0
    category = queries[index].category
    if category not in draft_of_category:
      raise ValueError(f"Request {index} has unknown category {category!r}.")
    return draft_of_category[category]

  step = online.make_step(mesh, target_config=target.config,
                          draft_config=draft.config, cfg=cfg)
  # Placed before a restore, so that orbax restores straight onto the mesh
  # (with several hosts, arrays spanning them have no host copy to place).
  state = online.place_state(
      state or online.init_state(draft.params, cfg, mesh.size, seed), mesh)
  target_params = distributed.replicate(target.params, mesh)
  batcher = Batcher(batch_size, {})
  served = batches_done = 0
  saved_at = None  # `served` of the newest checkpoint (orbax keeps one per step)
  if checkpointer is not None:
    restored = checkpointer.restore_latest(state)
    if restored is not None:
      state, host = restored
      batcher = Batcher(batch_size, {int(k): v for k, v in host["queues"].items()},
                        host["next_request"])
      served = saved_at = host["served"]
      batches_done = host.get("batches", 0)
      print(f"Resumed at request {batcher.next_request} ({served} served).")

  def save():
    nonlocal saved_at
    if checkpointer is not None and saved_at != served:
      checkpointer.save(served, state, {
          "next_request": batcher.next_request, "served": served,
          "batches": batches_done,
          "queues": {str(k): v for k, v in batcher.queues.items()}})
      saved_at = served

  state = online.place_state(state, mesh)
  # Every host plans the same batches; each puts only its own devices' rows.
  put_rows = lambda x: distributed.shard_leading(x, mesh, online.AXIS)
  last_saved = served
  for draft_index, indices in batcher.feed(draft_of, len(queries)):
    ids = encode_prompts(target, [queries[i].prompt for i in indices], chat)
    fits = [len(x) <= cfg.prompt_len and len(x) >= 2 for x in ids]
    for i, ok, x in zip(indices, fits, ids):
      if not ok:
        on_request({"request": i, "skipped": True, "prompt_tokens": len(x)})
    kept = [i for i, ok in zip(indices, fits) if ok]
    if not kept:
      continue
    prompts, lens, is_real = _pad_batch([x for x, ok in zip(ids, fits) if ok],
                                        batch_size, cfg.prompt_len,
                                        target.config.pad_id)
    start = time.perf_counter()
    state, out = step(target_params, state, put_rows(prompts), put_rows(lens),
                      put_rows(is_real), distributed.replicate(
                          np.int32(draft_index), mesh))
    out = distributed.gather(out)
    seconds = time.perf_counter() - start
    batch_tokens = int(out.lengths[is_real].sum())
    for row, index in enumerate(kept):
      m = out.metrics
      m = {f: float(getattr(m, f)[row]) for f in ROW_METRICS}
      served += 1
      on_request({
          "request": index, "served": served, "draft": draft_index,
          "batch": batches_done,
          "category": queries[index].category, "domain": queries[index].domain,
          "alpha": m["alpha_sum"] / max(m["alpha_count"], 1.0),
          "acceptance_rate": m["accepted"] / max(m["proposed"], 1.0),
          "tokens_per_target_call": m["emitted"] / max(m["target_calls"], 1.0),
          "new_tokens": int(out.lengths[row]),
          "batch_seconds": seconds, "batch_tokens": batch_tokens,
          # The batch's update (if any) is reported once, on its last request.
          "loss": (float(out.loss) if out.did_update and row == len(kept) - 1
                   else None),
          "update_skipped": bool(out.did_update and not out.update_applied),
      })
    batches_done += 1
    if checkpoint_every and served - last_saved >= checkpoint_every:
      save()
      last_saved = served
      state = online.place_state(state, mesh)
  save()
  return state
