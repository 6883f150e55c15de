"""Token ids to text deltas as they arrive: stop strings and half-decoded characters.

Each delta is text that can no longer change. Text that might still become
a stop string, and a character whose bytes have not all arrived (decoded as
U+FFFD), are held back until later tokens settle them.
"""

_REPLACEMENT = "\ufffd"


class TextStream:
  """One request's output text, fed token groups; EOS ends it and is not text."""

  def __init__(self, tokenizer, eos_id: int, stops: tuple[str, ...] = ()):
    self._tokenizer, self._eos_id = tokenizer, eos_id
    self._stops = tuple(s for s in stops if s)
    self.ids: list[int] = []  # output tokens, EOS excluded
    self.text = ""  # everything handed out so far
    self.closed = False  # EOS, a stop string or finish(): no more text
    self.stop_tokens: int | None = None  # tokens through a matched stop string
    self.ended_by_eos = False

  def add(self, ids: list[int]) -> str:
    """The text these tokens settle (maybe empty); nothing once closed."""
    if self.closed:
      return ""
    if self._eos_id in ids:
      self.ids.extend(ids[:ids.index(self._eos_id)])
      self.ended_by_eos = True
      return self.finish()
    before = len(self.ids)
    self.ids.extend(ids)
    full = self._decode(self.ids)
    if self._first_stop(full) is not None:
      return self._close(full, before)
    return self._send(full[:self._settled_end(full)])

  def finish(self) -> str:
    """The text still held back, at the end of the request."""
    if self.closed:
      return ""
    return self._close(self._decode(self.ids), 0)

  def _decode(self, ids: list[int]) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=False)

  def _close(self, full: str, searched: int) -> str:
    self.closed = True
    cut = self._first_stop(full)
    if cut is None:
      return self._send(full)
    self.stop_tokens = self._tokens_through_stop(searched)
    return self._send(full[:cut])

  def _send(self, upto: str) -> str:
    # Decoding is prefix-stable for the tokenizers osd-jax loads; were a
    # tokenizer to rewrite earlier text, only a clean tail would be sent.
    delta = upto[len(self.text):] if upto.startswith(self.text) else ""
    self.text += delta
    return delta

  def _first_stop(self, text: str) -> int | None:
    hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
    return min(hits) if hits else None

  def _settled_end(self, text: str) -> int:
    """Where the text that no later token can change ends."""
    end = len(text.rstrip(_REPLACEMENT))
    held = 0  # the longest tail that begins some stop string
    for stop in self._stops:
      for n in range(min(len(stop) - 1, end), held, -1):
        if text[:end].endswith(stop[:n]):
          held = n
          break
    return end - held

  def _tokens_through_stop(self, searched: int) -> int:
    """The fewest output tokens whose text holds a stop string (> searched)."""
    for n in range(searched + 1, len(self.ids) + 1):
      if self._first_stop(self._decode(self.ids[:n])) is not None:
        return n
    return len(self.ids)
