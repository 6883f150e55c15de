"""A general-purpose starting draft, distilled once on chat text and cached.

It plays the part of the paper's pretrained drafts (which began at alpha
0.28-0.58): ShareGPT first turns and their replies, chat-templated, with the
target's own teacher-forced distributions (top-k) and features. No
generation is needed, so most of the cost is one target forward per
sequence. The result is cached under ~/.cache/osd_jax/warm_start, keyed by
the target's and draft's weights, the draft kind and these settings; a
cache that fails its checksum is reported and rebuilt, never used.
"""

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from osd_jax import progress
from osd_jax.checkpoints import tokenizer as tokenizers
from osd_jax.checkpoints.loading import LoadedModel
from osd_jax.data import TRAIN, make_stream
from osd_jax.decoding.drafts import Draft
from osd_jax.distillation import objectives, teacher, update
from osd_jax.distillation.buffer import Buffer
from osd_jax.models import llama

_VERSION = 1  # bump when the data or training changes what a key means


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  """What the starting draft is distilled on, and for how long."""

  conversations: int = 800  # ShareGPT first turns with a reply
  seq_len: int = 256  # tokens per sequence (prompt and reply, truncated)
  epochs: int = 2
  batch_size: int = 8
  teacher_k: int = 32
  data_seed: int = 0
  # A general start, like a pretrained draft, may also move its embedding.
  distill: update.DistillConfig = update.DistillConfig(learning_rate=1e-3,
                                                       train_embedding=True)


def default_cache_root() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "osd_jax", "warm_start")


def _weights_digest(params) -> list:
  """Shapes and absolute sums of the weights: what they are, not where they live."""
  leaves = jax.tree.leaves(params)
  return [[list(x.shape) for x in leaves],
          float(sum(float(jnp.sum(jnp.abs(x))) for x in leaves))]


