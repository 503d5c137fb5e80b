"""The Engine a load returns: a loaded model's programs run with the books kept (prompt and
KV buckets, prefill chunks, positions, sampling keys): prefill, decode_step and generate, the
programs compiled ahead (warm_up, warm_up_buckets), and close, which frees the weights
(ClosedWeights stands in for them afterwards). jaxvt.engine builds it (load) and re-exports it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import inputs
from jaxvt.errors import JaxvtError, escape
from jaxvt.model import sharding
from jaxvt.model.config import ModelConfig
from jaxvt.model.layers import Exec
from jaxvt.model_fns import (DECODE_CHUNK, KV_BUCKETS, PREFILL_BUCKETS, PREFILL_CHUNK, bucket,
                             decode_fn, decode_loop_fn, first_token_fn, prefill_chunks, prefill_fn)
from jaxvt.sampling import Generation, GenerationStats, SamplingParams, row_key


class ClosedWeights:
  """What `Engine.weights` is after `close()`: passing it to a jitted function, indexing or
  iterating it raises the one-line error (the arrays were deleted, the host tier freed)."""

  def __init__(self, path: str):
    self.path = path

  def _refuse(self, *_):
    raise JaxvtError(f"the Engine of {escape(self.path)} was closed and its weights freed; "
                     "load the model again with jaxvt.load(...)")

  __getitem__ = __iter__ = __len__ = keys = values = items = _refuse


jax.tree_util.register_pytree_node(ClosedWeights, ClosedWeights._refuse,
                                   lambda aux, children: ClosedWeights(""))


@dataclasses.dataclass
class Engine:
  """A loaded model. Every method refuses (JaxvtError) once `close()` has run; close waits for
  the device work in flight, deletes the weights' arrays and frees the host tier, so a stale
  reference to a weight fails in JAX ("deleted") instead of reading freed memory."""
  cfg: ModelConfig
  ex: Exec
  weights: dict
  tokenizer: object
  max_context: int
  path: str = ""
  load_seconds: float = 0.0
  plan: object = None
  host_tier: object = None
  memory: object = None  # the device-memory breakdown the planner checked
  decode_chunk: int = DECODE_CHUNK  # decode steps per device program in generate
  prefill_chunk: int = PREFILL_CHUNK  # tokens per prefill call (the plan's RunShape.prefill_chunk)
  check_seconds: float = 0.0  # load's XLA memory check (ahead-of-time compiles), not in load
  warm_seconds: float = 0.0  # load's while_loading (in load_seconds where it overlapped placing)
  place_seconds: float = 0.0  # of load_seconds: placing the weights (its thread's wall time)
  load_times: object = None  # loader.LoadTimes: the placing threads' read / upload / host time
  warmed: set = dataclasses.field(default_factory=set, repr=False)  # Engine.warm_up's record
  _closed: bool = dataclasses.field(default=False, init=False, repr=False)

  def _check_open(self) -> None:
    if self._closed:
      raise JaxvtError(f"this Engine ({escape(self.path)}) was closed; load it again: jaxvt.load()")

  def new_cache(self, batch: int = 1) -> dict:
    self._check_open()
    batch = inputs.whole("batch", batch, 1, 1 << 16)
    # ggml numerics: llama.cpp's default f16 KV cache, q and the attention probabilities rounded
    # as ggml rounds them (jaxvt.ffi.numerics.attention); each device holds its heads' cache
    kv = jnp.float16 if self.ex.ggml else jnp.float32
    return sharding.init_cache(self.cfg, self.ex.par, batch, self.cache_len, kv_dtype=kv)

  @property
  def cache_len(self) -> int:
    """Positions a cache holds: max_context rounded up to a multiple of 8, so that every
    program reads a kv_len the attention kernel takes (the positions past max_context are never
    real ones): a row's attention arithmetic never changes with the kv_len other rows need."""
    return -(-self.max_context // 8) * 8

  def kv_len(self, n: int) -> int:
    self._check_open()
    return bucket(n, KV_BUCKETS, self.cache_len)

  def prefill_shapes(self, n: int, start: int = 0) -> tuple[tuple[int, int], ...]:
    """(T, kv_len) of each prefill_fn call that prefill makes for `n` tokens from `start`."""
    self._check_open()
    return tuple((T, self.kv_len(start + off + T)) for off, _, T in
                 prefill_chunks(n, start, self.prefill_chunk, self.max_context))

  def decode_steps(self, remaining: int) -> int:
    """Steps of generate's next decode program with `remaining` tokens still to make: a power
    of two up to decode_chunk (few distinct programs, little waste)."""
    self._check_open()
    return min(self.decode_chunk, 1 << (remaining - 1).bit_length())

  def decode_calls(self, first: int, max_tokens: int) -> tuple[tuple[int, int, int], ...]:
    """(kv_len, steps, position) of each decode_loop_fn call generate makes after a prompt of
    `first` tokens when it makes all `max_tokens` tokens (no stop token): its decode programs."""
    out, made, pos = [], 1, first  # the first token comes from prefill
    while made < max_tokens and pos < self.max_context:
      steps = self.decode_steps(max_tokens - made)
      out.append((self.kv_len(pos + steps), steps, pos))
      made, pos = made + steps, pos + steps
    return tuple(out)

  def prefill(self, tokens: list[int], cache: dict | None = None, start: int = 0):
    """Runs `tokens` (one sequence) from position `start`, in calls of at most
    `self.prefill_chunk` tokens (prefill_chunks); returns (logits [vocab] after the last token,
    cache)."""
    self._check_open()
    tokens = inputs.token_ids(tokens, self.cfg.vocab_size, "the tokens")
    start = inputs.whole("start", start, 0, self.max_context)
    n = len(tokens)
    if not n:
      raise JaxvtError("prefill needs at least one token")
    if start + n > self.max_context:
      raise JaxvtError(f"the prompt has {n} tokens, more than --max-context {self.max_context}"
                       f"{' allows after ' + str(start) + ' cached' if start else ''}; "
                       "shorten it or raise --max-context")
    cache = self.new_cache(1) if cache is None else cache
    for off, m, T in prefill_chunks(n, start, self.prefill_chunk, self.max_context):
      logits, cache = self._prefill_call(tokens[off:off + m], cache, start + off, T)
    return logits, cache

  def _prefill_call(self, tokens: list[int], cache: dict, start: int, T: int):
    """One prefill program of T >= len(tokens) positions from `start`."""
    args, kv_len = self._prefill_args(tokens, start, T)
    logits, cache = prefill_fn(self.weights, cache, *args, cfg=self.cfg, ex=self.ex,
                               kv_len=kv_len)
    return logits[0], cache

  def _prefill_args(self, tokens: list[int], start: int, T: int):
    """prefill_fn's (tokens, positions, valid, last) for one call, and its kv_len."""
    n = len(tokens)
    toks = np.zeros((1, T), np.int32)
    toks[0, :n] = tokens
    pos = (start + np.arange(T, dtype=np.int32))[None]
    valid = (np.arange(T) < n)[None]
    put = jax.device_put  # not jnp.asarray, which compiles (or loads) a program for each
    last = np.asarray([n - 1], np.int32)
    return (put(toks), put(pos), put(valid), put(last)), self.kv_len(start + T)

  def decode_step(self, cache: dict, token: int, position: int):
    """One token at `position`; returns (logits [vocab], cache)."""
    self._check_open()
    (token,) = inputs.token_ids([token], self.cfg.vocab_size, "the token")
    position = inputs.whole("position", position, 0, self.max_context - 1)
    logits, cache = decode_fn(self.weights, cache, jnp.asarray([[token]], jnp.int32),
                              jnp.asarray([[position]], jnp.int32), cfg=self.cfg, ex=self.ex,
                              kv_len=self.kv_len(position + 1))
    return logits[0], cache

  # ---- generation ----------------------------------------------------------------------
  def generate(self, prompt: str | list[int], max_tokens: int = 64,
               sampling: SamplingParams = SamplingParams(), seed: int = 0, chat: bool = False,
               on_text: Callable[[str], None] | None = None, prefix=None) -> Generation:
    """Generates up to `max_tokens` after `prompt` (text, or token ids), stopping early at the
    tokenizer's end-of-generation tokens; streams via on_text. The arguments are checked as the
    CLI checks its flags (jaxvt.inputs): a text prompt must be valid UTF-8 (str, or UTF-8
    bytes), ids must be in the vocabulary, and a `sampling.top_k` at or above the vocabulary
    keeps every token (it becomes 0). `prefix` (a jaxvt.prefix.PrefixCache of this engine):
    prefill only what it does not hold (stats.cached_tokens), and store the prompt (not the
    answer: decode runs past its end) in it for the next call."""
    self._check_open()
    max_tokens = inputs.max_tokens(max_tokens)
    seed = inputs.seed(seed)
    if not isinstance(sampling, SamplingParams):
      raise JaxvtError(f"sampling must be a jaxvt.SamplingParams, not {type(sampling).__name__}")
    top_k = inputs.top_k_for(sampling.top_k, self.cfg.vocab_size)
    if top_k != sampling.top_k:
      sampling = dataclasses.replace(sampling, top_k=top_k)
    tok = self.tokenizer
    ids = self.encode_prompt(prompt, chat)
    stats = GenerationStats(prompt_tokens=len(ids))
    # Prefill's programs compile (or load) before it runs, each decode program when first needed
    # (after the first token); compile_seconds counts them, the rates do not.
    stats.compile_seconds = self.warm_up(len(ids), 1, sampling)
    stops = set(tok.stop_ids)
    key = row_key(seed, sampling)  # the server's draws for this seed (sampling.sample_rows)
    stream = tok.stream_decoder()

    t0 = time.perf_counter()
    if prefix is None:
      logits, cache = self.prefill(ids)
    else:  # the first new token's logits are a full prefill's to rounding (tests/test_prefix.py)
      logits, cache, stats.cached_tokens = prefix.prefill(ids)
    nxt, key = first_token_fn(logits, key, params=sampling)
    nxt = int(nxt)
    stats.prefill_seconds = time.perf_counter() - t0

    out: list[int] = []
    pending: list[int] = []  # tokens read back from the device, in order
    inflight: list[jax.Array] = []  # tokens of decode calls dispatched, not yet read (oldest first)
    made = 1  # tokens sampled or being sampled (the first came from prefill)
    feed = (jax.device_put(np.asarray([nxt], np.int32)), len(ids))  # next call's token, position
    stopped_by = "max_tokens"
    pos = len(ids)  # where `nxt` goes when it is fed back
    compiling = 0.0  # of the decode time

    def dispatch() -> None:
      """Sends the next decode call (decode_steps of the tokens still to make; sampling on the
      device) without waiting for it."""
      nonlocal cache, key, made, feed, compiling
      n = self.decode_steps(max_tokens - made)
      args = (self.weights, cache, feed[0], jax.device_put(np.int32(feed[1])), key)
      static = dict(cfg=self.cfg, ex=self.ex, kv_len=self.kv_len(feed[1] + n), params=sampling,
                    steps=n)
      program = ("decode", static["kv_len"], n, sampling, made == 1)  # as warm_up keys it
      if program not in self.warmed:
        jax.block_until_ready(inflight)  # what runs meanwhile is decode time, not compile time
        tc = time.perf_counter()
        decode_loop_fn.compile(*args, **static)
        self.warmed.add(program)
        compiling += time.perf_counter() - tc
      toks, cache, key, last = decode_loop_fn(*args, **static)
      inflight.append(toks)
      made, feed = made + n, (last, feed[1] + n)
      stats.decode_steps += n

    t1 = time.perf_counter()
    # DECODE_CHUNK steps per device program (sampling on the device): the host reads tokens
    # once per call, and the next call is already on its way when it does (its token and cache
    # never leave the device). Tokens sampled after a stop are discarded (up to one call's).
    while True:
      if nxt in stops:
        stopped_by = "eos"
        break
      out.append(nxt)
      if on_text:
        piece = stream.push(nxt)
        if piece:
          on_text(piece)
      if len(out) >= max_tokens:
        break
      if pos >= self.max_context:
        stopped_by = "context"
        break
      if not pending:
        if not inflight:
          dispatch()
        if made < max_tokens and feed[1] < self.max_context:
          dispatch()
        pending = np.asarray(inflight.pop(0))[:, 0].tolist()
      nxt = pending.pop(0)
      pos += 1
    stats.decode_seconds = time.perf_counter() - t1 - compiling
    stats.compile_seconds += compiling
    stats.generated_tokens = len(out)
    if on_text:
      tail = stream.flush()
      if tail:
        on_text(tail)
    return Generation(out, tok.decode(out), stats, stopped_by)

  def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
    """Token ids of `prompt` (text, wrapped in the chat template with `chat`, or ids as given),
    checked as the CLI checks its flags (jaxvt.inputs): text must be valid UTF-8 (str, or UTF-8
    bytes), ids must be in the vocabulary."""
    self._check_open()
    if isinstance(prompt, (str, bytes, bytearray, memoryview)):
      prompt = inputs.text(prompt)
      if chat:
        prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
      ids = self.tokenizer.encode(prompt)
    else:
      ids = inputs.token_ids(prompt, self.cfg.vocab_size)
    if not ids:
      raise JaxvtError("the prompt is empty; pass --prompt TEXT")
    return ids

  def warm_up(self, prompt_tokens: int, max_tokens: int = 1,
              sampling: SamplingParams = SamplingParams()) -> float:
    """Compiles, ahead of time (or loads from the caches), every program `generate`
    runs for a prompt of `prompt_tokens` tokens and up to `max_tokens` new ones: each prefill
    chunk, the first token's sampling, and each decode program (decode_calls). Runs nothing on
    the model. Returns the seconds it took; 0 when this engine has them all. generate compiles
    what it has not got (prefill's programs before it runs, each decode program when first
    needed, after the first token is out) and counts that time apart from its rates."""
    self._check_open()
    n = inputs.whole("prompt_tokens", prompt_tokens, 1, inputs.INT32_MAX)
    max_tokens = inputs.max_tokens(max_tokens)
    top_k = inputs.top_k_for(sampling.top_k, self.cfg.vocab_size)  # as generate samples
    if top_k != sampling.top_k:
      sampling = dataclasses.replace(sampling, top_k=top_k)
    if n > self.max_context:
      self.prefill([0] * n)  # raises the prompt-too-long error
    pre = ("prefill", self.prefill_shapes(n), sampling)
    # A program is keyed by its static arguments and how its arguments are placed: the first
    # decode call takes first_token_fn's token and key, later calls those the previous call
    # returned on the device (so too the cache of prefill's first chunk).
    calls = [(("decode", kv, steps, sampling, i == 0), pos)
             for i, (kv, steps, pos) in enumerate(self.decode_calls(n, max_tokens))]
    if pre in self.warmed and all(k in self.warmed for k, _ in calls):
      return 0.0
    t0 = time.perf_counter()
    key = row_key(0, sampling)  # as generate makes its keys
    spec = lambda info, shardings: jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), info, shardings)
    cache = self.new_cache(1)
    for off, m, T in prefill_chunks(n, 0, self.prefill_chunk, self.max_context):
      args, kv_len = self._prefill_args([0] * m, off, T)
      compiled = prefill_fn.compile(self.weights, cache, *args, cfg=self.cfg, ex=self.ex,
                                    kv_len=kv_len)
      logits_sharding, cache_shardings = compiled.output_shardings
      cache = spec(compiled.out_info[1], cache_shardings)  # as the next call takes it
    if pre not in self.warmed:  # the first token: sampled from prefill's logits
      logits = jax.device_put(np.zeros((1, self.cfg.vocab_size), np.float32), logits_sharding)
      _, key = first_token_fn(logits[0], key, params=sampling)
      self.warmed.add(pre)
    token = jax.device_put(np.asarray([0], np.int32))
    for i, (k, pos) in enumerate(calls):
      if k in self.warmed and i:
        continue
      step = decode_loop_fn.compile(self.weights, cache, token, jax.device_put(np.int32(pos)), key,
                                    cfg=self.cfg, ex=self.ex, kv_len=k[1], params=sampling,
                                    steps=k[2])
      shardings = step.output_shardings
      self.warmed.add(k)
      if i == 0:  # later calls take the cache, key and token as this one returns them
        cache, key, token = (spec(step.out_info[j], shardings[j]) for j in (1, 2, 3))
    return time.perf_counter() - t0

  def warm_up_buckets(self, max_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                      background: bool = True) -> threading.Thread | float:
    """warm_up for every prompt-length bucket up to --max-context, so that a session whose
    prompts change length pays no compile later (each bucket compiles once, or loads from the
    compilation cache). With `background` it runs on a thread (XLA compiles without holding
    the GIL; nothing runs on the device) and returns the thread; else the seconds it took."""
    self._check_open()
    lengths = sorted({min(b, self.max_context) for b in PREFILL_BUCKETS})  # one per bucket

    def work() -> float:
      t0 = time.perf_counter()
      for n in lengths:
        self.warm_up(n, max_tokens, sampling)
      return time.perf_counter() - t0

    if not background:
      return work()
    thread = threading.Thread(target=work, name="jaxvt-warm-up", daemon=True)
    thread.start()
    return thread

  def close(self) -> None:
    """Waits for the device work in flight, deletes the weights' arrays and frees the host
    tier's pinned buffers; idempotent. The Engine refuses every call afterwards."""
    if self._closed:
      return
    self._closed = True
    # Every computation dispatched (also one an instant before an interrupt) has outputs among
    # the live arrays: once they are ready, no kernel still reads the freed host tier.
    for a in jax.live_arrays():
      try:
        a.block_until_ready()
      except Exception:  # deleted or donated since: nothing of it is running
        pass
    weights, self.weights = self.weights, ClosedWeights(self.path)
    for leaf in jax.tree_util.tree_leaves(weights):
      if isinstance(leaf, jax.Array) and not leaf.is_deleted():
        leaf.delete()
    if self.host_tier is not None:
      self.host_tier.close()
      self.host_tier = None

  def __enter__(self):
    self._check_open()
    return self

  def __exit__(self, *exc):
    self.close()
