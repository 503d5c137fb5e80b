"""QWeight: a stack of quantized matrices as the model and the kernels see it.

One QWeight holds one canonical weight for every layer of its stack (L layers; L = 1 for global
tensors), each layer in its own GGUF block format and in its own memory tier:

  data   uint8 [n_device_layers, stride]  raw GGUF blocks of the device-tier layers, one row a
                                          layer (padded to the largest layer); [1, 1] if none.
  table  uint32 [L, 2]                    per layer (lo, hi) of a 64-bit value: the row ("slot")
                                          of the layer inside `data` (device tier; its bytes start
                                          at slot * stride) or the absolute device-readable
                                          address of its pinned host buffer (host tier, owned by
                                          jaxvt.offload.host_tier).
  fmts   int32 [L]                        per layer: the ggml type id, | HOST_BIT for host tier.

Everything that varies per layer is device-visible data that kernels read on the device, so one
compiled `lax.scan` body serves every layer and CUDA-graph replay stays correct. Static metadata
(shape, which formats occur, whether any layer is in the host tier) is pytree aux data.
A layer's matrix is `rows x cols` (numpy order, cols contiguous = GGUF ne0); with `experts > 0`
it is `experts x rows x cols`, expert e starting at byte e * rows * row_bytes(fmt, cols).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

HOST_BIT = 1 << 16  # set in fmts[l] when layer l lives in the host tier
FMT_MASK = HOST_BIT - 1


@dataclasses.dataclass(frozen=True)
class QMeta:
  rows: int
  cols: int
  experts: int  # 0: plain matrix; > 0: stacked experts
  formats: tuple[int, ...]  # sorted ggml type ids that occur in this stack
  n_layers: int
  host_layers: tuple[int, ...] = ()  # stack positions (0..L-1) that live in the host tier

  @property
  def any_host(self) -> bool:
    return bool(self.host_layers)

  @property
  def all_host(self) -> bool:
    return len(self.host_layers) == self.n_layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
  data: jax.Array
  table: jax.Array
  fmts: jax.Array
  meta: QMeta = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    m = self.meta
    return (m.experts, m.rows, m.cols) if m.experts else (m.rows, m.cols)

  def layer_view(self, layer) -> tuple["QWeight", jax.Array]:
    """The stack and the index the kernels read layer `layer` (int32, may be traced) from.

    Every use of a stacked weight in the model goes through here. A QWeight's layers are read
    where they live (either tier), so this is (self, layer); a weight type whose layers must be
    moved before a kernel can read them overrides it (PinnedQWeight in benchmarks/arms.py, the
    offload benchmark's JAX pinned_host arm)."""
    return self, layer


STAGES = ("gate", "up", "down")  # the routed stacks' products, as the experts ops name them


@jax.tree_util.register_pytree_node_class
class CacheTables:
  """The device expert cache (jaxvt.ffi.expert_cache) as a program sees it, under the weights'
  "moe.cache": stab uint32 [L, 2] (each cached layer's state block's
  address, 0 elsewhere) and per stage ("gate", "up", "down") the stack's cache table uint32
  [L, 2] (the layer's partition of slots, 0 where that stack's layer is not cached) and a slot's
  bytes (static). `owner` (the allocation, jaxvt.offload.expert_cache.ExpertCache) is kept
  alive by the weights holding this object; it is not part of the pytree, so programs depend
  only on the slot sizes, not on the cache's size or where it lives."""

  def __init__(self, stab, ctabs: dict, cslots: dict, owner=None):
    self.stab, self.ctabs, self.cslots, self.owner = stab, dict(ctabs), dict(cslots), owner

  def tree_flatten(self):
    return (self.stab, tuple(self.ctabs[s] for s in STAGES)), tuple(self.cslots[s] for s in STAGES)

  @classmethod
  def tree_unflatten(cls, cslots, children):
    stab, ctabs = children
    return cls(stab, dict(zip(STAGES, ctabs)), dict(zip(STAGES, cslots)))

  def operands(self, where: jax.Array) -> dict:
    """The experts ops' `cache` argument for a call whose decisions are `where`."""
    return {s: (where, self.ctabs[s], self.cslots[s]) for s in STAGES}


def split_u64(values) -> np.ndarray:
  """uint64 values -> uint32 [n, 2] (lo, hi) rows, the layout of QWeight.table."""
  v = np.asarray(values, dtype=np.uint64).reshape(-1)
  return np.stack([(v & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                   (v >> np.uint64(32)).astype(np.uint32)], axis=1)
