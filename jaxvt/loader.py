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
import re
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxvt import transfer
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
from jaxvt.transfer import (COPY_CHUNK, UPLOAD_PIECE, LoadTimes, Row,  # noqa: F401 (public)
                            array_row, copy_bytes, file_row, pack_rows)

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
# Placing: every weight by its declaration's rule over the mesh (replicated on one device), a
# few stacks in flight at once; their bytes move by jaxvt.transfer

# Weights placed at once on an accelerator: later stacks pack while earlier ones upload. The CPU
# backend places one at a time on the calling thread: its device arrays are host memory that
# the uploading thread allocates, and allocated on other threads they stay in those threads'
# malloc arenas after close (repeated load/close cycles grow RSS; tests/test_hostile_api.py).
STACKS_IN_FLIGHT = 3
# Bytes of a stack per pinned staging buffer on a GPU (place's `staging`; STACKS_IN_FLIGHT of
# them): eight COPY_CHUNK reads each, so that the weights in flight keep 16 readers busy (pread
# from the page cache scales with the threads reading: one alone reads a sixth of what 16 do).
STAGE_PIECE = 512 << 20


def need_host_tier(host) -> None:
  """Raises the one-line error for a host-tier placement without a host tier."""
  if host is None:
    raise JaxvtError("a host-tier placement needs the jaxvt extension's host tier; "
                     "reinstall jaxvt (pip install .) so its FFI extension is built")


def _vector(model: Model, d: WeightDecl, r: sharding.Rule, par: Par) -> jax.Array:
  rows = [np.asarray(t.data, dtype=np.float32).reshape(d.shape) for t in model.tensors(d)]
  arr = rows[0] if d.layers is None else np.stack(rows)
  if r.kind != "replicate":  # the shards side by side along the split axis
    ax = r.axis + (0 if d.layers is None else 1)
    arr = np.concatenate([np.take(arr, r.index(s), axis=ax) for s in range(par.tp)], axis=ax)
  return jax.device_put(arr, NamedSharding(par.mesh, sharding.vector_spec(d, r)))


def _matrix(model: Model, d: WeightDecl, r: sharding.Rule, par: Par, where: Placement,
            host, budget: transfer.Budget | None = None, times: LoadTimes | None = None,
            staging=None, stack: jax.Array | None = None) -> QWeight:
  """A QWeight of every layer of matrix `d`; with a sharded rule, of S shards (leading axis)."""
  times = times or LoadTimes()
  tensors = model.tensors(d)
  S = sharding.n_shards(r, par)
  lshape = sharding.local_shape(d, r)

  def row(t: TensorInfo, s: int) -> Row:
    if r.kind == "replicate" and model.gguf is not None:  # whole: read from the file
      return file_row(model.gguf, t)
    return array_row(sharding.shard_bytes(t.raw(), t.type_id, d, r, s, t.name))

  def fill(a: np.ndarray, t: TensorInfo, s: int) -> None:
    t0 = time.perf_counter()
    transfer.write_rows([a], [row(t, s)])
    times.add("host", time.perf_counter() - t0, a.size)

  fmts = np.array([t.type_id for t in tensors], np.int32)
  table = np.zeros((S, len(tensors)), np.uint64)
  host_pos, dev_pos, sizes = [], [], []
  sh = NamedSharding(par.mesh, sharding.qweight_spec(r))
  lead = 1 if S > 1 else 0  # a sharded weight's leading shard axis
  # the shards this process's devices hold: over several processes each keeps only its own in
  # its host tier (the table entries of the others' shards stay 0 here and are never read)
  mine = ({(i[0].start or 0) for i in sh.addressable_devices_indices_map((S, 1, 1)).values()}
          if lead else {0})
  for i, (l, t) in enumerate(zip(layers_of(d), tensors)):
    sizes.append(quants.row_bytes(t.type_id, lshape[-1]) * int(np.prod(lshape[:-1])))
    if where(d.name, l) == "host":
      need_host_tier(host)
      for s in sorted(mine):
        buf = host.copy(t.name if S == 1 else f"{t.name}#{s}", sizes[i],
                        lambda a, t=t, s=s: fill(a, t, s))
        table[s, i] = buf.device_address
      fmts[i] |= HOST_BIT
      host_pos.append(i)
    else:
      dev_pos.append(i)
  stride = max((sizes[i] for i in dev_pos), default=1)
  table[:, dev_pos] = np.arange(len(dev_pos), dtype=np.uint64)
  gshape = (S,) * lead + ((len(dev_pos), stride) if dev_pos else (1, 1))
  arrays = []
  for device, index in sh.addressable_devices_indices_map(gshape).items():
    s = (index[0].start or 0) if lead else 0
    rows = [row(tensors[i], s) for i in dev_pos]
    arrays.append(transfer.device_stack(rows, stride, device, lead, budget, times, staging, stack)
                  if rows else jnp.zeros((1,) * lead + (1, 1), jnp.uint8, device=device))
  data = jax.make_array_from_single_device_arrays(gshape, sh, arrays)
  meta = QMeta(rows=lshape[-2], cols=lshape[-1], experts=lshape[0] if len(lshape) == 3 else 0,
               formats=tuple(sorted(set(int(f) & FMT_MASK for f in fmts))), n_layers=len(tensors),
               host_layers=tuple(host_pos))
  tab = split_u64(table.reshape(-1)).reshape(S, len(tensors), 2)
  fm = np.broadcast_to(fmts, (S, len(tensors))).copy()
  return QWeight(data, _local_put(tab if lead else tab[0], sh),
                 _local_put(fm if lead else fm[0], sh), meta)


