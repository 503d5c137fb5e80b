"""Opening a GGUF model, and placing its tensors once each as the declarations and a plan say.

  open_model(path) -> Model   the one way a file becomes a model: read the GGUF, build the
                              config (tied embeddings from the tensor names), declare the
                              weights, check the file against the declarations and measure the
                              bytes of every placement unit
  place(model, where, ...)    every declared weight where `where` (a plan) puts it: matrices
                              become QWeights (raw GGUF blocks; device-tier layers in one device
                              array, host-tier layers copied once into buffers of a host tier),
                              vectors float32 arrays stacked over their layers

Every declared tensor must be present with its declared shape, its bytes and a supported format;
every tensor of the file must be declared (an appended MTP block excepted).

The host tier is reached through one method, `host.copy(key, nbytes, fill) -> buffer` (a buffer
has `.device_address`): jaxvt.offload.host_tier.HostTier allocates a pinned buffer and lets
`fill` write it; `key` names the bytes (tensor and shard), so a provider may hand back copies it
keeps across loads.
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
from jaxvt.gguf.default_model import default_model_path
from jaxvt.gguf.reader import GGUFFile, TensorInfo, open_gguf
from jaxvt.model.config import ModelConfig, from_gguf_metadata
from jaxvt.model.declare import UnitBytes, WeightDecl, declare
from jaxvt.qweight import FMT_MASK, HOST_BIT, QMeta, QWeight, split_u64

Placement = Callable[[str, "int | None"], str]  # (canonical name, layer) -> "device" | "host"
Progress = Callable[[int], None]  # called with the bytes of each tensor placed


def all_device(name: str, layer: int | None) -> str:
  return "device"


def layers_of(d: WeightDecl) -> tuple[int | None, ...]:
  """The layers of d's stack; (None,) for a global tensor."""
  return (None,) if d.layers is None else d.layers


@dataclasses.dataclass(frozen=True)
class Model:
  """An opened model: its configuration, its weights' declarations and the bytes of each
  placement unit; `gguf` is the file (None for a weightless model, whose units are estimates)."""
  path: str
  cfg: ModelConfig
  decls: list[WeightDecl]
  units: list[UnitBytes]
  gguf: GGUFFile | None = None

  def tensors(self, d: WeightDecl) -> list[TensorInfo]:
    """d's tensors in the file, one per layer of its stack (checked when the model was opened)."""
    return [_tensor(self.gguf, self.cfg.arch, d, l) for l in layers_of(d)]


def open_model(path: str | None = None) -> Model:
  """Opens the GGUF file at `path` (default: the embedded SmolLM2-135M-Instruct Q4_1). Raises
  JaxvtError, naming the tensor, for a file that does not hold the model its metadata describes."""
  path = default_model_path() if path is None else path  # "" is an error, not the default
  gf = open_gguf(path)
  cfg = from_gguf_metadata(gf.metadata, gf.tensors)
  decls = declare(cfg)
  check_file(gf, cfg.arch, decls, cfg.n_layers)
  return Model(path, cfg, decls, unit_bytes(gf, cfg.arch, decls), gf)


def _tensor(gf: GGUFFile, arch: str, d: WeightDecl, layer: int | None) -> TensorInfo:
  name = gguf_names.gguf_name(arch, d.name, layer)
  t = gf.tensors.get(name)
  if t is None:
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
  if d.matrix and quants.row_bytes(t.type_id, shape[-1]) * d.numel // shape[-1] != t.n_bytes:
    raise JaxvtError(f"tensor '{name}' holds {t.n_bytes} bytes, not what its shape and format "
                     "need; the file is corrupt")
  return t


def check_file(gf: GGUFFile, arch: str, decls: list[WeightDecl], n_layers: int) -> None:
  """Raises JaxvtError for any tensor in the file that no declaration accounts for."""
  expected = set()
  for d in decls:
    for l in layers_of(d):
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
  """Bytes of every placement unit as stored in the file (what the planner budgets); checks
  every declared tensor's presence, shape, format and size."""
  return [UnitBytes(d.name, l, t.n_bytes, t.type_id) for d in decls for l in layers_of(d)
          for t in (_tensor(gf, arch, d, l),)]


