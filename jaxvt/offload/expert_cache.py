"""The device expert cache: how many experts it holds (pure) and its memory (an edge).

A decode step reads each token's k routed experts of every host-tier MoE layer over the bus.
Spare device memory (what the plan's weights, KV cache, workspace and slack leave) holds
`slots` experts of each such layer: the ones its tokens used last (LRU) or most often lately
(LFRU). jaxvt.ffi.expert_cache has the decision and the contract; the experts kernels read hits
from the cache and write each miss's bytes into its slot as they read them, so a hit costs no
extra copy and the products keep their bits.

`cache_plan` sizes it from the offload plan and a byte budget (pure, unit-tested).
`ExpertCache` allocates it on the device as arrays XLA's allocator counts, and gives the
programs their addresses (CacheTables, kept in the weights under CACHE) and the host the
counters (stats).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.errors import JaxvtError
from jaxvt.ffi import expert_cache as xc
from jaxvt.gguf.formats import row_bytes
from jaxvt.offload.plan import GiB, HOST, Plan
from jaxvt.qweight import FMT_MASK, QWeight, split_u64

ROUTED = ("moe.w_gate", "moe.w_up", "moe.w_down")
STAGE = dict(zip(ROUTED, xc.STAGES))
CACHE = "moe.cache"  # the weights' key of the CacheTables
POLICIES = xc.POLICIES


def _round256(n: int) -> int:
  return -(-n // 256) * 256


@dataclasses.dataclass(frozen=True)
class CachePlan:
  """`slots` slots in each cached layer (a layer with a host-tier routed stack). parts: per
  routed stack, the layers whose experts of that stack the cache holds (its host-tier layers);
  slot_bytes: per routed stack, the bytes of a slot (its largest expert, rounded up to 256);
  expert_bytes: per cached layer, the bytes one expert of its host-tier stacks reads."""
  slots: int
  experts: int
  policy: str
  parts: tuple[tuple[str, tuple[int, ...]], ...]
  slot_bytes: tuple[tuple[str, int], ...]
  expert_bytes: tuple[tuple[int, int], ...]

  @property
  def layers(self) -> tuple[int, ...]:
    return tuple(sorted({l for _, ls in self.parts for l in ls}))

  @property
  def state_bytes(self) -> int:
    return 4 * len(self.layers) * xc.layer_words(self.experts, self.slots)

  @property
  def data_bytes(self) -> int:
    sb = dict(self.slot_bytes)
    return sum(len(ls) * self.slots * sb[n] for n, ls in self.parts)

  @property
  def nbytes(self) -> int:
    return self.data_bytes + self.state_bytes

  def describe(self) -> str:
    share = self.slots / self.experts
    size = (f"{self.nbytes / GiB:.2f} GiB" if self.nbytes >= GiB // 100 else
            f"{self.nbytes / (1 << 20):.1f} MiB")
    return (f"expert cache: {size}, {self.slots} of {self.experts} experts "
            f"({share:.0%}) in each of {len(self.layers)} host-tier MoE layers, "
            f"{self.policy.upper()} (the prediction counts {share:.0%} of their routed reads "
            "as hits, as under uniform routing; routing that reuses experts hits more)")


def cache_plan(plan: Plan, experts: int, budget_bytes: int, policy: str = "lru",
               max_call_slots: int = 8) -> CachePlan | None:
  """The largest cache within `budget_bytes` for `plan`'s host-tier routed experts, `experts`
  experts a layer: the same slot count in every cached layer (each layer reads k experts a
  token), at most `experts` and 1024. None where nothing is in the host tier or the budget holds
  fewer slots a layer than a call routes (`max_call_slots`, a token's k: the cache would evict
  what the token is still reading)."""
  if policy not in POLICIES:
    raise JaxvtError(f"--expert-cache-policy {policy!r} is not one of {', '.join(POLICIES)}")
  if experts <= 0 or budget_bytes <= 0:
    return None
  per_expert: dict[str, dict[int, int]] = {n: {} for n in ROUTED}
  for u, k in zip(plan.units, plan.kinds):
    if u.name in per_expert and k == HOST and u.layer is not None:
      per_expert[u.name][u.layer] = u.nbytes // experts
  parts = tuple((n, tuple(sorted(per_expert[n]))) for n in ROUTED if per_expert[n])
  if not parts:
    return None
  slot_bytes = tuple((n, _round256(max(per_expert[n].values()))) for n, _ in parts)
  sb = dict(slot_bytes)
  layers = sorted({l for _, ls in parts for l in ls})
  per_slot = sum(len(ls) * sb[n] for n, ls in parts) + 4 * 2 * len(layers)
  fixed = 4 * len(layers) * (xc.HEADER_WORDS + experts)
  slots = min(experts, xc.MAX_SLOTS, max(0, budget_bytes - fixed) // per_slot)
  if slots < max(1, max_call_slots):
    return None
  ebytes = tuple((l, sum(per_expert[n].get(l, 0) for n in ROUTED)) for l in layers)
  return CachePlan(int(slots), experts, policy, parts, slot_bytes, ebytes)


def expected(gb, platform: str, device_gb: float | None) -> bool:
  """Whether a plan with host-tier routed experts gets a cache for `--expert-cache-gb` `gb`:
  not for 0, nor for "auto" on the CPU backend without --device-gb, whose device memory is the
  host's own RAM (memory.DeviceFacts.host_memory; Placed.with_expert_cache decides so)."""
  if gb == 0:
    return False
  return not (gb in (None, "auto") and platform == "cpu" and device_gb is None)


