"""open → plan → place → Engine: jitted prefill / decode and generate (the notebook API).

    engine = jaxvt.load()                       # the embedded default model
    out = engine.generate("The capital of France is", max_tokens=16)
    logits, cache = prefill_fn(engine.weights, cache, tokens, positions, valid, last, ...)

`load` is the public steps with defaults, which a benchmark or a notebook may also compose:

    model = open_model(path)                    # jaxvt.loader: config, declarations, bytes
    placed = plan(model, offload_gb=4)          # jaxvt.offload: where each weight goes, checked
    weights = place(model, placed, host=HostTier())   # jaxvt.loader: the weights pytree
    engine = Engine(model.cfg, exec_for(platform, kernels), weights, tokenizer, max_context)

`prefill_fn` and `decode_fn` are pure jitted functions of (weights, cache, tokens, ...); the
Engine only holds what they need and does the bookkeeping (buckets, positions, sampling keys).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi, inputs, loader
from jaxvt.errors import JaxvtError, escape
from jaxvt.ffi import numerics
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.loader import Model, open_model
from jaxvt.model import decoder
from jaxvt.model.config import ModelConfig
from jaxvt.model.declare import UnitBytes, declare
from jaxvt.model.layers import GPU_PRODUCTS, Exec, Products
from jaxvt.model.presets import PRESETS
from jaxvt.offload import placement as placement_mod
from jaxvt.offload.host_tier import HostTier
from jaxvt.offload.placement import Placed
from jaxvt.offload.plan import Q4_K_S_LIKE, Policy, estimate_bytes, parse_overrides
from jaxvt.parallel import load as pload
from jaxvt.parallel import mesh as mesh_mod
from jaxvt.parallel import shard
from jaxvt.parallel.mesh import MeshSpec
from jaxvt.sampling import SamplingParams, sample

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
  """decoder.forward, or with `ex.par` its shard_map over the mesh (jaxvt.parallel.shard)."""
  if ex.par is None:
    return decoder.forward(weights, cache, tokens, positions, cfg, ex, kv_len, valid=valid,
                           logits_at=logits_at)
  return shard.forward(weights, cache, tokens, positions, cfg, ex, kv_len, valid=valid,
                       logits_at=logits_at)


@functools.partial(jax.jit, static_argnames=("cfg", "ex", "kv_len"), donate_argnames=("cache",))
def prefill_fn(weights, cache, tokens, positions, valid, last, *, cfg: ModelConfig, ex: Exec,
               kv_len: int):
  """tokens/positions/valid [b, T]; last int32 [b] (index of each row's last real token).
  Returns (logits float32 [b, vocab] at `last`, cache)."""
  return _forward(weights, cache, tokens, positions, cfg, ex, kv_len, valid=valid, logits_at=last)


@functools.partial(jax.jit, static_argnames=("cfg", "ex", "kv_len"), donate_argnames=("cache",))
def decode_fn(weights, cache, tokens, positions, *, cfg: ModelConfig, ex: Exec, kv_len: int):
  """One decode step: tokens/positions int32 [b, 1] -> (logits float32 [b, vocab], cache)."""
  logits, cache = _forward(weights, cache, tokens, positions, cfg, ex, kv_len)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("cfg", "ex", "kv_len", "params"),
                   donate_argnames=("cache",))
def decode_sample_fn(weights, cache, tokens, positions, key, *, cfg: ModelConfig, ex: Exec,
                     kv_len: int, params: SamplingParams):
  """decode_fn fused with sampling: returns (next tokens int32 [b], cache)."""
  logits, cache = _forward(weights, cache, tokens, positions, cfg, ex, kv_len)
  return sample(logits[:, 0], key, params), cache


@functools.partial(jax.jit, static_argnames=("cfg", "ex", "kv_len", "params", "steps"),
                   donate_argnames=("cache",))
def decode_loop_fn(weights, cache, token, position, key, *, cfg: ModelConfig, ex: Exec,
                   kv_len: int, params: SamplingParams, steps: int):
  """`steps` decode steps in one device program, each sampling the token the next one feeds.

  token int32 [b]: the last sampled token (not yet in the cache); position int32 []: where it
  goes; key: the sampling key, split once per step as generate splits it. Returns (tokens int32
  [steps, b]: the sampled tokens in order, cache, key). Positions past the cache are dropped, so
  a caller stops consuming tokens at the context's end."""
  b = token.shape[0]

  def step(i, carry):
    cache, tok, key, out = carry
    key, sub = jax.random.split(key)
    pos = jnp.broadcast_to(position + i, (b, 1)).astype(jnp.int32)
    logits, cache = _forward(weights, cache, tok[:, None], pos, cfg, ex, kv_len)
    nxt = sample(logits[:, 0], sub, params)
    return cache, nxt, key, out.at[i].set(nxt)

  out = jnp.zeros((steps, b), jnp.int32)
  cache, _, key, out = jax.lax.fori_loop(0, steps, step, (cache, token.astype(jnp.int32), key, out))
  return out, cache, key


@dataclasses.dataclass
class GenerationStats:
  prompt_tokens: int = 0
  generated_tokens: int = 0
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0

  @property
  def prefill_tok_s(self) -> float:
    return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

  @property
  def decode_tok_s(self) -> float:
    # the first generated token comes from prefill; decode produced the rest
    n = max(self.generated_tokens - 1, 0)
    return n / self.decode_seconds if self.decode_seconds else 0.0


@dataclasses.dataclass
class Generation:
  tokens: list[int]
  text: str
  stats: GenerationStats
  stopped_by: str  # "eos" | "max_tokens" | "context"


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
  _closed: bool = dataclasses.field(default=False, init=False, repr=False)
  _inflight: object = dataclasses.field(default=None, init=False, repr=False)

  def _check_open(self) -> None:
    if self._closed:
      raise JaxvtError(f"this Engine ({escape(self.path)}) was closed; load the model again "
                       "with jaxvt.load(...)")

  # ---- pure pieces, bound to this model -------------------------------------------------
  def new_cache(self, batch: int = 1) -> dict:
    self._check_open()
    batch = inputs.whole("batch", batch, 1, 1 << 16)
    # ggml numerics: llama.cpp's default KV cache (type_k = type_v = f16); q and the attention
    # probabilities are rounded to it as ggml rounds them (jaxvt.ffi.numerics.attention).
    kv = jnp.float16 if self.ex.ggml else jnp.float32
    if self.ex.par is not None:  # each device holds its own heads' KV cache and state
      return shard.init_cache(self.cfg, self.ex.par, batch, self.max_context, kv_dtype=kv)
    return decoder.init_cache(self.cfg, batch, self.max_context, kv_dtype=kv)

  def kv_len(self, n: int) -> int:
    self._check_open()
    return bucket(n, KV_BUCKETS, self.max_context)

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
    n = len(tokens)
    toks = np.zeros((1, T), np.int32)
    toks[0, :n] = tokens
    pos = (start + np.arange(T, dtype=np.int32))[None]
    valid = (np.arange(T) < n)[None]
    logits, cache = prefill_fn(self.weights, cache, jnp.asarray(toks), jnp.asarray(pos),
                               jnp.asarray(valid), jnp.asarray([n - 1], jnp.int32),
                               cfg=self.cfg, ex=self.ex, kv_len=self.kv_len(start + T))
    self._inflight = logits
    return logits[0], cache

  def decode_step(self, cache: dict, token: int, position: int):
    """One token at `position`; returns (logits [vocab], cache)."""
    self._check_open()
    (token,) = inputs.token_ids([token], self.cfg.vocab_size, "the token")
    position = inputs.whole("position", position, 0, self.max_context - 1)
    logits, cache = decode_fn(self.weights, cache, jnp.asarray([[token]], jnp.int32),
                              jnp.asarray([[position]], jnp.int32), cfg=self.cfg, ex=self.ex,
                              kv_len=self.kv_len(position + 1))
    self._inflight = logits
    return logits[0], cache

  # ---- generation ----------------------------------------------------------------------
  def generate(self, prompt: str | list[int], max_tokens: int = 64,
               sampling: SamplingParams = SamplingParams(), seed: int = 0, chat: bool = False,
               on_text: Callable[[str], None] | None = None) -> Generation:
    """Generates up to `max_tokens` after `prompt` (text, or token ids), stopping early at the
    tokenizer's end-of-generation tokens; streams via on_text. The arguments are checked as the
    CLI checks its flags (jaxvt.inputs): a text prompt must be valid UTF-8 (str, or UTF-8
    bytes), ids must be in the vocabulary, and a `sampling.top_k` at or above the vocabulary
    keeps every token (it becomes 0)."""
    self._check_open()
    max_tokens = inputs.max_tokens(max_tokens)
    seed = inputs.seed(seed)
    if not isinstance(sampling, SamplingParams):
      raise JaxvtError(f"sampling must be a jaxvt.SamplingParams, not {type(sampling).__name__}")
    top_k = inputs.top_k_for(sampling.top_k, self.cfg.vocab_size)
    if top_k != sampling.top_k:
      sampling = dataclasses.replace(sampling, top_k=top_k)
    tok = self.tokenizer
    if isinstance(prompt, (str, bytes, bytearray, memoryview)):
      prompt = inputs.text(prompt)
      if chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
      ids = tok.encode(prompt)
    else:
      ids = inputs.token_ids(prompt, self.cfg.vocab_size)
    if not ids:
      raise JaxvtError("the prompt is empty; pass --prompt TEXT")
    stats = GenerationStats(prompt_tokens=len(ids))
    stops = set(tok.stop_ids)
    key = jax.random.key(seed)
    stream = tok.stream_decoder()

    t0 = time.perf_counter()
    logits, cache = self.prefill(ids)
    key, sub = jax.random.split(key)
    nxt = int(sample(logits[None], sub, sampling)[0])
    stats.prefill_seconds = time.perf_counter() - t0

    out: list[int] = []
    pending: list[int] = []  # tokens the device sampled ahead, in order
    stopped_by = "max_tokens"
    pos = len(ids)  # where `nxt` goes when it is fed back
    t1 = time.perf_counter()
    # Decode runs DECODE_CHUNK steps per device program (sampling on the device), so the host
    # reads tokens back once per chunk rather than once per token; tokens sampled after a stop
    # are discarded.
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
      if not pending:  # a power of two up to the chunk: few distinct programs, little waste
        n = min(self.decode_chunk, 1 << (max_tokens - len(out) - 1).bit_length())
        toks, cache, key = decode_loop_fn(
            self.weights, cache, jnp.asarray([nxt], jnp.int32), jnp.int32(pos), key,
            cfg=self.cfg, ex=self.ex, kv_len=self.kv_len(pos + n), params=sampling, steps=n)
        self._inflight = toks
        pending = np.asarray(toks)[:, 0].tolist()
      nxt = pending.pop(0)
      pos += 1
    stats.decode_seconds = time.perf_counter() - t1
    stats.generated_tokens = len(out)
    if on_text:
      tail = stream.flush()
      if tail:
        on_text(tail)
    return Generation(out, tok.decode(out), stats, stopped_by)

  def close(self) -> None:
    """Waits for the device work in flight, deletes the weights' arrays and frees the host
    tier's pinned buffers; idempotent. The Engine refuses every call afterwards."""
    if self._closed:
      return
    self._closed = True
    try:
      if self._inflight is not None:
        jax.block_until_ready(self._inflight)
    except Exception:  # deleted or donated since: nothing of it is running
      pass
    self._inflight = None
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


def xla_workspace_bytes(eng: "Engine") -> int | None:
  """XLA's memory analysis of the largest prefill program `eng` can run (temporaries plus
  outputs not aliased to inputs), compiled ahead of time; None where XLA gives no analysis.
  That program is a whole chunk (eng.prefill_chunk tokens) reading the whole KV cache (the last
  chunk of a prompt that fills --max-context)."""
  T = max(T for _, _, T in prefill_chunks(eng.max_context, 0, eng.prefill_chunk, eng.max_context))
  spec = jax.ShapeDtypeStruct
  i32 = lambda shape: spec(shape, jnp.int32)
  cache = jax.eval_shape(lambda: eng.new_cache(1))
  lowered = prefill_fn.lower(eng.weights, cache, i32((1, T)), i32((1, T)), spec((1, T), bool),
                             i32((1,)), cfg=eng.cfg, ex=eng.ex, kv_len=eng.kv_len(eng.max_context))
  ma = lowered.compile().memory_analysis()
  if ma is None:
    return None
  return int(ma.temp_size_in_bytes) + max(0, int(ma.output_size_in_bytes) -
                                          int(ma.alias_size_in_bytes))


def exec_for(platform: str, kernels: bool, par=None) -> Exec:
  """How jaxvt executes on `platform`: ggml's arithmetic on the CPU, where it makes jaxvt agree
  with llama.cpp; on GPUs ggml's integer products with every other step in float32 ("q8",
  numerics.default_mode), and GPU prefill's products of many rows take the tile kernels or
  staging by the crossovers of layers.GPU_PRODUCTS (Exec.products)."""
  gpu = platform != "cpu"
  return Exec(kernels=kernels, numerics=numerics.default_mode(platform), par=par,
              products=GPU_PRODUCTS if gpu and kernels else Products())


def open_preset(name: str) -> Model:
  """A weightless model of jaxvt.model.presets.PRESETS: its configuration and declarations, and
  each unit's bytes estimated for Q4_K_S-like formats (what `--plan --model NAME` plans)."""
  cfg = PRESETS[name][1]()
  decls = declare(cfg)
  units = [UnitBytes(n, l, b, -1) for (n, l), b in estimate_bytes(decls, Q4_K_S_LIKE).items()]
  return Model(name, cfg, decls, units)


def plan(model: Model, *, offload_gb: float | str = 0.0, device_gb: float | None = None,
         force: bool = False, device=None, max_context: int = 2048, kernels: bool | None = None,
         offload_pattern: tuple[str, ...] = (), mesh: MeshSpec | None = None,
         prefill_chunk: int = PREFILL_CHUNK) -> Placed:
  """Where each of `model`'s weights goes, checked against the device's memory (JaxvtError for
  a plan that does not fit, unless `force`). `offload_gb`: GiB of weights for the host tier, or
  "auto"; `device_gb`: behave as if the device had this many GiB; `offload_pattern`: regexes
  (`REGEX[=host|device]`) forcing matching weights' tier, counted against the budget; `kernels`:
  whether the FFI kernels run (default: whether they exist for `device`). With `mesh` the plan
  is one device's (its shards of every weight, its KV heads), the budgets are per device, and
  the same plan holds for every device of the mesh. `prefill_chunk`: tokens per prefill call
  (capped at max_context): the workspace planned for is a chunk this long's."""
  if prefill_chunk < 1:
    raise JaxvtError(f"the prefill chunk {prefill_chunk} must be at least 1 token")
  device = device or jax.devices()[0]
  kernels = ffi.available(device.platform) if kernels is None else kernels
  cfg, units, copies, n = model.cfg, model.units, None, 1
  if mesh is not None:
    shard.check(model.cfg, mesh)
    units, copies = shard.device_units(units, model.decls, model.cfg, mesh)
    cfg, n = shard.local_config(model.cfg, mesh), mesh.size
  return placement_mod.plan_for_engine(
      cfg, model.decls, units, offload_gb=offload_gb, device_gb=device_gb, force=force,
      device=device, max_context=max_context, kernels=kernels,
      policy=Policy(overrides=parse_overrides(offload_pattern)), host_copies=copies, devices=n,
      prefill_chunk=prefill_chunk)


def place(model: Model, placed: Placed, *, par=None, device=None, host=None,
          progress: Callable[[int], None] | None = None) -> dict:
  """`model`'s weights where `placed` puts them: on `device` (or over the mesh of `par`) and in
  the host tier `host` (needed when the plan offloads). Returns the weights pytree."""
  if par is not None:
    return pload.load_weights(model, par, placed.placement, host, progress)
  return loader.place(model, placed.placement, host=host, device=device, progress=progress)


def load(model: str | None = None, *, max_context: int = 2048, offload_gb: float | str = 0.0,
         device_gb: float | None = None, force: bool = False, kernels: bool | None = None,
         progress: Callable[[int], None] | None = None, device=None,
         on_plan: Callable[[Placed], None] | None = None, offload_pattern: tuple[str, ...] = (),
         mesh: str | None = None, prefill_chunk: int = PREFILL_CHUNK) -> Engine:
  """Opens a GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1), plans placement,
  places the weights and returns an Engine: `open_model`, `plan`, `place` with defaults.
  `offload_gb`, `device_gb`, `offload_pattern`, `kernels` and `prefill_chunk` as for `plan`;
  `mesh`: "tp=N", "ep=N" or "tp=N,ep=M" shards the model over that many local devices
  (jaxvt.parallel), and then `offload_gb` and `device_gb` are per device; `on_plan` sees the plan
  before anything is placed."""
  t0 = time.perf_counter()
  max_context = inputs.max_context(max_context)
  offload_gb = inputs.offload_gb(offload_gb)
  device_gb = inputs.device_gb(device_gb)
  m = open_model(model)
  cfg = m.cfg
  if max_context < 1 or max_context > cfg.context_length:
    raise JaxvtError(f"--max-context {max_context} is outside 1..{cfg.context_length} (the "
                     "model's trained context); pick a value in that range")
  par = _par(mesh, cfg, device)
  device = par.mesh.devices.flat[0] if par else device or jax.devices()[0]
  if kernels is None:
    kernels = ffi.available(device.platform)
  Tokenizer.check_metadata(m.gguf.metadata)  # built last (below), checked before anything is placed
  placed = plan(m, offload_gb=offload_gb, device_gb=device_gb, force=force, device=device,
                max_context=max_context, kernels=kernels, offload_pattern=offload_pattern,
                mesh=par.spec if par else None, prefill_chunk=prefill_chunk)
  if on_plan:
    on_plan(placed)
  host_tier = HostTier() if placed.host_bytes else None
  try:
    weights = place(m, placed, par=par, device=device, host=host_tier, progress=progress)
  except BaseException:
    if host_tier is not None:
      host_tier.close()
    raise
  ex = exec_for(device.platform, kernels, par)
  eng = Engine(cfg=cfg, ex=ex, weights=weights, tokenizer=None, max_context=max_context,
               path=m.path, load_seconds=time.perf_counter() - t0, plan=placed,
               host_tier=host_tier, prefill_chunk=placed.shape.prefill_chunk)
  # Where memory is planned tight (weights offloaded, or --device-gb), the estimate of the
  # program's workspace is replaced by XLA's own analysis of the largest prefill, and the plan
  # checked again before anything runs (one ahead-of-time compile; one device only).
  # The tokenizer is built last, from the file: its vocabulary is tens of thousands of small
  # Python objects, and alive while the weights were placed they would share the heap's arenas
  # with small objects JAX keeps for the life of the process, which would then keep those
  # arenas (1 MiB each) after close: RSS grew by about 1 MiB per load/close.
  try:
    if par is None and (placed.host_bytes or device_gb is not None):
      ws = xla_workspace_bytes(eng)
      if ws is not None:
        placed.recheck(ws, force=force)
    t1 = time.perf_counter()
    eng.tokenizer = Tokenizer.from_gguf_metadata(m.gguf.metadata, source=m.path)
    eng.load_seconds += time.perf_counter() - t1
  except BaseException:
    eng.close()
    raise
  eng.memory = placed.breakdown
  return eng


def _par(mesh: str | None, cfg: ModelConfig, device):
  """The parallel layout for `mesh` ("tp=2", ...), or None for one device."""
  spec = mesh_mod.parse(mesh)
  if spec is None:
    return None
  if device is not None:
    raise JaxvtError("--mesh runs on the mesh's devices; drop the explicit device")
  shard.check(cfg, spec)
  return mesh_mod.Par(mesh_mod.build(spec), head_sharded=shard.head_sharded(cfg, spec))


def plan_report(path: str, *, offload_gb: float | str = 0.0, device_gb: float | None = None,
                max_context: int = 2048, mesh: str | None = None,
                offload_pattern: tuple[str, ...] = ()) -> str:
  """`--plan`: the plan for the file at `path` (or a PRESETS name, weightless) without placing
  any weights; with `mesh`, one device's plan (its shards, its budget)."""
  weightless = path.lower() in PRESETS and not os.path.exists(path)
  m = open_preset(path.lower()) if weightless else open_model(path)
  placed = plan(m, offload_gb=offload_gb, device_gb=device_gb, force=True,
                max_context=max_context, kernels=True, offload_pattern=offload_pattern,
                mesh=mesh_mod.parse(mesh))
  head = (f"{PRESETS[m.path][0]} (weightless; {m.cfg.n_layers} layers)" if weightless else
          f"{path} ({m.cfg.arch}, {m.cfg.n_layers} layers)")
  return f"model: {head}\n" + placed.plan_text(mesh)