def _local_put(a: np.ndarray, sh: NamedSharding) -> jax.Array:
  """`a` over `sh`, each device's part from this process's `a`: a table of host-tier addresses
  is each process's own (device_put would insist every process passes the same array)."""
  return jax.make_array_from_callback(a.shape, sh, lambda index: a[index])


def place_weight(model: Model, d: WeightDecl, where: Placement = all_device, *, par: Par | None = None,
                 host=None, progress: Progress | None = None, times: LoadTimes | None = None,
                 _budget: transfer.Budget | None = None, _staging=None, _stack=None):
  """Declaration `d` placed over `par` (default: the 1 x 1 mesh on JAX's first device) as
  `where` says, by its rule (jaxvt.model.sharding): a QWeight (matrices) or a float32 array.
  `times` collects where the time went (LoadTimes)."""
  par = par or sharding.one_device()
  r = sharding.rule(d, par)
  w = (_matrix(model, d, r, par, where, host, _budget, times, _staging, _stack) if d.matrix else
       _vector(model, d, r, par))
  if progress:
    for t in model.tensors(d):
      progress(t.n_bytes)
  return w


def _stacks_in_flight(platform: str) -> int:
  return 1 if platform == "cpu" else STACKS_IN_FLIGHT


@functools.cache
def _stack_pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="jaxvt-place")


def place(model: Model, where: Placement = all_device, *, par: Par | None = None, host=None,
          progress: Progress | None = None, times: LoadTimes | None = None,
          staging: Callable | None = None) -> dict:
  """Places every declared weight over `par` (default: the 1 x 1 mesh on JAX's first device)
  and in the host tier `host`; returns {canonical name: QWeight | float32 array}.

  On an accelerator STACKS_IN_FLIGHT weights at once, on threads (the CPU backend: one at a
  time, on this thread): while one stack uploads, the next ones are read from the file (host
  memory for packed stacks bounded by transfer.upload_max() in all). Each weight is placed as
  place_weight places it alone, so the arrays hold the same bytes. `progress` is called on
  this thread, in declaration order; the first error is raised once every weight in flight
  has stopped. `staging(platform, n, piece)`: pinned staging buffers for n weights in flight
  (host_tier.staging_for, which gives None where the device cannot take them), through which
  device stacks go up (transfer.device_stack) instead of device_put; closed when placing ends."""
  par = par or sharding.one_device()
  budget = transfer.Budget(transfer.upload_max())
  n = _stacks_in_flight(par.devices[0].platform)
  staging = staging(par.devices[0].platform, n, STAGE_PIECE) if staging else None
  times = times or LoadTimes()
  t0 = time.perf_counter()
  stacks = _device_arrays(model, where, par) if staging is not None and par.size == 1 else {}
  times.add("arrays", time.perf_counter() - t0, sum(a.nbytes for a in stacks.values()))
  try:
    if n == 1:
      return {d.name: place_weight(model, d, where, par=par, host=host, progress=progress,
                                   times=times, _budget=budget, _staging=staging,
                                   _stack=stacks.pop(d.name, None))
              for d in model.decls}
    futs = [_stack_pool(n).submit(place_weight, model, d, where, par=par, host=host, times=times,
                                  _budget=budget, _staging=staging, _stack=stacks.pop(d.name, None))
            for d in model.decls]
    weights, error = {}, None
    for d, f in zip(model.decls, futs):
      try:
        weights[d.name] = f.result()
      except BaseException as e:  # pylint: disable=broad-except
        if error is None:
          error = e
          for g in futs:
            g.cancel()
        continue
      if progress and error is None:
        for t in model.tensors(d):
          progress(t.n_bytes)
    if error is not None:
      raise error
    return weights
  finally:
    if staging is not None:
      staging.close()  # every copy through it has returned: the futures are done


def _device_arrays(model: Model, where: Placement, par: Par) -> dict:
  """{name: uint8 device array} of every matrix's device stack (one device), made by one program:
  one compile (or load from the compilation cache) where a zeros per stack would compile one per
  shape, seconds of a cached first token on a GPU. Their bytes are arbitrary (the staged
  transfer.device_stack writes them all); the arrays are distinct buffers (checked; {}
  otherwise)."""
  shapes = {n: w.data.shape for n, w in abstract_weights(model, where, par).items()
            if isinstance(w, QWeight) and len(w.meta.host_layers) < w.meta.n_layers}
  names = sorted(shapes)
  if not names:
    return {}
  # each filled with its own byte (the staged path writes every byte of a stack): identical
  # zeros of one shape are one value to XLA, which may hand out one buffer for them
  make = jax.jit(lambda: [jnp.full(shapes[n], i % 251 + 1, jnp.uint8) for i, n in enumerate(names)],
                 out_shardings=jax.sharding.SingleDeviceSharding(par.devices[0]))
  arrays = make()
  if len({a.unsafe_buffer_pointer() for a in arrays}) != len(arrays):
    return {}
  return dict(zip(names, arrays))


class Placing:
  """`fn()` (a place) running on a thread, started at once. `result()` waits for it to finish
  and returns its weights or raises its error (again on every call): the caller learns
  nothing until the host tier's buffers are no longer being written."""

  def __init__(self, fn: Callable[[], dict]):
    self._box: dict = {}
    self.seconds = 0.0  # how long fn ran (set when it ends)
    self._thread = threading.Thread(target=self._run, args=(fn,), name="jaxvt-load", daemon=True)
    self._thread.start()

  def _run(self, fn) -> None:
    t0 = time.perf_counter()
    try:
      self._box["weights"] = fn()
    except BaseException as e:  # pylint: disable=broad-except  (re-raised by result)
      self._box["error"] = e
    self.seconds = time.perf_counter() - t0

  def result(self) -> dict:
    self._thread.join()
    if "error" in self._box:
      raise self._box["error"]
    return self._box["weights"]


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
