"""The host tier: pinned, device-mapped host buffers that kernels read in place.

`HostTier` owns every buffer it allocates and frees them on `close()`, on leaving a `with` block,
when it is garbage-collected, or at interpreter exit (a `weakref.finalize` per tier), whichever
comes first. A `HostBuffer` gives a writable numpy uint8 view (`.array`) for the loader to fill
once, and `.device_address`, the value that goes into `QWeight.table`. The loader reaches the
tier through `copy(key, nbytes, fill)` (jaxvt.loader).

Backends (chosen once per tier):
  gpu  `cudaHostAlloc` / `hipHostMalloc` with Mapped | Portable (on HIP coarse-grained: cached
       in the GPU's L2; weights are written once before any kernel reads them).
  cpu  page-aligned plain memory (the CPU kernels read it in place as well); used when the
       extension has no GPU support or sees no GPU, or when asked for with backend="cpu".
Other allocation kinds (fine-grained, write-combined, huge pages) are measured by the benchmarks
(benchmarks.arms.KindTier), not used here.

Freeing a buffer invalidates its numpy view and any QWeight whose table holds its address:
close a tier only after the arrays and compiled functions that use it are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
import weakref
from typing import Callable

import numpy as np

from jaxvt.errors import JaxvtError
from jaxvt.ffi import extension
from jaxvt.qweight import QWeight


def _ext():
  ext = extension()
  if ext is None:
    raise JaxvtError("the host tier needs jaxvt's compiled extension; reinstall jaxvt "
                     "(pip install -e . --no-build-isolation) so jaxvt.ffi._jaxvt_ffi is built")
  return ext


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB"


_FREED = ("this host-tier buffer was freed (its HostTier was closed); load the weights again "
          "with a new HostTier")


class HostBuffer:
  """One host-tier allocation. `array` is a writable uint8 numpy view of its `nbytes` bytes.
  Once freed, `array`, `host_address` and `device_address` raise JaxvtError: an address of
  freed memory is never handed out."""

  def __init__(self, host_address: int, device_address: int, nbytes: int):
    self._host_address = host_address
    self._device_address = device_address
    self.nbytes = nbytes
    self._array = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(host_address),
                                dtype=np.uint8)
    self.closed = False

  @property
  def array(self) -> np.ndarray:
    if self.closed:
      raise JaxvtError(_FREED)
    return self._array

  @property
  def host_address(self) -> int:
    if self.closed:
      raise JaxvtError(_FREED)
    return self._host_address

  @property
  def device_address(self) -> int:
    if self.closed:
      raise JaxvtError(_FREED)
    return self._device_address

  def __repr__(self) -> str:
    state = "freed" if self.closed else f"device_address=0x{self._device_address:x}"
    return f"HostBuffer(nbytes={self.nbytes}, {state})"


def _free_all(records: list, gpu: bool, lock: threading.Lock, tables: list) -> None:
  """Frees every buffer in records (list of HostBuffer) and forgets `tables` (register_tables);
  safe to call more than once."""
  ext = _ext()
  with lock:
    while tables:
      ext.prefetch_unregister(tables.pop())
    while records:
      buf = records.pop()
      if not buf.closed:
        buf.closed = True
        buf._array = None
        ext.host_free(buf._host_address, gpu)  # pylint: disable=protected-access


class HostTier:
  """Owner of pinned host buffers. Use as a context manager or call `close()`."""

  def __init__(self, backend: str | None = None):
    """backend: "gpu", "cpu" or None (gpu when the extension has GPU support and sees a GPU)."""
    ext = _ext()
    if backend is None:
      backend = "gpu" if ext.gpu_platform() and ext.gpu_device_count() > 0 else "cpu"
    if backend not in ("gpu", "cpu"):
      raise JaxvtError(f"HostTier backend must be 'gpu', 'cpu' or None, got {backend!r}")
    if backend == "gpu" and not (ext.gpu_platform() and ext.gpu_device_count() > 0):
      raise JaxvtError("HostTier(backend='gpu') needs a GPU build of jaxvt and a visible GPU; "
                       "rebuild with JAXVT_GPU=CUDA (or HIP) or use backend='cpu'")
    self.backend = backend
    self._buffers: list[HostBuffer] = []
    self._tables: list[int] = []
    self._lock = threading.Lock()
    self._closed = False
    self._finalizer = weakref.finalize(self, _free_all, self._buffers, backend == "gpu",
                                       self._lock, self._tables)

  @property
  def closed(self) -> bool:
    return self._closed

  @property
  def nbytes(self) -> int:
    """Bytes currently allocated by this tier."""
    with self._lock:
      return sum(b.nbytes for b in self._buffers)

  def alloc(self, nbytes: int) -> HostBuffer:
    """A new buffer of nbytes (> 0). Raises JaxvtError, allocating nothing, when it cannot."""
    if self._closed:
      raise JaxvtError("this HostTier is closed; create a new one to allocate")
    nbytes = int(nbytes)
    if nbytes <= 0:
      raise JaxvtError(f"a host-tier buffer needs a positive size, got {nbytes} bytes")
    ext = _ext()
    try:
      host, device = self.allocate(nbytes)
    except (RuntimeError, MemoryError, ValueError, OverflowError) as e:
      msg = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise JaxvtError(f"could not allocate {_gib(nbytes)} of {'pinned ' if self.backend == 'gpu' else ''}"
                       f"host memory ({msg}); offload less (lower the host-tier budget) or free "
                       f"host memory") from None
    try:
      buf = HostBuffer(host, device, nbytes)
    except BaseException:
      ext.host_free(host, self.backend == "gpu")
      raise
    with self._lock:
      self._buffers.append(buf)
    return buf

  def allocate(self, nbytes: int) -> tuple[int, int]:
    """(host address, device address) of `nbytes` of new memory, as `alloc` obtains it: pinned
    and device-mapped (gpu) or page-aligned (cpu). Raises what the extension raises."""
    return _ext().host_alloc(nbytes, False, self.backend == "gpu")

  def copy(self, key: str, nbytes: int, fill: Callable[[np.ndarray], None]) -> HostBuffer:
    """A new buffer of `nbytes` that `fill(array)` writes: how the loader puts a weight in the
    tier. `key` names the bytes (tensor and shard); this tier copies every time."""
    buf = self.alloc(nbytes)
    fill(buf.array)
    return buf

  def register_tables(self, weights: dict) -> int:
    """Tells the extension each host-tier layer's address and format in the tables of the
    weights' QWeight stacks (by each table's device address), so that prefetch (jaxvt.ffi.prefetch)
    copies them with DMAs on a GPU; forgotten at close. Returns the number of tables told."""
    ext = _ext()
    for w in weights.values():
      if not isinstance(w, QWeight) or not w.meta.any_host:
        continue
      if len(w.table.sharding.device_set) != 1:  # prefetch runs on one device only (this
        continue  # also skips a table over several processes' devices)
      try:
        ptr = w.table.unsafe_buffer_pointer()
      except Exception:  # an array over several devices: prefetch runs on one device only
        continue
      t = np.asarray(w.table).astype(np.uint64)
      addrs = t[:, 0] | (t[:, 1] << np.uint64(32))
      fmts = np.asarray(w.fmts).astype(np.int64) & 0xFFFFFFFF
      ext.prefetch_register(ptr, [int(a) for a in addrs] + [int(f) for f in fmts])
      with self._lock:
        self._tables.append(ptr)
    return len(self._tables)

  def close(self) -> None:
    """Frees every buffer (idempotent)."""
    self._closed = True
    self._finalizer()

  def __enter__(self) -> HostTier:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"HostTier(backend={self.backend!r}, buffers={len(self._buffers)}, "
            f"{'closed' if self._closed else _gib(self.nbytes)})")


class Staging:
  """Pinned buffers of `piece` bytes (a tier of their own) through which the loader writes device
  arrays: it fills a buffer from the file, then `upload` copies it straight into the array's
  device memory (the extension's copy_to_device: one DMA at the link's rate, where
  jax.device_put of pageable memory first copies the bytes into staging memory of its own, at a
  few GB/s). At most `n` buffers, made when first wanted; `buffer()` waits for a free one.
  `close()` frees them all."""

  def __init__(self, n: int, piece: int, backend: str | None = None):
    self.tier = HostTier(backend)
    self.piece, self._n, self._made = int(piece), int(n), 0
    self._free: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def buffer(self):
    """A free buffer (HostBuffer of `piece` bytes) for the block's duration."""
    buf = None
    with self._lock:
      if self._free.empty() and self._made < self._n:
        try:
          buf = self.tier.alloc(self.piece)
          self._made += 1
        except JaxvtError:
          if not self._made:
            raise
          self._n = self._made  # no room for another: wait for one of those made
    if buf is None:
      buf = self._free.get()
    try:
      yield buf
    finally:
      self._free.put(buf)

  def upload(self, dst_address: int, buf: HostBuffer, nbytes: int, device) -> None:
    """buf's first nbytes into the device buffer at dst_address, on `device` (a jax Device of
    this tier's backend: a GPU, or the CPU for a "cpu" tier), waiting until they are there."""
    gpu = self.tier.backend == "gpu"
    if gpu == (device.platform == "cpu"):
      raise JaxvtError(f"a {self.tier.backend} staging tier cannot upload to a {device.platform} "
                       f"device")
    _ext().copy_to_device(dst_address, buf.host_address, int(nbytes), gpu,
                          int(device.local_hardware_id or 0) if gpu else 0)

  def close(self) -> None:
    self.tier.close()

  def __enter__(self) -> Staging:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def staging_for(platform: str, n: int, piece: int) -> Staging | None:
  """Staging buffers (n of `piece` bytes) for placing weights on a device of `platform`: pinned
  and copied by DMA on a GPU the extension can reach; None on the CPU backend, or where the
  extension has no GPU support or sees no GPU (the loader then uploads with device_put)."""
  if platform == "cpu":
    return None
  ext = extension()
  if ext is None or not ext.gpu_platform() or ext.gpu_device_count() == 0:
    return None
  return Staging(n, piece, backend="gpu")


class ManagedBuffer:
  """Managed (unified) memory; freed by close() / garbage collection / exit. Once freed,
  `address` raises JaxvtError."""

  def __init__(self, address: int, nbytes: int):
    self._address = address
    self.nbytes = nbytes
    self._finalizer = weakref.finalize(self, _ext().managed_free, address)

  @property
  def closed(self) -> bool:
    return not self._finalizer.alive

  @property
  def address(self) -> int:
    if self.closed:
      raise JaxvtError("this managed buffer was freed; allocate a new one")
    return self._address

  def close(self) -> None:
    self._finalizer()


def managed_alloc(nbytes: int) -> ManagedBuffer | None:
  """Managed memory of nbytes, or None where the backend has none (CPU, no concurrent access).

  Managed memory is a measured option, not a default: on discrete AMD parts it does not migrate
  (see docs), and on CUDA its first device read runs at page-fault speed.
  """
  ext = _ext()
  try:
    addr = ext.managed_alloc(int(nbytes))
  except (RuntimeError, MemoryError) as e:
    raise JaxvtError(f"could not allocate {_gib(int(nbytes))} of managed memory ({e}); ask for "
                     f"less") from None
  return None if addr is None else ManagedBuffer(addr, int(nbytes))