# ---------------------------------------------------------------------------------------------
# Copies


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


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
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


def need_host_tier(host) -> None:
  """Raises the one-line error for a host-tier placement without a host tier."""
  if host is None:
    raise JaxvtError("a host-tier placement needs the jaxvt extension's host tier; "
                     "reinstall jaxvt (pip install .) so its FFI extension is built")


def pack_rows(tensors: list[TensorInfo], stride: int) -> np.ndarray:
  """uint8 [len(tensors), stride]: each tensor's raw bytes in one row, zero-padded."""
  out = np.empty((len(tensors), stride), np.uint8)
  for row, t in zip(out, tensors):
    copy_bytes(row[:t.n_bytes], t.raw().reshape(-1))
    row[t.n_bytes:] = 0
  return out


def _device_stack(tensors: list[TensorInfo], stride: int, device) -> jax.Array:
  """The device-tier rows of a stack: packed on the host and uploaded in one transfer, or in
  pieces of _upload_max() bytes written into one donated device array (device memory stays 1x)."""
  per = max(1, _upload_max() // stride)
  if len(tensors) <= per:
    return jax.device_put(pack_rows(tensors, stride), device)
  data = jnp.zeros((len(tensors), stride), jnp.uint8, device=device)
  for i in range(0, len(tensors), per):
    rows = jax.device_put(pack_rows(tensors[i:i + per], stride), device)
    data = _set_rows(data, jnp.int32(i), rows)
  return data


# ---------------------------------------------------------------------------------------------
# Placing


def _vector(model: Model, d: WeightDecl, device) -> jax.Array:
  rows = [np.asarray(t.data, dtype=np.float32).reshape(d.shape) for t in model.tensors(d)]
  arr = rows[0] if d.layers is None else np.stack(rows)
  return jax.device_put(arr, device)


def _matrix(model: Model, d: WeightDecl, where: Placement, host, device) -> QWeight:
  tensors = model.tensors(d)
  experts = d.shape[0] if len(d.shape) == 3 else 0
  fmts = np.array([t.type_id for t in tensors], np.int32)
  table = np.zeros(len(tensors), np.uint64)
  host_pos, dev_pos = [], []
  for i, (l, t) in enumerate(zip(layers_of(d), tensors)):
    if where(d.name, l) == "host":
      need_host_tier(host)
      src = t.raw().reshape(-1)
      buf = host.copy(t.name, t.n_bytes, lambda a, src=src: copy_bytes(a, src))
      table[i] = buf.device_address
      fmts[i] |= HOST_BIT
      host_pos.append(i)
    else:
      dev_pos.append(i)
  stride = max((tensors[i].n_bytes for i in dev_pos), default=1)
  if len(dev_pos) == 1:
    data = jax.device_put(tensors[dev_pos[0]].raw().reshape(1, -1), device)
  elif dev_pos:
    data = _device_stack([tensors[i] for i in dev_pos], stride, device)
  else:
    data = jnp.zeros((1, 1), jnp.uint8, device=device)
  for slot, i in enumerate(dev_pos):
    table[i] = slot
  meta = QMeta(rows=d.shape[-2], cols=d.shape[-1], experts=experts,
               formats=tuple(sorted(set(int(f) & FMT_MASK for f in fmts))),
               n_layers=len(tensors), host_layers=tuple(host_pos))
  return QWeight(data, jax.device_put(split_u64(table), device), jax.device_put(fmts, device),
                 meta)


def place_weight(model: Model, d: WeightDecl, where: Placement = all_device, *, host=None,
                 device=None, progress: Progress | None = None):
  """Declaration `d` placed as `where` says: a QWeight (matrices) or a float32 array."""
  device = device or jax.devices()[0]
  w = _matrix(model, d, where, host, device) if d.matrix else _vector(model, d, device)
  if progress:
    for t in model.tensors(d):
      progress(t.n_bytes)
  return w


def place(model: Model, where: Placement = all_device, *, host=None, device=None,
          progress: Progress | None = None) -> dict:
  """Places every declared weight on `device` (default: JAX's first) and in the host tier
  `host`; returns {canonical name: QWeight | float32 array}."""
  return {d.name: place_weight(model, d, where, host=host, device=device, progress=progress)
          for d in model.decls}
