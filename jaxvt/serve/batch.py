"""A batched session over an Engine: a cache of B slots; each request is prefilled alone (b=1)
into a fresh cache whose rows are then written into its slot, and one decode program steps all
B slots at their own positions (rows without a request decode a dummy token and are ignored)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.model_fns import decode_fn


class BatchSession:
  """B slots of `engine`'s cache; `positions[s]` is where slot s's next token goes."""

  def __init__(self, engine, batch: int):
    self.engine = engine
    self.batch = batch
    self.cache = engine.new_cache(batch)
    one = engine.new_cache(1)
    # The batch axis of each cache leaf: the one whose size differs between b=1 and b=B.
    self._axes = jax.tree.map(
        lambda a, b: next((i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y), 0),
        one, self.cache)
    self.positions = np.zeros(batch, np.int32)

  def prefill(self, slot: int, tokens: list[int]):
    """Prefills `tokens` into `slot`; returns the logits [vocab] after the last one."""
    logits, small = self.engine.prefill(tokens)
    self.cache = jax.tree.map(
        lambda big, s, ax: jax.lax.dynamic_update_slice_in_dim(big, s.astype(big.dtype), slot, ax),
        self.cache, small, self._axes)
    self.positions[slot] = len(tokens)
    return logits

  def decode(self, tokens: dict[int, int]):
    """One step: `tokens` maps slot -> the token to feed at its position. Returns logits
    float32 [B, vocab] (rows of slots not in `tokens` are meaningless)."""
    toks = np.zeros((self.batch, 1), np.int32)
    # A row not fed this step still writes a K/V row: put it at that slot's next position (masked
    # until the slot decodes there and overwrites it), never over a row the slot holds already.
    pos = np.minimum(self.positions, self.engine.max_context - 1)[:, None].astype(np.int32)
    for s, t in tokens.items():
      toks[s, 0] = t
    e = self.engine
    kv_len = e.kv_len(int(pos.max()) + 1)
    logits, self.cache = decode_fn(e.weights, self.cache, jnp.asarray(toks), jnp.asarray(pos),
                                   cfg=e.cfg, ex=e.ex, kv_len=kv_len)
    for s in tokens:
      self.positions[s] += 1
    return logits
