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

The package is the public module; its parts: jaxvt.engine.runtime (the Engine), jaxvt.engine.steps
(exec_for, plan, place and XLA's workspace of a plan) and `load` here, which composes them.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from jaxvt import ffi, inputs, loader, programs
from jaxvt.engine.runtime import ClosedWeights, Engine  # noqa: F401 (public)
from jaxvt.engine.steps import (exec_for, place, plan, plan_workspace_bytes,  # noqa: F401
                                xla_workspace_of)
from jaxvt.errors import JaxvtError, escape
from jaxvt.ffi import numerics as numerics_mod
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.loader import Model, open_model
from jaxvt.model.layers import NUMERICS, Exec  # noqa: F401 (public)
from jaxvt.model_fns import (DECODE_CHUNK, KV_BUCKETS, PREFILL_BUCKETS,  # noqa: F401 (public)
                             PREFILL_CHUNK, bucket, decode_fn, decode_loop_fn, decode_sample_fn,
                             first_token_fn, prefill_chunks, prefill_fn, xla_workspace_bytes)
from jaxvt.offload import expert_cache
from jaxvt.offload.expert_cache import stats as expert_cache_stats  # noqa: F401 (public)
from jaxvt.offload.host_tier import HostTier
from jaxvt.offload.placement import Placed
from jaxvt.parallel import mesh as mesh_mod
from jaxvt.parallel.mesh import layout
from jaxvt.sampling import (Generation, GenerationStats, SamplingParams,  # noqa: F401 (public)
                            row_key)


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
