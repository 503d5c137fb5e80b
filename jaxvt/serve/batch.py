"""A batched session over an Engine: a cache of B slots. Each request is prefilled alone (b=1),
from the longest prefix the prefix cache holds (jaxvt.prefix), into a b=1 cache whose leaves are
then written into its slot. The requests are kept in slots 0..n-1 (the scheduler compacts them,
`move` moves the caches), and one decode program steps the first ROWS-bucket of slots that holds
them at their own positions: a step of one request reads one token's routed experts, not B
rows'. Rows in the bucket without a request decode a dummy token and are ignored (a slot's
every leaf is written again when its next request is prefilled into it). A finished request's
slot is stored in the prefix cache, so the next turn of its conversation reuses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.model_fns import bucket, decode_slots_fn
from jaxvt.prefix import PrefixCache
from jaxvt.sampling import sample_rows, seed_words

ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode programs' row counts (few programs, little waste)


class BatchSession:
  """B slots of `engine`'s cache; `positions[s]` is where slot s's next token goes."""

  def __init__(self, engine, batch: int, prefix: PrefixCache | None = None):
    self.engine = engine
    self.batch = batch
    self.prefix = prefix
    self.cache = engine.new_cache(batch)
    one = jax.eval_shape(lambda: engine.new_cache(1))
    # The batch axis of each cache leaf: the one whose size differs between b=1 and b=B (axis 1
    # where B is 1 as well).
    self._axes = jax.tree.map(
        lambda a, b: next((i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y), 1),
        one, self.cache)
    self.positions = np.zeros(batch, np.int32)

  def prefill(self, slot: int, tokens: list[int]) -> tuple[jax.Array, int]:
    """Prefills `tokens` into `slot`. Returns (logits [vocab] after the last token, how many
    leading tokens came from the prefix cache instead of being computed)."""
    if self.prefix is not None:
      logits, small, cached = self.prefix.prefill(tokens)
    else:
      (logits, small), cached = self.engine.prefill(tokens), 0
    self.cache = jax.tree.map(
        lambda big, s, ax: jax.lax.dynamic_update_slice_in_dim(big, s.astype(big.dtype), slot, ax),
        self.cache, small, self._axes)
    self.positions[slot] = len(tokens)
    return logits, cached

  def slot_cache(self, slot: int) -> dict:
    """A b=1 copy of `slot`'s cache."""
    return jax.tree.map(lambda big, ax: jax.lax.dynamic_slice_in_dim(big, slot, 1, ax),
                        self.cache, self._axes)

  def finish(self, slot: int, tokens: list[int]) -> None:
    """`slot`'s request is over and its cache holds exactly `tokens` (prompt and the generated
    tokens fed back): stored for prefix reuse."""
    if self.prefix is not None and tokens:
      self.prefix.store(tokens, self.slot_cache(slot))

  def move(self, src: int, dst: int) -> None:
    """Slot `src`'s cache and position into slot `dst` (the scheduler's compaction)."""
    self.cache = jax.tree.map(
        lambda big, ax: jax.lax.dynamic_update_slice_in_dim(
            big, jax.lax.dynamic_slice_in_dim(big, src, 1, ax), dst, ax), self.cache, self._axes)
    self.positions[dst] = self.positions[src]

  def decode(self, tokens: dict[int, int]) -> jax.Array:
    """One step: `tokens` maps slot -> the token to feed at its position. Returns logits
    float32 [rows, vocab] on the device for the first `rows` slots (the ROWS bucket holding the
    highest slot fed; rows of slots not in `tokens` are meaningless)."""
    rows = bucket(max(tokens) + 1, ROWS, self.batch)
    toks = np.zeros((rows, 1), np.int32)
    # A row not fed this step still writes a K/V row: put it at that slot's next position (masked
    # until the slot decodes there and overwrites it), never over a row the slot holds already.
    pos = np.minimum(self.positions[:rows], self.engine.max_context - 1)[:, None].astype(np.int32)
    for s, t in tokens.items():
      toks[s, 0] = t
    e = self.engine
    kv_len = e.kv_len(int(pos.max()) + 1)
    logits, self.cache = decode_slots_fn(e.weights, self.cache, jnp.asarray(toks),
                                         jnp.asarray(pos), cfg=e.cfg, ex=e.ex, kv_len=kv_len,
                                         rows=rows)
    for s in tokens:
      self.positions[s] += 1
    return logits


def sample(logits: jax.Array, rows: dict[int, tuple]) -> dict[int, int]:
  """Samples each row of `logits` [B or 1, vocab] named in `rows`: row -> (temperature, top_k,
  top_p, seed, token index, logit bias {token id: bias}). Returns row -> token id."""
  if not rows:
    return {}
  b = logits.shape[0]
  t, k, p = np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32)
  seeds, counters = np.zeros((b, 2), np.uint32), np.zeros(b, np.int32)
  bias = None
  for r, (temp, top_k, top_p, seed, index, row_bias) in rows.items():
    t[r], k[r], p[r], seeds[r], counters[r] = temp, top_k, top_p, seed_words(seed), index
    if row_bias:
      bias = np.zeros(logits.shape, np.float32) if bias is None else bias
      bias[r, list(row_bias)] = list(row_bias.values())
  out = np.asarray(sample_rows(logits, seeds, counters, t, k, p, bias))
  return {r: int(out[r]) for r in rows}
