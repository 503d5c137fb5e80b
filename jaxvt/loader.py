"""Opening a GGUF model, and placing its tensors once each as the declarations and a plan say.

  open_model(path) -> Model   the one way a file becomes a model: read the GGUF, build the
                              config (tied embeddings from the tensor names), declare the
                              weights, check the file against the declarations and measure the
                              bytes of every placement unit
  place(model, where, ...)    every declared weight where `where` (a plan) puts it, split over a
                              mesh by its declaration's rule (one device: the 1 x 1 mesh, every
                              weight whole): matrices become QWeights (raw GGUF blocks;
                              device-tier layers in one device array, host-tier layers copied
                              once into buffers of a host tier), vectors float32 arrays stacked
                              over their layers (jaxvt.model.sharding has the sharded layout)

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
from jax.sharding import NamedSharding

from jaxvt.errors import JaxvtError
from jaxvt.gguf import names as gguf_names
from jaxvt.gguf import quants
from jaxvt.gguf.default_model import default_model_path
from jaxvt.gguf.reader import GGUFFile, TensorInfo, open_gguf
from jaxvt.model import sharding
from jaxvt.model.config import ModelConfig, from_gguf_metadata
from jaxvt.model.declare import UnitBytes, WeightDecl, declare
from jaxvt.model.sharding import Par
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


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _set_rows(buf, i, rows, axis: int = 0):
  return jax.lax.dynamic_update_slice_in_dim(buf, rows, i, axis)


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
  return _pack([lambda t=t: t.raw().reshape(-1) for t in tensors], stride)


def _pack(rows: list[Callable[[], np.ndarray]], stride: int) -> np.ndarray:
  out = np.empty((len(rows), stride), np.uint8)
  for dst, row in zip(out, rows):
    src = row()
    copy_bytes(dst[:src.size], src)
    dst[src.size:] = 0
  return out


def _device_stack(rows: list[Callable[[], np.ndarray]], stride: int, device,
                  lead: int = 0) -> jax.Array:
  """uint8 [(1,) * lead, len(rows), stride] on `device` (row i: rows[i]() zero-padded): packed
  on the host and uploaded in one transfer, or in pieces of _upload_max() bytes written into one
  donated device array (device memory stays 1x)."""
  per = max(1, _upload_max() // stride)
  lead_shape = (1,) * lead
  if len(rows) <= per:
    return jax.device_put(_pack(rows, stride).reshape(lead_shape + (len(rows), stride)), device)
  data = jnp.zeros(lead_shape + (len(rows), stride), jnp.uint8, device=device)
  for i in range(0, len(rows), per):
    piece = _pack(rows[i:i + per], stride).reshape(lead_shape + (-1, stride))
    data = _set_rows(data, jnp.int32(i), jax.device_put(piece, device), lead)
  return data


# ---------------------------------------------------------------------------------------------
# Placing: every weight by its declaration's rule over the mesh (replicated on one device)


def _vector(model: Model, d: WeightDecl, r: sharding.Rule, par: Par) -> jax.Array:
  rows = [np.asarray(t.data, dtype=np.float32).reshape(d.shape) for t in model.tensors(d)]
  arr = rows[0] if d.layers is None else np.stack(rows)
  if r.kind != "replicate":  # the shards side by side along the split axis
    ax = r.axis + (0 if d.layers is None else 1)
    arr = np.concatenate([np.take(arr, r.index(s), axis=ax) for s in range(par.tp)], axis=ax)
  return jax.device_put(arr, NamedSharding(par.mesh, sharding.vector_spec(d, r)))


def _matrix(model: Model, d: WeightDecl, r: sharding.Rule, par: Par, where: Placement,
            host) -> QWeight:
  """A QWeight of every layer of matrix `d`; with a sharded rule, of S shards (leading axis)."""
  tensors = model.tensors(d)
  S = sharding.n_shards(r, par)
  lshape = sharding.local_shape(d, r)
  part = lambda t, s: sharding.shard_bytes(t.raw(), t.type_id, d, r, s, t.name)
  fmts = np.array([t.type_id for t in tensors], np.int32)
  table = np.zeros((S, len(tensors)), np.uint64)
  host_pos, dev_pos, sizes = [], [], []
  for i, (l, t) in enumerate(zip(layers_of(d), tensors)):
    sizes.append(quants.row_bytes(t.type_id, lshape[-1]) * int(np.prod(lshape[:-1])))
    if where(d.name, l) == "host":
      need_host_tier(host)
      for s in range(S):
        fill = lambda a, t=t, s=s: copy_bytes(a, part(t, s))
        buf = host.copy(t.name if S == 1 else f"{t.name}#{s}", sizes[i], fill)
        table[s, i] = buf.device_address
      fmts[i] |= HOST_BIT
      host_pos.append(i)
    else:
      dev_pos.append(i)
  stride = max((sizes[i] for i in dev_pos), default=1)
  table[:, dev_pos] = np.arange(len(dev_pos), dtype=np.uint64)
  sh = NamedSharding(par.mesh, sharding.qweight_spec(r))
  lead = 1 if S > 1 else 0  # a sharded weight's leading shard axis
  gshape = (S,) * lead + ((len(dev_pos), stride) if dev_pos else (1, 1))
  arrays = []
  for device, index in sh.addressable_devices_indices_map(gshape).items():
    s = (index[0].start or 0) if lead else 0
    rows = [lambda t=tensors[i], s=s: part(t, s) for i in dev_pos]
    arrays.append(_device_stack(rows, stride, device, lead) if rows else
                  jnp.zeros((1,) * lead + (1, 1), jnp.uint8, device=device))
  data = jax.make_array_from_single_device_arrays(gshape, sh, arrays)
  meta = QMeta(rows=lshape[-2], cols=lshape[-1], experts=lshape[0] if len(lshape) == 3 else 0,
               formats=tuple(sorted(set(int(f) & FMT_MASK for f in fmts))), n_layers=len(tensors),
               host_layers=tuple(host_pos))
  tab = split_u64(table.reshape(-1)).reshape(S, len(tensors), 2)
  fm = np.broadcast_to(fmts, (S, len(tensors))).copy()
  return QWeight(data, jax.device_put(tab if lead else tab[0], sh),
                 jax.device_put(fm if lead else fm[0], sh), meta)


def place_weight(model: Model, d: WeightDecl, where: Placement = all_device, *, par: Par | None = None,
                 host=None, progress: Progress | None = None):
  """Declaration `d` placed over `par` (default: the 1 x 1 mesh on JAX's first device) as
  `where` says, by its rule (jaxvt.model.sharding): a QWeight (matrices) or a float32 array."""
  par = par or sharding.one_device()
  r = sharding.rule(d, par)
  w = _matrix(model, d, r, par, where, host) if d.matrix else _vector(model, d, r, par)
  if progress:
    for t in model.tensors(d):
      progress(t.n_bytes)
  return w


def place(model: Model, where: Placement = all_device, *, par: Par | None = None, host=None,
          progress: Progress | None = None) -> dict:
  """Places every declared weight over `par` (default: the 1 x 1 mesh on JAX's first device)
  and in the host tier `host`; returns {canonical name: QWeight | float32 array}."""
  par = par or sharding.one_device()
  return {d.name: place_weight(model, d, where, par=par, host=host, progress=progress)
          for d in model.decls}


def abstract_weights(model: Model, where: Placement = all_device, par: Par | None = None) -> dict:
  """What `place(model, where, par=par)` returns on one device (the 1 x 1 mesh `par`, default
  JAX's first device's), with jax.ShapeDtypeStruct leaves (QWeights keep their static QMeta):
  every shape, dtype and sharding from the units' bytes and formats alone, without reading or
  placing a byte. For compiling a plan's programs ahead of time, before its weights are placed
  (engine.plan_workspace_bytes)."""
  par = par or sharding.one_device()
  if par.size != 1:
    raise ValueError("abstract_weights describes one device's weights (a 1 x 1 mesh)")
  whole = NamedSharding(par.mesh, jax.sharding.PartitionSpec())
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=whole)
  units = {(u.name, u.layer): u for u in model.units}
  weights = {}
  for d in model.decls:
    if not d.matrix:
      weights[d.name] = spec(d.shape if d.layers is None else (len(d.layers), *d.shape),
                             jnp.float32)
      continue
    stack = [units[(d.name, l)] for l in layers_of(d)]
    host = tuple(i for i, l in enumerate(layers_of(d)) if where(d.name, l) == "host")
    dev = [u.nbytes for i, u in enumerate(stack) if i not in host]
    n = len(stack)
    meta = QMeta(rows=d.shape[-2], cols=d.shape[-1], experts=d.shape[0] if len(d.shape) == 3 else 0,
                 formats=tuple(sorted({u.type_id for u in stack})), n_layers=n, host_layers=host)
    weights[d.name] = QWeight(spec((len(dev), max(dev)) if dev else (1, 1), jnp.uint8),
                              spec((n, 2), jnp.uint32), spec((n,), jnp.int32), meta)
  return weights
