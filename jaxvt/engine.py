"""open → plan → place → Engine: jitted prefill / decode and generate (the notebook API).

    engine = jaxvt.load()                       # the embedded default model
    out = engine.generate("The capital of France is", max_tokens=16)
    logits, cache = prefill_fn(engine.weights, cache, tokens, positions, valid, last, ...)

`load` is the public steps with defaults, which a benchmark or a notebook may also compose:

    model = open_model(path)                    # jaxvt.loader: config, declarations, bytes
    par = layout(model.cfg)                     # the 1 x 1 mesh on one device, or a mesh
    placed = plan(model, offload_gb=4, mesh=par)   # jaxvt.offload: where each weight goes
    weights = place(model, placed, par, host=HostTier())   # jaxvt.loader: the weights pytree
    engine = Engine(model.cfg, exec_for(platform, kernels, par), weights, tokenizer, max_context)

`prefill_fn` and `decode_fn` (jaxvt.model_fns) are pure jitted functions of (weights, cache,
tokens, ...); the Engine holds what they need and keeps the books (buckets, positions, keys).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi, inputs, loader, programs
from jaxvt.errors import JaxvtError, escape
from jaxvt.ffi import numerics
from jaxvt.ffi import numerics as numerics_mod
from jaxvt.ffi.tuning import Products
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.loader import Model, open_model
from jaxvt.model import sharding
from jaxvt.model.config import ModelConfig
from jaxvt.model.layers import NUMERICS, Exec
from jaxvt.model.sharding import Par
from jaxvt.model_fns import (DECODE_CHUNK, KV_BUCKETS, PREFILL_BUCKETS, PREFILL_CHUNK, bucket,
                             decode_fn, decode_loop_fn, decode_sample_fn,  # noqa: F401 (public)
                             first_token_fn, prefill_chunks, prefill_fn,
                             xla_workspace_bytes)
from jaxvt.offload import placement as placement_mod
from jaxvt.offload import cost, expert_cache, host_tier
from jaxvt.offload.expert_cache import stats as expert_cache_stats  # noqa: F401 (public)
from jaxvt.offload.host_tier import HostTier
from jaxvt.offload.placement import Placed
from jaxvt.offload.plan import Policy, parse_overrides
from jaxvt.offload.schedule import ExpertSchedule
from jaxvt.parallel import mesh as mesh_mod
from jaxvt.parallel.mesh import layout
from jaxvt.sampling import row_key
from jaxvt.sampling import (Generation, GenerationStats,  # noqa: F401 (engine.Generation*)
                            SamplingParams)


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


def plan_workspace_bytes(model: Model, placement, ex: Exec, max_context: int,
                         prefill_chunk: int, cache=None) -> int | None:
  """xla_workspace_bytes of the engine that placing `model`'s weights as `placement` says
  would give, from the weights' shapes alone (loader.abstract_weights): nothing is placed. One
  device (the 1 x 1 mesh of `ex.par`). `cache` (expert_cache.CachePlan): the weights carry an
  expert cache's tables (its size does not change the programs)."""
  weights = loader.abstract_weights(model, placement, ex.par)
  if cache is not None:
    weights[expert_cache.CACHE] = expert_cache.abstract_tables(cache, model.cfg.n_layers, ex.par)
  return xla_workspace_bytes(Engine(cfg=model.cfg, ex=ex, weights=weights, tokenizer=None,
                                    max_context=max_context,
                                    prefill_chunk=min(prefill_chunk, max_context)))


def xla_workspace_of(model: Model, ex: Exec, max_context: int, prefill_chunk: int = PREFILL_CHUNK,
                     seconds: list | None = None,
                     cached: bool = True) -> Callable[[object], int | None]:
  """plan()'s `workspace_of` (one device): plan_workspace_bytes of each candidate, timed; with
  `cached`, of the program with the expert cache the candidate's host-tier experts would get."""
  def workspace_of(p):
    t = time.perf_counter()
    cp = (expert_cache.cache_plan(p, model.cfg.n_experts, 1 << 62, "lru", 1)
          if cached and ex.kernels else None)
    ws = plan_workspace_bytes(model, lambda n, l: p.placement.get((n, l), "device"), ex,
                              max_context, prefill_chunk, cp)
    (seconds if seconds is not None else []).append(time.perf_counter() - t)  # load's check
    return ws
  return workspace_of


