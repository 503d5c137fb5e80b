"""Prompt reuse: the states of sequences already run, kept so that a new prompt sharing a prefix
with one of them prefills only the rest (a chat's next turn re-sends the whole conversation).

Attention layers keep K/V rows by position, so the first L rows of a stored sequence serve any
prompt that starts with its first L tokens. A Gated-DeltaNet layer keeps one recurrent state (its
conv window and its d_k x d_v matrix per head) that cannot be cut back to a shorter prefix, so the
store keeps snapshots of it at chosen positions: every `interval` tokens of a prefill (the
prefill's own chunk boundaries by default, so taking them costs no extra program), at the end of
each prompt, and at the end of each finished sequence whose state is exact there. A prompt reuses
the longest stored prefix that ends at a snapshot (any length, for a model without DeltaNet
layers) and always leaves at least its last token to prefill: the caller needs that token's logits.

An entry is one sequence: its K/V rows (up to a KV bucket past its length) and its snapshots, all
on the device, counted in bytes against `budget_bytes` and evicted least recently used. Storing
a sequence that extends a stored one (the next turn) takes over the shorter entry's snapshots
and frees its rows. Reuse is exact: the rows and states are the ones a full prefill of the same
tokens computes, and a prefill from position L computes what the full prefill computes there
(tests/test_prefix.py compares the logits).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from jaxvt.model_fns import KV_BUCKETS, bucket

KV_LEAVES = ("k", "v")  # [n_attn, batch, positions, heads, dim]: rows by position
STATE_LEAVES = ("conv", "ssm")  # [n_gdn, batch, ...]: the recurrent state after the last token


@dataclasses.dataclass
class _Entry:
  tokens: tuple[int, ...]
  kv: dict  # KV_LEAVES cut to `rows` positions (b = 1); empty without attention layers
  states: dict[int, dict]  # position -> STATE_LEAVES (b = 1) after that many tokens
  nbytes: int = 0

  def recount(self) -> None:
    leaves = list(self.kv.values()) + [a for s in self.states.values() for a in s.values()]
    self.nbytes = sum(a.nbytes for a in leaves)


def sequence_bytes(engine) -> int:
  """Device bytes of one sequence's cache (K/V for max_context positions, recurrent state)."""
  shapes = jax.eval_shape(lambda: engine.new_cache(1))
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))


def _common(a: tuple[int, ...], b: list[int]) -> int:
  n = min(len(a), len(b))
  i = 0
  while i < n and a[i] == b[i]:
    i += 1
  return i


def _state_of(cache: dict) -> dict:
  """A copy of the recurrent leaves of a b=1 cache (prefill donates the cache it is given)."""
  return {k: jnp.copy(cache[k]) for k in STATE_LEAVES if k in cache}


class PrefixCache:
  """Stored sequences of one engine (b = 1 caches), at most `budget_bytes` of device memory.

  `prefill(tokens)` is `engine.prefill(tokens)` that starts from the longest reusable prefix and
  records what it computed; `store` records a sequence finished elsewhere (a server's slot)."""

  def __init__(self, engine, budget_bytes: int, interval: int | None = None):
    self.engine = engine
    self.budget_bytes = int(budget_bytes)
    self.interval = max(1, int(interval or engine.prefill_chunk))
    self.hybrid = bool(engine.cfg.deltanet_layers)
    self.attention = bool(engine.cfg.attention_layers)
    self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
    self._ids = iter(range(1 << 62))
    self.hits = 0  # prompts that reused a prefix
    self.reused_tokens = 0

  @property
  def nbytes(self) -> int:
    return sum(e.nbytes for e in self._entries.values())

  def __len__(self) -> int:
    return len(self._entries)

  # ---- lookup ----------------------------------------------------------------------------
  def _usable(self, e: _Entry, tokens: list[int]) -> int:
    """How many of `tokens` entry `e` can stand for (leaving the last to prefill)."""
    n = min(_common(e.tokens, tokens), len(tokens) - 1)
    if self.hybrid:
      n = max((p for p in e.states if p <= n), default=0)
    return n

  def lookup(self, tokens: list[int]) -> tuple[int, dict | None]:
    """(L, a b=1 cache holding the state after tokens[:L]) for the longest stored prefix, or
    (0, None). The cache is new (the caller may donate it)."""
    best, start = None, 0
    for key, e in self._entries.items():
      n = self._usable(e, tokens)
      if n > start:
        best, start = key, n
    if best is None:
      return 0, None
    e = self._entries[best]
    self._entries.move_to_end(best)
    cache = self.engine.new_cache(1)
    for k, rows in e.kv.items():
      cache[k] = jax.lax.dynamic_update_slice_in_dim(cache[k], rows, 0, 2)
    if self.hybrid:
      cache.update({k: jnp.copy(v) for k, v in e.states[start].items()})
    self.hits += 1
    self.reused_tokens += start
    return start, cache

  # ---- prefill ---------------------------------------------------------------------------
  def prefill(self, tokens: list[int]):
    """engine.prefill(tokens) from the longest reusable prefix. Returns (logits [vocab] after
    the last token, the b=1 cache, how many tokens were reused). The prompt is stored: its rows,
    and for a hybrid model the state every `interval` positions and at its end."""
    start, cache = self.lookup(tokens)
    states: dict[int, dict] = {}
    pos = start
    while True:
      # a hybrid model's prefill stops at each multiple of `interval` to snapshot its state
      end = len(tokens) if not self.hybrid else min(len(tokens),
                                                    (pos // self.interval + 1) * self.interval)
      logits, cache = self.engine.prefill(tokens[pos:end], cache, start=pos)
      pos = end
      if self.hybrid:
        states[pos] = _state_of(cache)
      if pos == len(tokens):
        break
    self.store(tokens, cache, states=states)
    return logits, cache, start

  # ---- store -----------------------------------------------------------------------------
  def store(self, tokens: list[int], cache: dict, exact: bool = True,
            states: dict[int, dict] | None = None) -> None:
    """Records that the b=1 `cache` holds `tokens` (its K/V rows for them; with `exact`, its
    recurrent state is the one after exactly these tokens, else it is not kept). `states`:
    further snapshots by position. Entries the new one extends are merged into it; the least
    recently used entries are evicted until the store fits its budget (the new entry too, where
    it alone is larger than the budget)."""
    tokens = tuple(int(t) for t in tokens)
    if not tokens or self.budget_bytes <= 0:
      return
    states = dict(states or {})
    if self.hybrid and exact:
      states[len(tokens)] = _state_of(cache)
    for key, e in list(self._entries.items()):
      if len(e.tokens) <= len(tokens) and tokens[:len(e.tokens)] == e.tokens:
        states = {**e.states, **states}
        del self._entries[key]
      elif len(e.tokens) >= len(tokens) and e.tokens[:len(tokens)] == tokens and (
          not self.hybrid or len(tokens) in e.states):
        self._entries.move_to_end(key)  # stored already (a longer sequence covers it)
        return
    rows = bucket(len(tokens), KV_BUCKETS, self.engine.max_context)
    kv = {k: jax.lax.slice_in_dim(cache[k], 0, rows, axis=2) for k in KV_LEAVES
          if self.attention and k in cache}
    entry = _Entry(tokens, kv, {p: s for p, s in states.items() if p <= len(tokens)})
    entry.recount()
    self._entries[next(self._ids)] = entry
    while self._entries and self.nbytes > self.budget_bytes:
      self._entries.popitem(last=False)
