"""The public steps `load` composes, each usable on its own (a benchmark or a notebook does):
how jaxvt executes on a platform (exec_for), where each weight goes (plan, with XLA's workspace
of a candidate plan: plan_workspace_bytes, xla_workspace_of) and the weights placed there
(place). jaxvt.engine re-exports them.
"""

from __future__ import annotations

import time
from typing import Callable

import jax

from jaxvt import ffi, inputs, loader
from jaxvt.engine.runtime import Engine
from jaxvt.errors import JaxvtError
from jaxvt.ffi import numerics
from jaxvt.ffi.tuning import Products
from jaxvt.loader import Model
from jaxvt.model import sharding
from jaxvt.model.layers import Exec
from jaxvt.model.sharding import Par
from jaxvt.model_fns import PREFILL_CHUNK, xla_workspace_bytes
from jaxvt.offload import placement as placement_mod
from jaxvt.offload import cost, expert_cache, host_tier
from jaxvt.offload.placement import Placed
from jaxvt.offload.plan import Policy, parse_overrides
from jaxvt.offload.schedule import ExpertSchedule


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
