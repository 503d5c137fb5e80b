"""A batched session over an Engine: a cache of B slots. Each request is prefilled alone (b=1),
from the longest prefix the prefix cache holds (jaxvt.prefix), into a b=1 cache whose leaves are
then written into its slot. The requests are kept in slots 0..n-1 (the scheduler compacts them,
`move` moves the caches), and one decode program steps the first ROWS-bucket of slots that holds
them at their own positions: a step of one request reads one token's routed experts, not B
rows'. Rows in the bucket without a request decode a dummy token and are ignored (a slot's
every leaf is written again when its next request is prefilled into it). A finished request's
slot is stored in the prefix cache, so the next turn of its conversation reuses it.

The session's state on the device is the cache and, once a request asks for penalties, each
slot's counts of its generated tokens (`start`, `decode` and `move` keep them); every method that
changes it (prefill, start, decode, move, finish) is a call another process can replay."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.model_fns import bucket, decode_slots_fn
from jaxvt.prefix import PrefixCache
from jaxvt.sampling import (TOP_LOGPROBS, apply_mask, mask_words, sample_rows, seed_words,
                            token_logprobs)

ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode programs' row counts (few programs, little waste)


class BatchSession:
  """B slots of `engine`'s cache; `positions[s]` is where slot s's next token goes."""

  def __init__(self, engine, batch: int, prefix: PrefixCache | None = None):
    self.engine = engine
    self.batch = batch
    self.prefix = prefix
    self.cache = engine.new_cache(batch)  # every leaf's batch axis is 1 (decoder.init_cache)
    self.positions = np.zeros(batch, np.int32)
    # int32 [B, vocab] on the device: each slot's counts of the tokens its request generated
    # (the penalties' input), kept by the decode program; made when a request first needs it
    self.counts: jax.Array | None = None
    # the last dispatch's sampled tokens [steps, rows] on the device, and its steps
    self._sampled: tuple[jax.Array, int] | None = None

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
    if self.counts is not None:
      self.counts = _move_row(self.counts, src, dst)

  def start(self, slot: int, token: int, penalized: bool) -> None:
    """`slot`'s request generated its first token (`first_token`): its counts row starts from
    it. The counts are made when a `penalized` request first needs them."""
    if self.counts is None and penalized:
      self.counts = jnp.zeros((self.batch, self.engine.cfg.vocab_size), jnp.int32)
    if self.counts is not None:
      self.counts = _start_row(self.counts, slot, token)

  def decode(self, feed: dict[int, tuple], steps: int = 1, logprobs: bool = False,
             masks: dict[int, np.ndarray] | None = None):
    """`steps` decode steps of the requests in `feed`: slot -> (the token to feed at its
    position, then sample's row parameters); `masks`: slot -> its packed allowed tokens
    (sampling.apply_mask; only with steps=1: the next mask depends on this token). Returns (the
    sampled tokens int32 [steps, rows] for the first `rows` slots (the ROWS bucket holding the
    highest slot fed; rows of slots not in `feed` are meaningless), and with `logprobs` the numpy
    arrays of decode_slots_fn's logprobs, else None). The cache then holds the fed token and the
    first steps - 1 sampled ones of each row."""
    return self.read(self.dispatch(feed, steps, logprobs, masks))

  def dispatch(self, feed: dict[int, tuple], steps: int = 1, logprobs: bool = False,
               masks: dict[int, np.ndarray] | None = None, ahead: bool = False):
    """`decode` without waiting for it: returns its program's outputs on the device (`read`
    waits for them). With `ahead`, each row is fed the last token the previous dispatch sampled
    in it (that program may still be running; the same slots, and each row's parameters with
    its token index past that program's tokens) and `feed`'s tokens are ignored: the host need
    not have read them."""
    rows = bucket(max(feed) + 1, ROWS, self.batch)
    toks = np.zeros(rows, np.int32)
    # A row not fed still writes K/V rows: at that slot's next positions (masked until the slot
    # decodes there and overwrites them), never over a row the slot holds already.
    pos = np.minimum(self.positions[:rows], self.engine.max_context - steps).astype(np.int32)
    for r, (tok, _) in feed.items():
      toks[r] = tok
    seeds, counters, t, k, p, bias, fp, pp = row_args(rows, self.engine.cfg.vocab_size,
                                                      {r: q for r, (_, q) in feed.items()})
    mask = row_masks(rows, self.engine.cfg.vocab_size, masks)
    e = self.engine
    put = jax.device_put
    if ahead:
      last, last_steps = self._sampled
      fed = _last_row(last, last_steps - 1)
    else:
      fed = put(toks)
    penalized = fp.any() or pp.any()  # else the counts are not needed and not kept
    out, self.cache, counts, lps = decode_slots_fn(
        e.weights, self.cache, fed, put(pos), put(seeds), put(counters), put(t), put(k),
        put(p), None if bias is None else put(bias), self.counts if penalized else None,
        put(fp) if penalized else None, put(pp) if penalized else None,
        None if mask is None else put(mask), cfg=e.cfg, ex=e.ex,
        kv_len=e.kv_len(int(pos.max()) + steps), rows=rows, steps=steps, greedy=not t.any(),
        logprobs=logprobs)
    self._sampled = (out, steps)
    if penalized:
      self.counts = counts
    for s in feed:
      self.positions[s] += steps
    return out, lps

  @staticmethod
  def read(handle):
    """A dispatch's (tokens, logprobs or None) as numpy arrays (waits for its program)."""
    out, lps = handle
    return np.asarray(out), None if lps is None else tuple(np.asarray(a) for a in lps)


_last_row = jax.jit(lambda out, i: out[i])


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


@functools.partial(jax.jit, donate_argnums=0)
def _move_row(counts, src, dst):
  return jax.lax.dynamic_update_slice_in_dim(counts, jax.lax.dynamic_slice_in_dim(
      counts, src, 1, 0), dst, 0)


@functools.partial(jax.jit, donate_argnums=0)
def _start_row(counts, slot, token):
  """Row `slot` of the counts: its request's first generated token, once."""
  row = jnp.zeros((1, counts.shape[1]), counts.dtype).at[0, token].set(1)
  return jax.lax.dynamic_update_slice_in_dim(counts, row, slot, 0)


_masked = jax.jit(apply_mask)
_argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))
_first_logprobs = jax.jit(lambda logits, tok: token_logprobs(
    logits[None], jnp.asarray(tok, jnp.int32)[None], TOP_LOGPROBS))


