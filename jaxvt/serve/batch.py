"""A batched session over an Engine: a cache of B slots. Each request is prefilled alone (b=1),
from the longest prefix the prefix cache holds (jaxvt.prefix), into a b=1 cache whose leaves are
then written into its slot. The requests are kept in slots 0..n-1 (the scheduler compacts them,
`move` moves the caches), and one decode program steps the first ROWS-bucket of slots that holds
them at their own positions: a step of one request reads one token's routed experts, not B
rows'. Rows in the bucket without a request decode a dummy token and are ignored (a slot's
every leaf is written again when its next request is prefilled into it). A finished request's
slot is stored in the prefix cache, so the next turn of its conversation reuses it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.model_fns import bucket, decode_slots_fn
from jaxvt.prefix import PrefixCache
from jaxvt.sampling import apply_mask, mask_words, sample_rows, seed_words

ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode programs' row counts (few programs, little waste)


class BatchSession:
  """B slots of `engine`'s cache; `positions[s]` is where slot s's next token goes."""

  def __init__(self, engine, batch: int, prefix: PrefixCache | None = None):
    self.engine = engine
    self.batch = batch
    self.prefix = prefix
    self.cache = engine.new_cache(batch)  # every leaf's batch axis is 1 (decoder.init_cache)
    self.positions = np.zeros(batch, np.int32)

  def prefill(self, slot: int, tokens: list[int]) -> tuple[jax.Array, int]:
    """Prefills `tokens` into `slot`. Returns (logits [vocab] after the last token, how many
    leading tokens came from the prefix cache instead of being computed)."""
    if self.prefix is not None:
      logits, small, cached = self.prefix.prefill(tokens)
    else:
      (logits, small), cached = self.engine.prefill(tokens), 0
    self.cache = _write_slot(self.cache, small, slot)
    self.positions[slot] = len(tokens)
    return logits, cached

  def slot_cache(self, slot: int) -> dict:
    """A b=1 copy of `slot`'s cache."""
    return {k: jax.lax.dynamic_slice_in_dim(v, slot, 1, 1) for k, v in self.cache.items()}

  def finish(self, slot: int, tokens: list[int], exact: bool = True) -> None:
    """`slot`'s request is over and its cache holds `tokens` (prompt and the generated tokens
    fed back; with `exact`, those alone, else decode ran on past them and only their K/V rows
    are kept): stored for prefix reuse."""
    if self.prefix is not None and tokens:
      self.prefix.store(tokens, self.slot_cache(slot), exact=exact)

  def move(self, src: int, dst: int) -> None:
    """Slot `src`'s cache and position into slot `dst` (the scheduler's compaction)."""
    self.cache = _move_slot(self.cache, src, dst)
    self.positions[dst] = self.positions[src]

  def decode(self, feed: dict[int, tuple], steps: int = 1,
             masks: dict[int, np.ndarray] | None = None) -> np.ndarray:
    """`steps` decode steps of the requests in `feed`: slot -> (the token to feed at its
    position, then sample's row parameters); `masks`: slot -> its packed allowed tokens
    (jaxvt.sampling.apply_mask; only with steps=1: the next mask depends on this token). Returns the sampled tokens int32 [steps, rows] for
    the first `rows` slots (the ROWS bucket holding the highest slot fed; rows of slots not in
    `feed` are meaningless). The cache then holds the fed token and the first steps - 1 sampled
    ones of each row."""
    rows = bucket(max(feed) + 1, ROWS, self.batch)
    toks = np.zeros(rows, np.int32)
    # A row not fed still writes K/V rows: at that slot's next positions (masked until the slot
    # decodes there and overwrites them), never over a row the slot holds already.
    pos = np.minimum(self.positions[:rows], self.engine.max_context - steps).astype(np.int32)
    for r, (tok, _) in feed.items():
      toks[r] = tok
    seeds, counters, t, k, p, bias = row_args(rows, self.engine.cfg.vocab_size,
                                              {r: q for r, (_, q) in feed.items()})
    mask = row_masks(rows, self.engine.cfg.vocab_size, masks)
    e = self.engine
    put = jax.device_put
    out, self.cache = decode_slots_fn(
        e.weights, self.cache, put(toks), put(pos), put(seeds), put(counters), put(t), put(k),
        put(p), None if bias is None else put(bias), None if mask is None else put(mask),
        cfg=e.cfg, ex=e.ex,
        kv_len=e.kv_len(int(pos.max()) + steps), rows=rows, steps=steps, greedy=not t.any())
    for s in feed:
      self.positions[s] += steps
    return np.asarray(out)


# In place (the batch's cache donated): an eager update would copy all B slots' cache first.
@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(cache: dict, small: dict, slot) -> dict:
  """`small` (a b=1 cache) written into slot `slot` of `cache` (the batch axis is 1)."""
  return {k: jax.lax.dynamic_update_slice_in_dim(cache[k], small[k].astype(cache[k].dtype),
                                                 slot, 1) for k in cache}


@functools.partial(jax.jit, donate_argnums=0)
def _move_slot(cache: dict, src, dst) -> dict:
  return {k: jax.lax.dynamic_update_slice_in_dim(
      v, jax.lax.dynamic_slice_in_dim(v, src, 1, 1), dst, 1) for k, v in cache.items()}


_masked = jax.jit(apply_mask)
_argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))


def row_args(n: int, vocab: int, params: dict[int, tuple]):
  """sample_rows' per-row arrays for `n` rows from `params`: row -> (temperature, top_k, top_p,
  seed, token index, logit bias {token id: bias}); rows not named are greedy. Returns (seeds,
  counters, temperature, top_k, top_p, bias or None)."""
  t, k, p = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
  seeds, counters = np.zeros((n, 2), np.uint32), np.zeros(n, np.int32)
  bias = None
  for r, (temp, top_k, top_p, seed, index, row_bias) in params.items():
    t[r], k[r], p[r], seeds[r], counters[r] = temp, top_k, top_p, seed_words(seed), index
    if row_bias:
      bias = np.zeros((n, vocab), np.float32) if bias is None else bias
      bias[r, list(row_bias)] = list(row_bias.values())
  return seeds, counters, t, k, p, bias


def row_masks(n: int, vocab: int, masks: dict[int, np.ndarray] | None) -> np.ndarray | None:
  """The packed masks int32 [n, ceil(vocab / 32)] of `masks` (row -> a matcher's mask, which
  may cover fewer tokens than the model's logits: those past it are never allowed); rows not
  named allow every token. None where no row is masked."""
  if not masks:
    return None
  out = np.full((n, mask_words(vocab)), -1, np.int32)
  for r, m in masks.items():
    out[r] = 0
    out[r, :min(len(m), out.shape[1])] = m[:out.shape[1]]
  return out


def sample(logits: jax.Array, params: tuple, mask: np.ndarray | None = None) -> int:
  """The token sampled from `logits` [vocab] with sample's row parameters `params` (a prefill's
  first token), among the tokens `mask` allows (a packed mask, or None: all)."""
  seeds, counters, t, k, p, bias = row_args(1, logits.shape[-1], {0: params})
  logits = logits[None]
  if mask is not None:
    logits = _masked(logits, row_masks(1, logits.shape[-1], {0: mask}))
  if not t.any():  # greedy: the argmax, without sampling's sort
    return int(_argmax(logits if bias is None else logits + bias)[0])
  return int(sample_rows(logits, seeds, counters, t, k, p, bias)[0])