@dataclasses.dataclass(frozen=True)
class CacheStats:
  """Routed-expert reads of the cached layers since the cache was made, one per (token, slot):
  hits read from the cache, misses over the bus; *_bytes: the bytes they read, a missed expert
  counted once per slot routed to it. fills: the experts copied into the cache, one per distinct
  expert a call missed (the experts kernels read such an expert over the bus once a call,
  however many of the call's rows or tokens route to it); fill_bytes: their bytes, what the
  misses cost the bus where every missed expert found a slot."""
  hits: int
  misses: int
  hit_bytes: int
  host_bytes: int
  fills: int = 0
  fill_bytes: int = 0

  @property
  def hit_rate(self) -> float:
    n = self.hits + self.misses
    return self.hits / n if n else 0.0

  def __sub__(self, other: "CacheStats") -> "CacheStats":
    return CacheStats(self.hits - other.hits, self.misses - other.misses,
                      self.hit_bytes - other.hit_bytes, self.host_bytes - other.host_bytes,
                      self.fills - other.fills, self.fill_bytes - other.fill_bytes)


class ExpertCache:
  """The cache's device memory for `cp`, for the placed routed stacks `weights[n]` (QWeight).

  Each stack's slots are one uint8 array and the layers' state blocks one int32 array, made by
  XLA on `device` (so its allocator counts them) and never passed to a program: the programs get
  their addresses (tables()). The arrays live as long as this object, which the CacheTables in
  the weights keep."""

  def __init__(self, cp: CachePlan, weights: dict, device, table_sharding=None):
    self.plan = cp
    sb = dict(cp.slot_bytes)
    n_layers = weights[ROUTED[0]].meta.n_layers
    words = xc.layer_words(cp.experts, cp.slots)
    state = np.concatenate([xc.new_layer_state(cp.experts, cp.slots, cp.policy)
                            for _ in cp.layers])
    self.state = jax.device_put(state, device)
    self.data = {}
    for n, ls in cp.parts:
      size = len(ls) * cp.slots * sb[n]
      self.data[n] = jax.jit(lambda s=size: jnp.zeros((s,), jnp.uint8),
                             out_shardings=jax.sharding.SingleDeviceSharding(device))()
    jax.block_until_ready((self.state, *self.data.values()))
    base = self.state.unsafe_buffer_pointer()
    stab = np.zeros(n_layers, np.uint64)
    for i, l in enumerate(cp.layers):
      stab[l] = base + 4 * i * words
    ctabs = {}
    for n in ROUTED:
      addr = np.zeros(n_layers, np.uint64)
      parts = dict(cp.parts).get(n, ())
      fillable = self._fillable(weights[n]) if parts else None
      for i, l in enumerate(parts):
        if fillable[l]:
          addr[l] = self.data[n].unsafe_buffer_pointer() + i * cp.slots * sb[n]
      ctabs[STAGE[n]] = split_u64(addr)
    put = lambda a: jax.device_put(a, table_sharding or device)
    self._tables = xc.CacheTables(put(split_u64(stab)), {s: put(t) for s, t in ctabs.items()},
                                  {STAGE[n]: sb.get(n, 0) for n in ROUTED}, owner=self)

  @staticmethod
  def _fillable(w: QWeight) -> list[bool]:
    """Per layer, whether the kernels can copy its experts as they read them: 16-byte aligned
    experts in the host tier (the GPU kernels copy whole 16-byte words). The table and formats
    are read from the device once."""
    table, fmts = np.asarray(w.table), np.asarray(w.fmts)
    out = []
    for l in range(w.meta.n_layers):
      addr = int(table[l, 0]) | (int(table[l, 1]) << 32)
      per = w.meta.rows * row_bytes(int(fmts[l]) & FMT_MASK, w.meta.cols)
      out.append(addr % 16 == 0 and per % 16 == 0)
    return out

  def tables(self) -> xc.CacheTables:
    return self._tables

  def stats(self) -> CacheStats:
    """The counters, read from the device after the work queued so far."""
    words = xc.layer_words(self.plan.experts, self.plan.slots)
    state = np.asarray(jnp.copy(self.state)).reshape(len(self.plan.layers), words)
    eb = dict(self.plan.expert_bytes)
    hits = misses = hit_bytes = host_bytes = fills = fill_bytes = 0
    for l, row in zip(self.plan.layers, state):
      st = xc.LayerState.from_words(row)
      hits, misses, fills = hits + st.hits, misses + st.misses, fills + st.fills
      hit_bytes += st.hits * eb[l]
      host_bytes += st.misses * eb[l]
      fill_bytes += st.fills * eb[l]
    return CacheStats(hits, misses, hit_bytes, host_bytes, fills, fill_bytes)


