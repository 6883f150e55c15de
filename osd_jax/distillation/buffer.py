"""Ring buffer of served sequences for distillation: fixed shapes, on device."""

import flax
import jax
import jax.numpy as jnp

from osd_jax.models.kv_cache import KVCache


@flax.struct.dataclass
class Buffer:
  """`capacity` sequences of `max_len` tokens, `gen_len` of them generated.

  Only generated positions carry a loss, so weights and teacher are stored
  for those alone. A feature draft also needs the target's hidden state at
  every position, kept in bfloat16 (its inputs are normed, so bfloat16's 8
  mantissa bits lose little). Memory per sample: 4 max_len + gen_len (4 + 8
  teacher_k) + 2 max_len hidden_dim + 13 bytes; e.g. max_len 192, gen_len 64,
  top-32, no hidden states: 17.4 KB; with SmolLM2's 576-wide states, +221 KB.
  Keeping prompts' keys and values (`prompt_k`) adds 2 max_len x layers x
  kv_heads x head_dim values of the draft's cache: 1.57 MB at max_len 512
  for the 2-layer float32 draft cut from SmolLM2.
  """

  tokens: jax.Array  # [capacity, max_len] int32, prompt then generated tokens
  # Position whose prediction is the first generated token (prompt length - 1).
  gen_start: jax.Array  # [capacity] int32
  # Weight of the prediction of generated token g; zero past the end.
  loss_weight: jax.Array  # [capacity, gen_len] float32
  teacher_ids: jax.Array  # [capacity, gen_len, teacher_k] int32
  teacher_probs: jax.Array  # [capacity, gen_len, teacher_k] float32
  # Target hidden state at each position (its feature), for feature drafts.
  hidden: jax.Array  # [capacity, max_len, hidden_dim] bfloat16; hidden_dim 0: none
  category: jax.Array  # [capacity] int32
  # The sample's request, as random bits of its sampling key: the same on
  # any device layout, so replay's minibatch draws (objectives.replay) are too.
  uid: jax.Array  # [capacity] uint32
  is_valid: jax.Array  # [capacity] bool
  next_slot: jax.Array  # [] int32, where the next sample goes
  num_added: jax.Array  # [] int32, samples added since the buffer was made
  # Samples added since the last update (`trained`): an add that would
  # overwrite them waits for an update first (serving/online.py).
  num_fresh: jax.Array  # [] int32
  # The model draft's keys and values of each sample's prompt, as serving's
  # prefill left them in its cache (per layer, [capacity, kv_heads,
  # head_dim, max_len] and [capacity, kv_heads, max_len, head_dim]): the
  # update reads the prompt from them instead of running the draft over it
  # again. Empty: not kept, the update recomputes them.
  prompt_k: tuple = ()
  prompt_v: tuple = ()

  @classmethod
  def empty(cls, capacity: int, max_len: int, gen_len: int, teacher_k: int,
            hidden_dim: int = 0, prompt_cache: KVCache | None = None) -> "Buffer":
    """teacher_k 0 keeps no teacher: the update then recomputes it. A
    `prompt_cache` (any draft cache of the right layers, heads and dtype)
    makes the buffer keep prompts' keys and values."""
    keys = values = ()
    if prompt_cache is not None:
      heads, head_dim = prompt_cache.num_kv_heads, prompt_cache.k[0].shape[1]
      zeros = lambda *shape: tuple(jnp.zeros(shape, k.dtype) for k in prompt_cache.k)
      keys = zeros(capacity, heads, head_dim, max_len)
      values = zeros(capacity, heads, max_len, head_dim)
    return cls(
        prompt_k=keys, prompt_v=values,
        tokens=jnp.zeros((capacity, max_len), jnp.int32),
        gen_start=jnp.zeros((capacity,), jnp.int32),
        loss_weight=jnp.zeros((capacity, gen_len), jnp.float32),
        teacher_ids=jnp.zeros((capacity, gen_len, teacher_k), jnp.int32),
        teacher_probs=jnp.zeros((capacity, gen_len, teacher_k), jnp.float32),
        hidden=jnp.zeros((capacity, max_len, hidden_dim), jnp.bfloat16),
        category=jnp.zeros((capacity,), jnp.int32),
        uid=jnp.zeros((capacity,), jnp.uint32),
        is_valid=jnp.zeros((capacity,), bool),
        next_slot=jnp.zeros((), jnp.int32),
        num_added=jnp.zeros((), jnp.int32),
        num_fresh=jnp.zeros((), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.tokens.shape[0]

  @property
  def keeps_teacher(self) -> bool:
    return self.teacher_ids.shape[-1] > 0

  @property
  def keeps_hidden(self) -> bool:
    return self.hidden.shape[-1] > 0

  @property
  def keeps_prompt_cache(self) -> bool:
    return bool(self.prompt_k)

  def prompt_cache(self, size: int) -> KVCache:
    """The kept prompts as a cache of `size` positions, each row's length its
    gen_start: the positions before the one that predicts the first answer
    token, all the prefill wrote."""
    heads = self.prompt_k[0].shape[1]
    n, length = self.tokens.shape[0], self.prompt_k[0].shape[-1]
    pad = lambda x, axis: jnp.pad(x, [(0, 0)] * axis + [(0, size - length)]
                                  + [(0, 0)] * (x.ndim - axis - 1))
    return KVCache(
        k=tuple(pad(k, 3).reshape(n * heads, -1, size) for k in self.prompt_k),
        v=tuple(pad(v, 2).reshape(n * heads, size, -1) for v in self.prompt_v),
        lengths=self.gen_start)

  def room(self) -> jax.Array:
    """[] samples an add may write without overwriting any not yet trained on."""
    return self.capacity - self.num_fresh

  def add(self, tokens_BxL, gen_start_B, loss_weight_BxG, teacher_ids_BxGxK,
          teacher_probs_BxGxK, category_B, is_new_B,
          hidden_BxLxD=None, prompt_cache: KVCache | None = None,
          uid_B=None) -> "Buffer":
    """Writes the rows with is_new into consecutive slots, oldest overwritten.

    Of more new rows than the ring holds only the last `capacity` are
    written: a scatter of several rows to one slot keeps an unspecified one.
    `prompt_cache` is the draft's cache of the same B rows, when the buffer
    keeps prompts (positions past max_len are not kept).
    """
    order = jnp.cumsum(is_new_B) - 1
    added = is_new_B.sum().astype(jnp.int32)
    written = is_new_B & (order >= added - self.capacity)
    slots = jnp.where(written, (self.next_slot + order) % self.capacity,
                      self.capacity)  # out of range: dropped by mode="drop"

    def put(store, rows):
      return store.at[slots].set(rows.astype(store.dtype), mode="drop")

    if uid_B is None:
      uid_B = jnp.zeros(is_new_B.shape, jnp.uint32)
    return self.replace(
        tokens=put(self.tokens, tokens_BxL),
        gen_start=put(self.gen_start, gen_start_B),
        loss_weight=put(self.loss_weight, loss_weight_BxG),
        teacher_ids=put(self.teacher_ids, teacher_ids_BxGxK),
        teacher_probs=put(self.teacher_probs, teacher_probs_BxGxK),
        hidden=(self.hidden if hidden_BxLxD is None
                else put(self.hidden, hidden_BxLxD)),
        prompt_k=self._put_cache(put, prompt_cache, keys=True),
        prompt_v=self._put_cache(put, prompt_cache, keys=False),
        category=put(self.category, category_B),
        uid=put(self.uid, uid_B),
        is_valid=put(self.is_valid, jnp.ones_like(is_new_B)),
        next_slot=(self.next_slot + added) % self.capacity,
        num_added=self.num_added + added,
        num_fresh=jnp.minimum(self.num_fresh + added, self.capacity))

  def needed_length(self) -> jax.Array:
    """[] positions that hold every valid sample up to its last weighted token."""
    gen_len = self.loss_weight.shape[1]
    last = jnp.max(jnp.where(self.loss_weight > 0, jnp.arange(1, gen_len + 1), 0),
                   axis=1)
    return jnp.max(jnp.where(self.is_valid & (last > 0), self.gen_start + 1 + last, 0))

  def _put_cache(self, put, cache: KVCache | None, *, keys: bool) -> tuple:
    stores = self.prompt_k if keys else self.prompt_v
    if not self.keeps_prompt_cache:
      return stores
    if cache is None:
      raise ValueError("This buffer keeps prompts' keys and values: pass the"
                       " draft's cache.")
    rows = cache.batch_size
    out = []
    for store, new in zip(stores, cache.k if keys else cache.v):
      new = new.reshape((rows,) + store.shape[1:-2] + new.shape[1:])  # [B, heads, ...]
      new = new[..., :store.shape[-1]] if keys else new[..., :store.shape[-2], :]
      out.append(put(store, new))
    return tuple(out)

  def truncated(self, length: int) -> "Buffer":
    """The same samples cut to their first `length` positions (static)."""
    return self.replace(tokens=self.tokens[:, :length],
                        hidden=self.hidden[:, :length],
                        prompt_k=tuple(k[..., :length] for k in self.prompt_k),
                        prompt_v=tuple(v[:, :, :length] for v in self.prompt_v))

  def taken(self, rows_M: jax.Array, is_chosen_M: jax.Array) -> "Buffer":
    """The samples in `rows` as a buffer of M; those not chosen are invalid."""
    take = lambda x: x[rows_M]
    return self.replace(
        tokens=take(self.tokens), gen_start=take(self.gen_start),
        loss_weight=take(self.loss_weight), teacher_ids=take(self.teacher_ids),
        teacher_probs=take(self.teacher_probs), hidden=take(self.hidden),
        category=take(self.category), uid=take(self.uid),
        is_valid=take(self.is_valid) & is_chosen_M,
        prompt_k=tuple(map(take, self.prompt_k)),
        prompt_v=tuple(map(take, self.prompt_v)))

  def trained(self) -> "Buffer":
    """The same samples, every one of them now trained on."""
    return self.replace(num_fresh=jnp.zeros_like(self.num_fresh))

  def cleared(self) -> "Buffer":
    """All slots invalid (the paper clears the buffer after each update)."""
    return self.replace(is_valid=jnp.zeros_like(self.is_valid),
                        num_fresh=jnp.zeros_like(self.num_fresh))