def row_args(n: int, vocab: int, params: dict[int, tuple]):
  """sample_rows' per-row arrays for `n` rows from `params`: row -> (temperature, top_k, top_p,
  seed, token index, logit bias {token id: bias}, frequency penalty, presence penalty); rows not
  named are greedy and unpenalized. Returns (seeds, counters, temperature, top_k, top_p, bias or
  None, frequency, presence)."""
  t, k, p = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
  seeds, counters = np.zeros((n, 2), np.uint32), np.zeros(n, np.int32)
  fp, pp = np.zeros(n, np.float32), np.zeros(n, np.float32)
  bias = None
  for r, (temp, top_k, top_p, seed, index, row_bias, freq, pres) in params.items():
    t[r], k[r], p[r], seeds[r], counters[r] = temp, top_k, top_p, seed_words(seed), index
    fp[r], pp[r] = freq, pres
    if row_bias:
      bias = np.zeros((n, vocab), np.float32) if bias is None else bias
      bias[r, list(row_bias)] = list(row_bias.values())
  return seeds, counters, t, k, p, bias, fp, pp


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


def first_token(logits: jax.Array, params: tuple, logprobs: bool = False,
                mask: np.ndarray | None = None):
  """A request's first token, sampled from its prefill's `logits` [vocab] with sample's row
  parameters `params` among the tokens `mask` allows (a packed mask, or None: all). Returns
  (token, None or token_logprobs' three arrays of that row)."""
  tok = sample(logits, params, mask)
  lps = None
  if logprobs:
    lps = tuple(np.asarray(a)[0] for a in _first_logprobs(logits, tok))
  return tok, lps


def sample(logits: jax.Array, params: tuple, mask: np.ndarray | None = None) -> int:
  """The token sampled from `logits` [vocab] with sample's row parameters `params` (a prefill's
  first token: nothing generated yet, so the penalties take nothing off), among the tokens
  `mask` allows (a packed mask, or None: all)."""
  seeds, counters, t, k, p, bias, _, _ = row_args(1, logits.shape[-1], {0: params})
  logits = logits[None]
  if mask is not None:
    logits = _masked(logits, row_masks(1, logits.shape[-1], {0: mask}))
  if not t.any():  # greedy: the argmax, without sampling's sort
    return int(_argmax(logits if bias is None else logits + bias)[0])
  return int(sample_rows(logits, seeds, counters, t, k, p, bias)[0])