def exec_for(platform: str, kernels: bool, par: Par, deterministic: bool = True,
             numerics_mode: str | None = None, batch_invariant: bool = False) -> Exec:
  """How jaxvt executes on `platform` over the mesh of `par`: ggml's arithmetic on the CPU (where
  jaxvt agrees with llama.cpp), ggml's integer products and float32 elsewhere on GPUs ("q8",
  numerics.default_mode); the kernel rule is the device's row of jaxvt.ffi.tuning.TUNING, and
  host-tier experts move by the offload schedule. `deterministic` fixes XLA's algorithm choices
  (jaxvt.programs); one GPU compiles decode with XLA's concurrent command-buffer scheduling.
  `numerics_mode` (Exec.numerics) replaces the platform's default contract; `batch_invariant`
  takes the platform's row of jaxvt.ffi.tuning.INVARIANT."""
  gpu = platform != "cpu" and kernels
  return Exec(kernels=kernels, numerics=numerics_mode or numerics.default_mode(platform), par=par,
              products=cost.products_for(platform, batch_invariant) if kernels else Products(),
              deterministic=deterministic, concurrent=gpu and getattr(par, "size", 1) == 1,
              schedule=ExpertSchedule() if kernels else None)


def plan(model: Model, *, offload_gb: float | str = 0.0, device_gb: float | None = None,
         force: bool = False, device=None, max_context: int = 2048, kernels: bool | None = None,
         offload_pattern: tuple[str, ...] = (), mesh: sharding.Sizes | None = None,
         prefill_chunk: int = PREFILL_CHUNK,
         workspace_of: Callable[[object], int | None] | None = None,
         expert_cache_gb: float | str | None = "auto", expert_cache_policy: str = "lru") -> Placed:
  """Where each of `model`'s weights goes, checked against the device's memory (JaxvtError for
  a plan that does not fit, unless `force`). `offload_gb`: GiB of weights for the host tier, or
  "auto"; `device_gb`: behave as if the device had this many GiB; `offload_pattern`: regexes
  (`REGEX[=host|device]`) forcing matching weights' tier, counted against the budget; `kernels`:
  whether the FFI kernels run (default: whether they exist for `device`). With `mesh` the plan
  is one device's (its shards of every weight, its KV heads), the budgets are per device, and
  the same plan holds for every device of the mesh (a MeshSpec, or the Par of a layout).
  `prefill_chunk`: tokens per prefill call (capped at max_context): the workspace planned for is
  a chunk this long's. `workspace_of(plan)` (plan_workspace_bytes): XLA's workspace of a
  candidate plan's program, which replaces the estimate where memory is planned tight
  (Placed.settle). `expert_cache_gb`: device memory for the expert cache, which keeps recently
  used host-tier routed experts on the device ("auto" or None: what the plan leaves free; 0:
  none; jaxvt.offload.expert_cache); `expert_cache_policy`: "lru" or "lfru"."""
  if prefill_chunk < 1:
    raise JaxvtError(f"the prefill chunk {prefill_chunk} must be at least 1 token")
  expert_cache_gb = inputs.expert_cache_gb(expert_cache_gb)
  device = device or jax.devices()[0]
  kernels = ffi.available(device.platform) if kernels is None else kernels
  cfg, units, copies, n = model.cfg, model.units, None, 1
  if mesh is not None:
    sharding.check(model.cfg, mesh)
    units, copies = sharding.device_units(units, model.decls, model.cfg, mesh)
    cfg, n = sharding.local_config(model.cfg, mesh), mesh.tp * mesh.ep
  return placement_mod.plan_for_engine(
      cfg, model.decls, units, offload_gb=offload_gb, device_gb=device_gb, force=force,
      device=device, max_context=max_context, kernels=kernels,
      policy=Policy(overrides=parse_overrides(offload_pattern)), host_copies=copies, devices=n,
      prefill_chunk=prefill_chunk, workspace_of=workspace_of, expert_cache_gb=expert_cache_gb,
      expert_cache_policy=expert_cache_policy)


def place(model: Model, placed: Placed, par: Par, *, host=None,
          progress: Callable[[int], None] | None = None, times=None) -> dict:
  """`model`'s weights where `placed` puts them, over the mesh of `par` and in the host tier
  `host` (needed when the plan offloads; its tables told to the extension for prefill's copies,
  ffi.prefetch), with the plan's expert cache beside them (where `model` declares the routed
  stacks the cache is for); `times` (loader.LoadTimes) collects where placing spent its time.
  On a GPU the stacks go up through pinned staging buffers (host_tier.staging_for)."""
  weights = loader.place(model, placed.placement, par=par, host=host, progress=progress,
                         times=times, staging=host_tier.staging_for)
  if host is not None:
    host.register_tables(weights)
  if placed.expert_cache is not None and expert_cache.attachable(weights, placed.expert_cache):
    weights = expert_cache.attach(weights, placed.expert_cache, par)
  return weights



