"""The model's jitted programs, pure functions of (weights, cache, tokens, ...): prefill_fn,
decode_fn, decode_sample_fn and decode_loop_fn (jaxvt.engine.Engine drives them; a notebook can
call them directly), the bucket rules that pick their static lengths, and xla_workspace_bytes:
XLA's own memory analysis of the largest prefill program, which the planner takes instead of
its estimate where memory is planned tight (jaxvt.offload.placement.Placed.settle).
"""

from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp

from jaxvt import programs
from jaxvt.model import sharding
from jaxvt.model.config import ModelConfig
from jaxvt.model.layers import Exec
from jaxvt.sampling import (TOP_LOGPROBS, SamplingParams, adjust_logits, sample, sample_rows,
                            token_logprobs)

PREFILL_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# Tokens per prefill call: longer prompts run in chunks of at most this many (capped at
# --max-context), so the largest prefill program, whose workspace the planner budgets and XLA's
# memory analysis re-checks, is this many tokens, not the prompt's length.
PREFILL_CHUNK = 2048
KV_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144)
DECODE_CHUNK = 16  # decode steps generate runs per device program


def bucket(n: int, buckets: Iterable[int], cap: int) -> int:
  """The smallest bucket >= n, capped at `cap` (which must be >= n)."""
  for b in buckets:
    if b >= n:
      return min(b, cap)
  return cap


def prefill_chunks(n: int, start: int, chunk: int, max_context: int) -> list[tuple[int, int, int]]:
  """The prefill calls that run n tokens from position `start` (start + n <= max_context) in
  chunks of at most `chunk` tokens: (offset into the tokens, tokens, program length T) each, T the
  chunk's bucket, never more than `chunk` nor past max_context."""
  out, i = [], 0
  while i < n:
    m = min(chunk, n - i)
    out.append((i, m, bucket(m, PREFILL_BUCKETS, min(chunk, max_context - start - i))))
    i += m
  return out


def _forward(weights, cache, tokens, positions, cfg: ModelConfig, ex: Exec, kv_len: int,
             valid=None, logits_at=None):
  """decoder.forward as a shard_map over `ex.par`'s mesh (jaxvt.model.sharding; one device is
  the 1 x 1 mesh)."""
  return sharding.forward(weights, cache, tokens, positions, cfg, ex, kv_len, valid=valid,
                          logits_at=logits_at)


# programs.jit: jax.jit with the compiler options `ex.deterministic` / `ex.concurrent` ask for
# (jaxvt.programs); the concurrent scheduling is decode's (prefill keeps XLA's default)
@programs.jit(concurrent=False, static_argnames=("cfg", "ex", "kv_len"), donate_argnames=("cache",))
def prefill_fn(weights, cache, tokens, positions, valid, last, *, cfg: ModelConfig, ex: Exec,
               kv_len: int):
  """tokens/positions/valid [b, T]; last int32 [b] (index of each row's last real token).
  Returns (logits float32 [b, vocab] at `last`, cache)."""
  return _forward(weights, cache, tokens, positions, cfg, ex, kv_len, valid=valid, logits_at=last)


@programs.jit(static_argnames=("cfg", "ex", "kv_len"), donate_argnames=("cache",))
def decode_fn(weights, cache, tokens, positions, *, cfg: ModelConfig, ex: Exec, kv_len: int):
  """One decode step: tokens/positions int32 [b, 1] -> (logits float32 [b, vocab], cache)."""
  logits, cache = _forward(weights, cache, tokens, positions, cfg, ex, kv_len)
  return logits[:, 0], cache


@programs.jit(static_argnames=("cfg", "ex", "kv_len", "rows", "steps", "greedy", "logprobs"),
              donate_argnames=("cache", "counts"))
def decode_slots_fn(weights, cache, tokens, positions, seeds, counters, temperature, top_k, top_p,
                    bias, counts=None, frequency=None, presence=None, *, cfg: ModelConfig,
                    ex: Exec, kv_len: int, rows: int, steps: int, greedy: bool,
                    logprobs: bool = False):
  """`steps` decode steps of the first `rows` sequences of a cache of B >= rows (a server's
  slots, kept packed from slot 0), each row sampled with its own parameters (sample_rows; with
  `greedy`, every row's argmax). tokens int32 [rows] (the last sampled, not yet in the cache),
  positions int32 [rows] (where they go); seeds, counters (the rows' next token indices),
  temperature, top_k, top_p: sample_rows' per-row arguments; bias float32 [rows, vocab] or None.
  counts int32 [B, vocab] (each slot's generated-token counts) with frequency and presence
  float32 [rows]: the penalties (sampling.penalize), the counts of the first `rows` slots updated
  with each sampled token; None: no penalties. With `logprobs`, each step's log-softmax of the
  model's logits (sampling.token_logprobs) is returned as well.
  Returns (tokens int32 [steps, rows], cache, counts, logprobs: None or (sampled token's
  float32 [steps, rows], top ids int32 [steps, rows, TOP_LOGPROBS], their float32 [steps, rows,
  TOP_LOGPROBS])). The other slots are neither read nor written, so a step of a few sequences
  reads the routed experts those few choose, not B rows' worth."""
  part = {k: jax.lax.slice_in_dim(v, 0, rows, axis=1) for k, v in cache.items()}
  cnt = None if counts is None else counts[:rows]
  penalties = None if counts is None else (frequency, presence)

  def step(i, carry):
    part, tok, cnt, out, lps = carry
    logits, part = _forward(weights, part, tok[:, None], (positions + i)[:, None], cfg, ex,
                            kv_len)
    raw = logits[:, 0]
    adjusted = adjust_logits(raw, bias, None if cnt is None else (cnt, *penalties))
    nxt = (jnp.argmax(adjusted, axis=-1).astype(jnp.int32) if greedy else
           sample_rows(adjusted, seeds, counters + i, temperature, top_k, top_p))
    if cnt is not None:
      cnt = cnt.at[jnp.arange(rows), nxt].add(1)
    if lps is not None:
      lps = tuple(a.at[i].set(b) for a, b in zip(lps, token_logprobs(raw, nxt)))
    return part, nxt, cnt, out.at[i].set(nxt), lps

  out = jnp.zeros((steps, rows), jnp.int32)
  lps = None
  if logprobs:
    lps = (jnp.zeros((steps, rows), jnp.float32), jnp.zeros((steps, rows, TOP_LOGPROBS),
                                                            jnp.int32),
           jnp.zeros((steps, rows, TOP_LOGPROBS), jnp.float32))
  part, _, cnt, out, lps = jax.lax.fori_loop(
      0, steps, step, (part, tokens.astype(jnp.int32), cnt, out, lps))
  cache = {k: jax.lax.dynamic_update_slice_in_dim(cache[k], part[k].astype(cache[k].dtype), 0, 1)
           for k in cache}
  if counts is not None:
    counts = jax.lax.dynamic_update_slice_in_dim(counts, cnt, 0, 0)
  return out, cache, counts, lps