def cache_key(target: LoadedModel, draft: Draft, cfg: WarmStartConfig) -> str:
  """A digest of everything the starting draft depends on.

  Weights enter by content, not by file path: the same target in another
  folder (a fresh clone) reuses the cache, changed weights rebuild it.
  """
  described = {
      "version": _VERSION, "target_config": dataclasses.asdict(target.config),
      "target_weights": _weights_digest(target.params),
      "drafter": repr(draft.drafter),
      "draft_weights": _weights_digest(draft.params),
      "settings": dataclasses.asdict(cfg),
      "matmul_dtype": update.learning_matmul_dtype(cfg.distill)}
  text = json.dumps(described, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def chat_sequences(target: LoadedModel, cfg: WarmStartConfig) -> list[tuple[list[int], int]]:
  """(token ids, prompt length) of chat-templated first turns and their replies."""
  requests = make_stream("single", ["chat"], 3 * cfg.conversations, seed=cfg.data_seed,
                         split=TRAIN)
  out = []
  tok = target.tokenizer
  for r in requests:
    if not r.answer:
      continue
    prompt = tokenizers.encode(tok, [r.prompt], chat=True, source=target.source)[0]
    reply = tok(r.answer, add_special_tokens=False)["input_ids"] + [target.config.eos_id]
    if len(prompt) > cfg.seq_len // 2:  # keep room for the reply
      continue
    out.append(((prompt + reply)[:cfg.seq_len], len(prompt)))
    if len(out) == cfg.conversations:
      break
  if not out:
    raise ValueError("No chat conversation with a reply to warm-start on.")
  return out


@functools.partial(jax.jit, static_argnames=("config", "teacher_k", "keep_hidden",
                                             "support"))
def _teacher_batch(params, tokens_BxL, gen_start_B, *, config, teacher_k, keep_hidden,
                   support):
  """Top-k teacher at every position that predicts a reply token, and features.

  With a `support` (a restricted draft head) the teacher is the target's
  softmax over those tokens: exactly what the loss renormalises onto, and
  six times cheaper than logits over the whole vocabulary.
  """
  hidden, _ = llama.forward(params, config, tokens_BxL)
  gen_len = tokens_BxL.shape[1] - 1
  positions = jnp.minimum(gen_start_B[:, None] + jnp.arange(gen_len),
                          tokens_BxL.shape[1] - 1)
  at = jnp.take_along_axis(hidden, positions[..., None], axis=1)
  if support is None:
    p = jax.nn.softmax(llama.logits(params, config, at), -1)
    ids, probs = teacher.top_k(p, teacher_k)
  else:
    columns = jnp.asarray(support)
    kernel = params["lm_head"] if "lm_head" in params else params["embed"].T
    p = jax.nn.softmax(llama.matmul(at, kernel[:, columns]).astype(jnp.float32), -1)
    rank, probs = teacher.top_k(p, teacher_k)
    ids = columns[rank]
  return ids, probs, (hidden.astype(jnp.bfloat16) if keep_hidden else None)


def packed(sequences, length: int, pad_id: int, rows: int | None = None):
  """(tokens [N, L], gen_start [N], loss weight [N, L-1]) of (token ids,
  prompt length) pairs, padded to `length` and to `rows` rows (weight 0)."""
  n = len(sequences) if rows is None else rows
  tokens = np.full((n, length), pad_id, np.int32)
  gen_start = np.zeros((n,), np.int32)
  weight = np.zeros((n, length - 1), np.float32)
  for i, (ids, prompt_len) in enumerate(sequences):
    tokens[i, :len(ids)] = ids
    gen_start[i] = prompt_len - 1
    weight[i, :len(ids) - prompt_len] = 1.0
  return tokens, gen_start, weight


def teacher_data(target: LoadedModel, sequences, cfg: WarmStartConfig,
                 keep_hidden: bool, support: tuple[int, ...] | None = None) -> Buffer:
  """A Buffer of every sequence with its teacher (host arrays, one row each)."""
  n, length = len(sequences), cfg.seq_len
  tokens, gen_start, weight = packed(sequences, length, target.config.pad_id)
  parts = {"ids": [], "probs": [], "hidden": []}
  bar = progress.bar(n, "warm start: target teacher", "sequences")
  for start in range(0, n, cfg.batch_size):
    rows = slice(start, start + cfg.batch_size)
    ids, probs, hidden = jax.device_get(_teacher_batch(
        target.params, jnp.asarray(tokens[rows]), jnp.asarray(gen_start[rows]),
        config=target.config, teacher_k=cfg.teacher_k, keep_hidden=keep_hidden,
        support=support))
    parts["ids"].append(ids)
    parts["probs"].append(probs)
    if keep_hidden:
      parts["hidden"].append(hidden)
    bar.update(len(ids))
  bar.close()
  hidden = (np.concatenate(parts["hidden"]) if keep_hidden
            else np.zeros((n, length, 0), jnp.bfloat16))
  return Buffer(tokens=tokens, gen_start=gen_start, loss_weight=weight,
                teacher_ids=np.concatenate(parts["ids"]),
                teacher_probs=np.concatenate(parts["probs"]), hidden=hidden,
                category=np.zeros((n,), np.int32), uid=np.arange(n, dtype=np.uint32),
                is_valid=np.ones((n,), bool), next_slot=np.zeros((), np.int32),
                num_added=np.asarray(n, np.int32), num_fresh=np.zeros((), np.int32))


def train(draft: Draft, target: LoadedModel, data: Buffer, cfg: WarmStartConfig, *,
          log: Callable[[str], None] = print):
  """Epochs of shuffled minibatches through the draft kind's own objective.

  Returns the parameters and each epoch's mean loss.
  """
  drafter, vocab = draft.drafter, target.config.vocab_size
  support = objectives.support(drafter)

  @jax.jit
  def step(params, opt_state, batch: Buffer):
    p = teacher.dense(batch.teacher_ids, batch.teacher_probs, vocab, support)
    objective = functools.partial(objectives.loss_sum, drafter,
                                  target_params=target.params, buffer=batch,
                                  p_NxGxV=p, cfg=cfg.distill)
    (total, weight), grads = update.value_and_trained_grads(objective, params,
                                                            cfg.distill)
    scale = 1.0 / jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g: g * scale, grads)
    params, opt_state, applied = update.apply_update(params, opt_state, grads,
                                                     total * scale, cfg.distill)
    return params, opt_state, total * scale, applied

  params = jax.tree.map(jnp.array, draft.params)  # a copy: the draft keeps its own
  opt_state = update.init_opt_state(params, cfg.distill)
  n = data.tokens.shape[0]
  rng = np.random.default_rng(cfg.data_seed)
  per_epoch = n // cfg.batch_size
  bar = progress.bar(cfg.epochs * per_epoch, "warm start: distilling", "steps")
  epoch_losses = []
  for epoch in range(cfg.epochs):
    losses = []
    order = rng.permutation(n)
    for b in range(per_epoch):
      rows = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
      batch = jax.tree.map(lambda x: x[rows] if np.ndim(x) else x, data)
      params, opt_state, loss, applied = step(params, opt_state, batch)
      if bool(applied):
        losses.append(float(loss))
      bar.update(1)
      bar.set_postfix(epoch=epoch + 1, loss=f"{np.mean(losses[-20:]):.3f}",
                      refresh=False)
    epoch_losses.append(float(np.mean(losses)) if losses else float("nan"))
    log(f"warm start epoch {epoch + 1}/{cfg.epochs}: loss {epoch_losses[-1]:.4f}")
  bar.close()
  return params, epoch_losses