def _file_tokenizer(m: Model, given: Tokenizer | None = None) -> Tokenizer:
  """`given` where it was built from m's file as it is now (JaxvtError otherwise), else m's
  tokenizer built from its metadata."""
  if given is None:
    return Tokenizer.from_gguf_metadata(m.gguf.metadata, source=m.path, identity=m.gguf.identity)
  if given.identity is None or given.identity != m.gguf.identity:
    raise JaxvtError(f"load(tokenizer=...): that tokenizer was not built from {escape(m.path)} "
                     "as it is now; build it from this file's GGUFFile, or pass none")
  return given


def load(model: str | None = None, *, max_context: int | None = None,
         offload_gb: float | str = 0.0,
         device_gb: float | None = None, force: bool = False, kernels: bool | None = None,
         progress: Callable[[int], None] | None = None, device=None,
         on_plan: Callable[[Placed], None] | None = None, offload_pattern: tuple[str, ...] = (),
         mesh: str | None = None, prefill_chunk: int = PREFILL_CHUNK, deterministic: bool = True,
         compile_cache: bool | str | None = None,
         while_loading: Callable[[Engine], object] | None = None,
         tokenizer: Tokenizer | None = None, expert_cache_gb: float | str | None = "auto",
         expert_cache_policy: str = "lru", numerics: str | None = None,
         batch_invariant: bool = False) -> Engine:
  """Opens a GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1), plans placement,
  places the weights and returns an Engine: `open_model`, `plan`, `place` with defaults.
  `max_context`: tokens of context to allocate, at most the model's trained context (None: 2048,
  or the trained context where that is shorter, said in a JaxvtWarning).
  `offload_gb`, `device_gb`, `offload_pattern`, `kernels` and `prefill_chunk` as for `plan`;
  `mesh`: "tp=N", "ep=N" or "tp=N,ep=M" shards the model over that many local devices
  (jaxvt.parallel), and then `offload_gb` and `device_gb` are per device; `on_plan` sees the plan
  before anything is placed. `deterministic`: the same bits in every process and at every
  budget (jaxvt.programs; False lets XLA:GPU time its GEMM algorithms). `compile_cache`: JAX's
  persistent compilation cache under this directory; None: $JAXVT_COMPILE_CACHE (0 turns it
  off) or ~/.cache/jaxvt ($XDG_CACHE_HOME/jaxvt); False: off. A cache configured in JAX
  already is left as it is; beside it the export store keeps the programs traced (jaxvt.exports;
  JAXVT_EXPORT_STORE=0: off). `while_loading(engine)`: runs on this thread while loader threads
  place the weights, given an Engine whose tokenizer is built and whose weights are only their
  shapes and shardings (loader.abstract_weights): compile there what the first call will run
  (`engine.warm_up(n)`), and the loaded Engine runs those very programs (it inherits what was
  warmed); running the model there fails. On a mesh of several devices it runs after the
  weights are placed. `tokenizer`: one built from this very file (its GGUFFile.identity; the
  CLI builds it before JAX starts), taken instead of building another; JaxvtError if it is
  another file's, or the file changed since. `expert_cache_gb`, `expert_cache_policy`: as for
  `plan` (on_plan may resize the cache: Placed.with_expert_cache). `numerics`: the arithmetic
  contract (Exec.numerics, docs/NUMERICS.md); None: the platform's ("ggml" on the CPU, whose
  tokens do not depend on scheduling; "llamacpp" is llama.cpp's CPU arithmetic exactly, prompt
  and decode). `batch_invariant`: a GPU's tokens the same however a request was scheduled, at a
  speed cost (jaxvt.ffi.tuning.GPU_INVARIANT_PRODUCTS; the CPU's default already is)."""
  t0 = time.perf_counter()
  if numerics is not None and numerics not in NUMERICS:
    raise JaxvtError(f"numerics {numerics!r} is not one of {', '.join(NUMERICS)}")
  max_context = None if max_context is None else inputs.max_context(max_context)
  offload_gb = inputs.offload_gb(offload_gb)
  device_gb = inputs.device_gb(device_gb)
  expert_cache_gb = inputs.expert_cache_gb(expert_cache_gb)
  programs.use_compile_cache(programs.cache_root(compile_cache, os.environ),
                             programs.env_flag(os.environ, "JAXVT_EXPORT_STORE"))
  m = open_model(model)
  cfg = m.cfg
  max_context = inputs.context_for(max_context, cfg.context_length)
  if max_context < 1 or max_context > cfg.context_length:
    raise JaxvtError(f"--max-context {max_context} is outside 1..{cfg.context_length} (the "
                     "model's trained context); pick a value in that range")
  par = layout(cfg, mesh_mod.parse(mesh), device)
  device = par.devices[0]
  with programs.BackendStart(device):  # XLA's lazy start, beside the plan (programs.py)
    if kernels is None:
      kernels = ffi.available(device.platform)
    if numerics in ("ggml", "llamacpp") and kernels and device.platform != "cpu":
      raise JaxvtError(f"numerics {numerics!r} has CPU kernels only; on {device.platform} use "
                       f"{numerics_mod.default_mode(device.platform)!r} or f32")
    overlap = while_loading is not None and par.size == 1
    if tokenizer is not None or overlap:  # the early Engine needs it before anything is placed
      tokenizer = _file_tokenizer(m, tokenizer)
    else:  # built last (below), checked before anything is placed
      Tokenizer.check_metadata(m.gguf.metadata)
    ex = exec_for(device.platform, kernels, par, deterministic, numerics, bool(batch_invariant))
    # Planned tight, the workspace estimate gives way to XLA's analysis of each candidate plan's
    # largest prefill, compiled from the weights' shapes before placing (Placed.settle; 1 device).
    seconds = []
    workspace_of = xla_workspace_of(
        m, ex, max_context, prefill_chunk, seconds,
        cached=expert_cache.expected(expert_cache_gb, device.platform, device_gb))
    placed = plan(m, offload_gb=offload_gb, device_gb=device_gb, force=force, device=device,
                  max_context=max_context, kernels=kernels, offload_pattern=offload_pattern,
                  mesh=par, prefill_chunk=prefill_chunk,
                  workspace_of=workspace_of if par.size == 1 else None,
                  expert_cache_gb=expert_cache_gb, expert_cache_policy=expert_cache_policy)
    if on_plan:
      on_plan(placed)
    host_tier = HostTier() if placed.host_bytes else None
    times = loader.LoadTimes()
    early, warm_seconds = None, 0.0
    tp = time.perf_counter()
    placing = lambda: place(m, placed, par, host=host_tier, progress=progress, times=times)
    try:
      if overlap:  # compile on this thread while loader threads place the weights
        job = loader.Placing(placing)
        try:
          shapes = loader.abstract_weights(m, placed.placement, par)
          if placed.expert_cache is not None:
            shapes[expert_cache.CACHE] = expert_cache.abstract_tables(placed.expert_cache,
                                                                      cfg.n_layers, par)
          early = Engine(cfg=cfg, ex=ex, weights=shapes,
                         tokenizer=tokenizer, max_context=max_context, path=m.path,
                         prefill_chunk=placed.shape.prefill_chunk)
          while_loading(early)
        finally:
          warm_seconds = time.perf_counter() - tp
          job.result()  # the weights are written before anything is freed; placing's error first
        weights, place_seconds = job.result(), job.seconds
      else:
        weights = placing()
        place_seconds = time.perf_counter() - tp
    except BaseException:
      if host_tier is not None:
        host_tier.close()
      raise
  eng = Engine(cfg=cfg, ex=ex, weights=weights, tokenizer=tokenizer,
               max_context=max_context, path=m.path,
               load_seconds=time.perf_counter() - t0 - sum(seconds), plan=placed,
               host_tier=host_tier, prefill_chunk=placed.shape.prefill_chunk,
               check_seconds=sum(seconds), warm_seconds=warm_seconds,
               place_seconds=place_seconds, load_times=times)
  if early is not None:
    eng.warmed = early.warmed  # compiled against the weights' shapes: the same programs
  # A mesh planned tight (offloaded, or --device-gb) checks its plan again with XLA's analysis of
  # the largest prefill per device (one device did so before placing). The tokenizer, unless
  # given or needed early, is built last: its vocabulary's many small objects, alive while the
  # weights were placed, shared heap arenas with objects JAX keeps (RSS grew ~1 MiB a load).
  try:
    if par.size > 1 and (placed.host_bytes or device_gb is not None):
      ws = xla_workspace_bytes(eng)
      if ws is not None:
        placed.recheck(ws, force=force)
    if eng.tokenizer is None:
      t1 = time.perf_counter()
      eng.tokenizer = _file_tokenizer(m)
      eng.load_seconds += time.perf_counter() - t1
    if while_loading is not None and not overlap:
      t1 = time.perf_counter()
      while_loading(eng)
      eng.warm_seconds = time.perf_counter() - t1
  except BaseException:
    eng.close()
    raise
  eng.memory = placed.breakdown
  return eng
