"""Placing a GGUF file's tensors, once each, as the declarations and the placement say.

Matrices become QWeights (raw GGUF blocks; device-tier layers in one device array, host-tier
layers copied once into pinned buffers of a HostTier); vectors become float32 arrays stacked
over their layers. Every declared tensor must be present with its declared shape and a supported
format; every tensor of the file must be declared (an appended MTP block excepted).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.errors import JaxvtError
from jaxvt.gguf import names as gguf_names
from jaxvt.gguf import quants
from jaxvt.gguf.reader import GGUFFile, TensorInfo
from jaxvt.model.declare import WeightDecl
from jaxvt.qweight import FMT_MASK, HOST_BIT, QMeta, QWeight, split_u64

Placement = Callable[[str, "int | None"], str]  # (canonical name, layer) -> "device" | "host"
Progress = Callable[[int], None]  # called with the bytes of each tensor placed


def all_device(name: str, layer: int | None) -> str:
  return "device"


@dataclasses.dataclass(frozen=True)
class UnitBytes:
  """One placement unit: a weight in one layer (layer None for global tensors)."""
  name: str
  layer: int | None
  nbytes: int
  type_id: int


def _tensor(gf: GGUFFile, arch: str, d: WeightDecl, layer: int | None) -> TensorInfo | None:
  name = gguf_names.gguf_name(arch, d.name, layer)
  t = gf.tensors.get(name)
  if t is None:
    if d.optional:
      return None
    raise JaxvtError(f"{gf.path} lacks tensor '{name}' that a {arch} model needs; "
                     "the file is incomplete or of another architecture")
  shape = tuple(d.shape)
  if d.matrix and t.shape != shape or not d.matrix and int(np.prod(t.shape)) != int(np.prod(shape)):
    raise JaxvtError(f"tensor '{name}' has shape {list(t.shape)}, expected {list(shape)} from "
                     f"the file's metadata; the file is inconsistent")
  if t.type_id not in quants.FORMATS:
    raise JaxvtError(f"tensor '{name}' is in unsupported format "
                     f"{quants.format_name(t.type_id)}; jaxvt reads "
                     f"{', '.join(f.name for f in quants.FORMATS.values())}: "
                     "re-quantize the model to one of them")
  if not d.matrix and t.type_id not in (quants.F32, quants.F16, quants.BF16):
    raise JaxvtError(f"vector tensor '{name}' is quantized ({quants.format_name(t.type_id)}); "
                     "jaxvt expects F32/F16/BF16 vectors")
  return t


def _layers(d: WeightDecl) -> tuple[int | None, ...]:
  return (None,) if d.layers is None else d.layers


def check_file(gf: GGUFFile, arch: str, decls: list[WeightDecl], n_layers: int) -> None:
  """Raises JaxvtError for any tensor in the file that no declaration accounts for."""
  expected = set()
  for d in decls:
    for l in _layers(d):
      expected.add(gguf_names.gguf_name(arch, d.name, l))
  for name in gf.tensors:
    if name in expected:
      continue
    m = re.match(r"blk\.(\d+)\.", name)
    if m and int(m.group(1)) >= n_layers:  # appended MTP / nextn block: not part of the trunk
      continue
    raise JaxvtError(f"{gf.path} holds unexpected tensor '{name}' for architecture '{arch}'; "
                     "the file was converted by an unsupported converter or is corrupt")


def unit_bytes(gf: GGUFFile, arch: str, decls: list[WeightDecl]) -> list[UnitBytes]:
  """Bytes of every placement unit as stored in the file (what the planner budgets)."""
  out = []
  for d in decls:
    for l in _layers(d):
      t = _tensor(gf, arch, d, l)
      if t is not None:
        out.append(UnitBytes(d.name, l, t.n_bytes, t.type_id))
  return out


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows(buf, i, rows):
  return jax.lax.dynamic_update_slice_in_dim(buf, rows, i, 0)


COPY_CHUNK = 32 << 20  # bytes per thread task when copying a tensor


def _upload_max() -> int:
  """Host bytes of a device stack packed for one upload: a quarter of free RAM, >= 1 GiB."""
  try:
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):
    free = 0
  return max(1 << 30, free // 4)


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1),
                                               thread_name_prefix="jaxvt-copy")


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
  """dst[:] = src for flat uint8 arrays, in COPY_CHUNK pieces on threads (numpy drops the GIL
  while copying; the source is usually the file's memory map, so this also spreads its page
  faults over cores)."""
  n = src.size
  if n <= 2 * COPY_CHUNK:
    dst[:] = src
    return
  futs = [_pool().submit(np.copyto, dst[i:i + COPY_CHUNK], src[i:i + COPY_CHUNK])
          for i in range(0, n, COPY_CHUNK)]
  for f in futs:
    f.result()


def need_host_tier(host_tier) -> None:
  """Raises the one-line error for a host-tier placement without a host tier."""
  if host_tier is None:
    raise JaxvtError("a host-tier placement needs the jaxvt extension's host tier; "
                     "reinstall jaxvt (pip install .) so its FFI extension is built")


def _host_copy(host_tier, t: TensorInfo):
  """t's bytes in a host-tier buffer. A tier with `buffer_for(tensor)` hands back buffers it
  filled itself (jaxvt.bench.offload keeps one tier across the budgets of a sweep)."""
  buffer_for = getattr(host_tier, "buffer_for", None)
  if buffer_for is not None:
    return buffer_for(t)
  buf = host_tier.alloc(t.n_bytes)
  _copy(buf.array, t.raw().reshape(-1))
  return buf


def _pack(tensors: list[TensorInfo], stride: int) -> np.ndarray:
  """uint8 [len(tensors), stride]: each tensor's raw bytes in one row, zero-padded."""
  out = np.empty((len(tensors), stride), np.uint8)
  for row, t in zip(out, tensors):
    _copy(row[:t.n_bytes], t.raw().reshape(-1))
    row[t.n_bytes:] = 0
  return out