@programs.jit(static_argnames=("cfg", "ex", "kv_len", "params"), donate_argnames=("cache",))
def decode_sample_fn(weights, cache, tokens, positions, key, *, cfg: ModelConfig, ex: Exec,
                     kv_len: int, params: SamplingParams):
  """decode_fn fused with sampling: returns (next tokens int32 [b], cache)."""
  logits, cache = _forward(weights, cache, tokens, positions, cfg, ex, kv_len)
  return sample(logits[:, 0], key, params), cache


@functools.partial(jax.jit, static_argnames=("params",))
def first_token_fn(logits, key, *, params: SamplingParams):
  """generate's first token, from prefill's logits [vocab]: the key split once as decode splits
  it per step, the token sampled with the split-off key. Returns (token int32 [], key). One
  program where splitting and sampling eagerly compiled (or loaded) about eight."""
  key, sub = jax.random.split(key)
  return sample(logits[None], sub, params)[0], key


@programs.jit(static_argnames=("cfg", "ex", "kv_len", "params", "steps"),
              donate_argnames=("cache",))
def decode_loop_fn(weights, cache, token, position, key, *, cfg: ModelConfig, ex: Exec,
                   kv_len: int, params: SamplingParams, steps: int):
  """`steps` decode steps in one device program, each sampling the token the next one feeds.

  token int32 [b]: the last sampled token (not yet in the cache); position int32 []: where it
  goes; key: the sampling key, split once per step as generate splits it. Returns (tokens int32
  [steps, b]: the sampled tokens in order, cache, key, last int32 [b]: the last of them, the
  next call's `token`, so that call can be dispatched before these tokens are read back).
  Positions past the cache are dropped, so a caller stops consuming tokens at the context's
  end."""
  b = token.shape[0]

  def step(i, carry):
    cache, tok, key, out = carry
    key, sub = jax.random.split(key)
    pos = jnp.broadcast_to(position + i, (b, 1)).astype(jnp.int32)
    logits, cache = _forward(weights, cache, tok[:, None], pos, cfg, ex, kv_len)
    nxt = sample(logits[:, 0], sub, params)
    return cache, nxt, key, out.at[i].set(nxt)

  out = jnp.zeros((steps, b), jnp.int32)
  cache, last, key, out = jax.lax.fori_loop(0, steps, step,
                                            (cache, token.astype(jnp.int32), key, out))
  return out, cache, key, last


MEMORY_KIND = "memory"  # the export store's record of a program's workspace bytes


def xla_workspace_bytes(eng) -> int | None:
  """XLA's memory analysis of the largest prefill program `eng` can run (temporaries plus
  outputs not aliased to inputs), compiled ahead of time; None where XLA gives no analysis.
  That program is a whole chunk (eng.prefill_chunk tokens) reading the whole KV cache (the last
  chunk of a prompt that fills --max-context). With the export store on (the compile cache's
  switches) the figure is kept under the program's key, so a later run with the same program
  reads it instead of tracing and compiling."""
  T = max(T for _, _, T in prefill_chunks(eng.max_context, 0, eng.prefill_chunk, eng.max_context))
  spec = jax.ShapeDtypeStruct
  i32 = lambda shape: spec(shape, jnp.int32)
  cache = jax.eval_shape(lambda: eng.new_cache(1))
  args = (eng.weights, cache, i32((1, T)), i32((1, T)), spec((1, T), bool), i32((1,)))
  kw = dict(cfg=eng.cfg, ex=eng.ex, kv_len=eng.kv_len(eng.max_context))
  store, key = programs.export_store(), prefill_fn.file_key(*args, **kw)
  if key is not None:
    kept = store.get_json(key, MEMORY_KIND)
    if isinstance(kept, int) and kept >= 0:
      return kept
  ma = prefill_fn.lower(*args, **kw).compile().memory_analysis()
  if ma is None:
    return None
  ws = int(ma.temp_size_in_bytes) + max(0, int(ma.output_size_in_bytes) -
                                        int(ma.alias_size_in_bytes))
  if key is not None:
    store.put_json(key, MEMORY_KIND, ws)
  return ws