class WarmStartError(ValueError):
  """A cached starting draft that cannot be used."""


def _save(path: str, params, meta: dict) -> None:
  os.makedirs(path, exist_ok=True)
  leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
  weights = os.path.join(path, "params.npz")
  with open(weights + ".tmp", "wb") as f:
    np.savez(f, *leaves)
  os.replace(weights + ".tmp", weights)
  with open(weights, "rb") as f:
    meta = dict(meta, sha256=hashlib.sha256(f.read()).hexdigest())
  with open(os.path.join(path, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2)


def _load(path: str, like):
  """The cached parameters, shaped like `like`; WarmStartError if unusable."""
  try:
    with open(os.path.join(path, "meta.json")) as f:
      meta = json.load(f)
    weights = os.path.join(path, "params.npz")
    with open(weights, "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()
    if digest != meta.get("sha256"):
      raise WarmStartError(f"{weights} does not match its checksum")
    with np.load(weights) as npz:
      leaves = [npz[f"arr_{i}"] for i in range(len(npz.files))]
  except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
    raise WarmStartError(f"cannot read the warm-start cache {path}: {e}") from e
  template, treedef = jax.tree.flatten(like)
  if [x.shape for x in leaves] != [x.shape for x in template]:
    raise WarmStartError(f"warm-start cache {path} holds other shapes")
  return treedef.unflatten([jnp.asarray(x, t.dtype) for x, t in zip(leaves, template)]), meta


def load_or_build(target: LoadedModel, draft: Draft, cfg: WarmStartConfig, *,
                  cache_root: str | None = None,
                  log: Callable[[str], None] = print,
                  sequences: list[tuple[list[int], int]] | None = None) -> Draft:
  """The draft distilled on chat text: from the cache, or built (and cached) now.

  `sequences` ((token ids, prompt length) pairs) replaces the ShareGPT text;
  the cache key does not see it, so give each its own `cache_root`.
  """
  if objectives.learnable(draft.drafter) is None:
    raise ValueError(f"{type(draft.drafter).__name__} has nothing to warm-start.")
  key = cache_key(target, draft, cfg)
  path = os.path.join(cache_root or default_cache_root(), key)
  source = f"{draft.source}, warm-started on chat ({key})"
  if os.path.exists(path):
    try:
      params, meta = _load(path, draft.params)
      log(f"warm start: cached draft {path} (loss {meta['final_loss']:.3f})")
      return dataclasses.replace(draft, params=params, source=source)
    except WarmStartError as e:
      log(f"warm start: {e}; rebuilding it")
  log(f"warm start: distilling a starting draft on {cfg.conversations} chat"
      f" conversations (cached in {path})")
  sequences = sequences or chat_sequences(target, cfg)
  data = teacher_data(target, sequences, cfg, keep_hidden=draft.drafter.needs_hidden,
                      support=objectives.support(draft.drafter))
  params, losses = train(draft, target, data, cfg, log=log)
  final = losses[-1] if losses else float("nan")
  _save(path, params, {"key": key, "target": target.source, "draft": draft.source,
                       "settings": json.loads(json.dumps(dataclasses.asdict(cfg),
                                                         default=str)),
                       "sequences": len(sequences), "final_loss": final})
  return dataclasses.replace(draft, params=params, source=source)
