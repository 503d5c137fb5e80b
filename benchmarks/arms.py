"""What only the benchmarks need, beside the product's public steps.

  NoStops        a tokenizer whose end-of-generation set is empty: a timed `generate` runs
                 exactly its `max_tokens`
  KeptTier       a host tier for many placements of one file: each tensor is copied into a
                 pinned buffer the first time a placement offloads it, and handed back after
  KindTier       a host tier whose memory is one allocation kind (pinned, write-combined, 2 MiB
                 huge pages; on HIP fine- or coarse-grained): which one the device reads fastest
                 is a measurement (`python -m benchmarks.tier --kinds`)
  PinnedQWeight  JAX's own pinned_host memory kind used the documented way, the offload sweep's
                 comparison arm: a whole stack lives in pinned_host and every use copies the
                 layer to the device first (`place_pinned`)

Each plugs into the product where it already takes such a thing: a tokenizer (Engine), a host
tier (`host` of jaxvt.place: its `copy`), a stacked weight (QWeight.layer_view).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import JaxvtError, engine, ffi
from jaxvt.offload.host_tier import HostBuffer, HostTier
from jaxvt.qweight import QMeta, QWeight, split_u64

KINDS = {"pinned": 0, "write_combined": 1, "huge_pages": 2}  # csrc/memory.h HostKind


class NoStops:
  """`tokenizer` with no end-of-generation tokens (every other attribute is the tokenizer's)."""

  stop_ids: tuple[int, ...] = ()

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  def __getattr__(self, name):
    return getattr(self._tokenizer, name)


def no_stops(eng):
  """`eng`, generating to max_tokens from now on (its tokenizer wrapped in NoStops)."""
  if not isinstance(eng.tokenizer, NoStops):
    eng.tokenizer = NoStops(eng.tokenizer)
  return eng


class KeptTier:
  """A host tier that keeps one pinned copy per key (tensor) across the loads that use it."""

  def __init__(self, tier: HostTier | None = None):
    self.tier = tier or HostTier()
    self.bufs: dict[str, HostBuffer] = {}

  def copy(self, key: str, nbytes: int, fill: Callable[[np.ndarray], None]) -> HostBuffer:
    buf = self.bufs.get(key)
    if buf is None:
      buf = self.bufs[key] = self.tier.copy(key, nbytes, fill)
    return buf

  def register_tables(self, weights: dict) -> int:
    return self.tier.register_tables(weights)

  def close(self) -> None:
    self.bufs.clear()
    self.tier.close()


class KindTier(HostTier):
  """A HostTier whose buffers are of allocation kind `kind` (KINDS); `coherent`: HIP
  fine-grained memory (device reads bypass the GPU's L2; CUDA ignores it). "huge_pages" asks for
  transparent huge pages on the CPU backend too; "write_combined" exists only for a GPU."""

  def __init__(self, kind: str = "pinned", backend: str | None = None, coherent: bool = False):
    if kind not in KINDS:
      raise JaxvtError(f"host memory kind must be one of {', '.join(KINDS)}, got {kind!r}")
    super().__init__(backend)
    if self.backend == "cpu" and kind == "write_combined":
      self.close()
      raise JaxvtError("write-combined host memory exists only for a GPU; use kind='pinned' or "
                       "'huge_pages' with backend='cpu'")
    self.kind, self.coherent = kind, bool(coherent)

  def allocate(self, nbytes: int) -> tuple[int, int]:
    return ffi.extension().host_alloc(nbytes, self.coherent, self.backend == "gpu",
                                      KINDS[self.kind])


# ---------------------------------------------------------------------------------------------
# JAX's pinned_host memory kind


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PinnedQWeight(QWeight):
  """A QWeight whose `data` (every layer, uint8 [L, stride]) lives in JAX's pinned_host memory.
  A kernel cannot read it there: each use copies the layer to the device (a DMA of the whole
  layer, as `jax.device_put` inside the layer scan does) and reads that copy."""

  def layer_view(self, layer) -> tuple[QWeight, jax.Array]:
    row = jax.device_put(jax.lax.dynamic_index_in_dim(self.data, layer, 0, keepdims=True),
                         jax.memory.Space.Device)
    meta = dataclasses.replace(self.meta, n_layers=1, host_layers=())
    fmts = jax.lax.dynamic_slice_in_dim(self.fmts, layer, 1)
    return QWeight(row, jnp.zeros((1, 2), jnp.uint32), fmts, meta), jnp.int32(0)


def place_pinned(model: engine.Model, d, sharding: jax.sharding.Sharding,
                 progress: Callable[[int], None] | None = None) -> PinnedQWeight:
  """Every layer of matrix `d` (one of model.decls) in pinned_host memory (`sharding`, the
  weights' device sharding; its memory kind is replaced), as one PinnedQWeight."""
  tensors = model.tensors(d)
  data = np.zeros((len(tensors), max(t.n_bytes for t in tensors)), np.uint8)
  for row, t in zip(data, tensors):  # each layer's file bytes in one row, zero-padded
    row[:t.n_bytes] = t.raw().reshape(-1)
  if progress:
    for t in tensors:
      progress(t.n_bytes)
  fmts = np.array([t.type_id for t in tensors], np.int32)
  meta = QMeta(rows=d.shape[-2], cols=d.shape[-1], experts=d.shape[0] if len(d.shape) == 3 else 0,
               formats=tuple(sorted(set(int(f) for f in fmts))), n_layers=len(tensors))
  return PinnedQWeight(jax.device_put(data, sharding.with_memory_kind("pinned_host")),
                       jax.device_put(split_u64(np.arange(len(tensors))), sharding),
                       jax.device_put(fmts, sharding), meta)


def pinned_stacks(model: engine.Model, where) -> set[str]:
  """The matrices `where` (a plan's placement) puts in the host tier, every layer of each: the
  pinned_host arm moves whole stacks only (JaxvtError for a plan that splits one)."""
  out = set()
  for d in model.decls:
    kinds = {where(d.name, l) for l in (d.layers if d.layers is not None else (None,))}
    if d.matrix and "host" in kinds:
      if kinds != {"host"}:
        raise JaxvtError(f"'{d.name}': the pinned_host arm places whole stacks; use a pattern "
                         "that offloads every layer of it")
      out.add(d.name)
  return out