def attachable(weights: dict, cp: CachePlan) -> bool:
  """Whether `weights` hold, as QWeights, the routed stacks the cache `cp` is for."""
  return all(isinstance(weights.get(n), QWeight) for n, _ in cp.parts)


def attach(weights: dict, cp: CachePlan, par) -> dict:
  """`weights` (placed on the one device of `par`) with the expert cache `cp` allocated beside
  them: its tables under CACHE, replicated like the other whole weights."""
  whole = jax.sharding.NamedSharding(par.mesh, jax.sharding.PartitionSpec())
  cache = ExpertCache(cp, weights, par.devices[0], whole)
  return {**weights, CACHE: cache.tables()}


def abstract_tables(cp: CachePlan, n_layers: int, par) -> xc.CacheTables:
  """attach's tables as jax.ShapeDtypeStruct leaves (for compiling before placing)."""
  whole = jax.sharding.NamedSharding(par.mesh, jax.sharding.PartitionSpec())
  t = jax.ShapeDtypeStruct((n_layers, 2), jnp.uint32, sharding=whole)
  sb = dict(cp.slot_bytes)
  return xc.CacheTables(t, {s: t for s in xc.STAGES}, {STAGE[n]: sb.get(n, 0) for n in ROUTED})


def stats(weights: dict) -> CacheStats | None:
  """The expert cache's counters of placed `weights` (None without a cache)."""
  t = weights.get(CACHE)
  return None if t is None or t.owner is None else t.owner.stats()