def _device_stack(tensors: list[TensorInfo], stride: int, device) -> jax.Array:
  """The device-tier rows of a stack: packed on the host and uploaded in one transfer, or in
  pieces of _upload_max() bytes written into one donated device array (device memory stays 1x)."""
  per = max(1, _upload_max() // stride)
  if len(tensors) <= per:
    return jax.device_put(_pack(tensors, stride), device)
  data = jnp.zeros((len(tensors), stride), jnp.uint8, device=device)
  for i in range(0, len(tensors), per):
    rows = jax.device_put(_pack(tensors[i:i + per], stride), device)
    data = _set_rows(data, jnp.int32(i), rows)
  return data


def _load_vector(gf, arch, d: WeightDecl, device) -> jax.Array:
  rows = []
  for l in _layers(d):
    t = _tensor(gf, arch, d, l)
    rows.append(np.asarray(t.data, dtype=np.float32).reshape(d.shape))
  arr = rows[0] if d.layers is None else np.stack(rows)
  return jax.device_put(arr, device)


def _load_matrix(gf, arch, d: WeightDecl, placement: Placement, host_tier, device,
                 progress) -> QWeight:
  tensors = [_tensor(gf, arch, d, l) for l in _layers(d)]
  experts = d.shape[0] if len(d.shape) == 3 else 0
  kinds = {placement(d.name, l) for l in _layers(d)}
  if "jax_pinned" in kinds:
    return _load_jax_pinned(d, tensors, kinds, device, progress)
  rows, cols = d.shape[-2], d.shape[-1]
  fmts = np.zeros(len(tensors), np.int32)
  table = np.zeros(len(tensors), np.uint64)
  host_pos, dev_pos = [], []
  for i, (l, t) in enumerate(zip(_layers(d), tensors)):
    if quants.row_bytes(t.type_id, cols) * rows * max(experts, 1) != t.n_bytes:
      raise JaxvtError(f"tensor '{t.name}' holds {t.n_bytes} bytes, not what its shape and "
                       f"format need; the file is corrupt")
    fmts[i] = t.type_id
    kind = placement(d.name, l)
    if kind == "host":
      need_host_tier(host_tier)
      buf = _host_copy(host_tier, t)
      table[i] = buf.device_address
      fmts[i] |= HOST_BIT
      host_pos.append(i)
    else:
      dev_pos.append(i)
    if progress:
      progress(t.n_bytes)
  stride = max((tensors[i].n_bytes for i in dev_pos), default=1)
  if dev_pos and len(dev_pos) == 1:
    t = tensors[dev_pos[0]]
    data = jax.device_put(t.raw().reshape(1, -1), device)
  elif dev_pos:
    data = _device_stack([tensors[i] for i in dev_pos], stride, device)
  else:
    data = jnp.zeros((1, 1), jnp.uint8, device=device)
  for slot, i in enumerate(dev_pos):
    table[i] = slot
  meta = QMeta(rows=rows, cols=cols, experts=experts,
               formats=tuple(sorted(set(int(f) & FMT_MASK for f in fmts))),
               n_layers=len(tensors), host_layers=tuple(host_pos))
  return QWeight(data, jax.device_put(split_u64(table), device), jax.device_put(fmts, device),
                 meta)


def _load_jax_pinned(d: WeightDecl, tensors, kinds, device, progress) -> QWeight:
  """A whole stack in JAX's pinned_host memory kind (QMeta.staged; see layers.stage)."""
  if kinds != {"jax_pinned"}:
    raise JaxvtError(f"'{d.name}': the jax_pinned kind places whole stacks only")
  stride = max(t.n_bytes for t in tensors)
  data = _pack(tensors, stride)
  if progress:
    for t in tensors:
      progress(t.n_bytes)
  pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  fmts = np.array([t.type_id for t in tensors], np.int32)
  meta = QMeta(rows=d.shape[-2], cols=d.shape[-1], experts=d.shape[0] if len(d.shape) == 3 else 0,
               formats=tuple(sorted(set(int(f) for f in fmts))), n_layers=len(tensors),
               staged=True)
  return QWeight(jax.device_put(data, pinned),
                 jax.device_put(split_u64(np.arange(len(tensors))), device),
                 jax.device_put(fmts, device), meta)


def load_weights(gf: GGUFFile, arch: str, decls: list[WeightDecl], placement: Placement = all_device,
                 host_tier=None, device=None, progress: Progress | None = None) -> dict:
  """Places every declared weight; returns {canonical name: QWeight | float32 array}."""
  device = device or jax.devices()[0]
  weights = {}
  for d in decls:
    if d.matrix:
      if _tensor(gf, arch, d, _layers(d)[0]) is None:  # optional and absent (tied lm_head)
        continue
      weights[d.name] = _load_matrix(gf, arch, d, placement, host_tier, device, progress)
    else:
      weights[d.name] = _load_vector(gf, arch, d, device)
      if progress:
        progress(sum(int(_tensor(gf, arch, d, l).n_bytes) for l in _layers(d)))
  return weights
