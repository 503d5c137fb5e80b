"""The host tier: pinned, device-mapped host buffers that kernels read in place.

`HostTier` owns every buffer it allocates and frees them on `close()`, on leaving a `with` block,
when it is garbage-collected, or at interpreter exit (a `weakref.finalize` per tier), whichever
comes first. A `HostBuffer` gives a writable numpy uint8 view (`.array`) for the loader to fill
once, and `.device_address`, the value that goes into `QWeight.table`.

Backends (chosen once per tier):
  gpu  `cudaHostAlloc` / `hipHostMalloc` with Mapped | Portable and, on HIP, an explicit
       coherence flag: `coherent=True` is fine-grained memory (device reads bypass the GPU L2),
       `coherent=False` (the default) coarse-grained memory (cached in L2). Weights are written
       once before any kernel reads them, so both are correct; which reads faster is a
       measurement (e.g. jaxvt.ffi._jaxvt_ffi.measure_zero_copy_read(..., coherent=...)). CUDA
       pinned memory is coherent either way and ignores the flag. `kind` picks the allocation:
       "pinned" (the above), "write_combined" (| WriteCombined: device reads are not snooped;
       CPU reads of it are very slow, and the CPU only writes weights into it once) or
       "huge_pages" (2 MiB-aligned anonymous memory with MADV_HUGEPAGE, pinned and mapped with
       cudaHostRegister / hipHostRegister). Which one the device reads fastest is a measurement:
       `python -m jaxvt.bench tier --kinds` (docs/BENCHMARKS.md).
  cpu  page-aligned plain memory (the CPU kernels read it in place as well); used when the
       extension has no GPU support or sees no GPU, or when asked for with backend="cpu".
       "huge_pages" asks for transparent huge pages there too; "write_combined" is GPU-only.

Freeing a buffer invalidates its numpy view and any QWeight whose table holds its address:
close a tier only after the arrays and compiled functions that use it are gone.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from jaxvt.errors import JaxvtError
from jaxvt.ffi import extension


def _ext():
  ext = extension()
  if ext is None:
    raise JaxvtError("the host tier needs jaxvt's compiled extension; reinstall jaxvt "
                     "(pip install -e . --no-build-isolation) so jaxvt.ffi._jaxvt_ffi is built")
  return ext


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB"


class HostBuffer:
  """One host-tier allocation. `array` is a writable uint8 numpy view of its `nbytes` bytes."""

  def __init__(self, host_address: int, device_address: int, nbytes: int):
    self.host_address = host_address
    self.device_address = device_address
    self.nbytes = nbytes
    self._array = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(host_address),
                                dtype=np.uint8)
    self.closed = False

  @property
  def array(self) -> np.ndarray:
    if self.closed:
      raise JaxvtError("this host-tier buffer was freed (its HostTier was closed); load the "
                       "weights again with a new HostTier")
    return self._array

  def __repr__(self) -> str:
    state = "freed" if self.closed else f"device_address=0x{self.device_address:x}"
    return f"HostBuffer(nbytes={self.nbytes}, {state})"


def _free_all(records: list, gpu: bool, lock: threading.Lock) -> None:
  """Frees every buffer in records (list of HostBuffer); safe to call more than once."""
  ext = _ext()
  with lock:
    while records:
      buf = records.pop()
      if not buf.closed:
        buf.closed = True
        buf._array = None
        ext.host_free(buf.host_address, gpu)


KINDS = {"pinned": 0, "write_combined": 1, "huge_pages": 2}  # memory.h HostKind


class HostTier:
  """Owner of pinned host buffers. Use as a context manager or call `close()`."""

  def __init__(self, coherent: bool = False, backend: str | None = None, kind: str = "pinned"):
    """backend: "gpu", "cpu" or None (gpu when the extension has GPU support and sees a GPU);
    kind: "pinned", "write_combined" or "huge_pages" (module docstring)."""
    ext = _ext()
    if kind not in KINDS:
      raise JaxvtError(f"HostTier kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if backend is None:
      backend = "gpu" if ext.gpu_platform() and ext.gpu_device_count() > 0 else "cpu"
    if backend not in ("gpu", "cpu"):
      raise JaxvtError(f"HostTier backend must be 'gpu', 'cpu' or None, got {backend!r}")
    if backend == "gpu" and not (ext.gpu_platform() and ext.gpu_device_count() > 0):
      raise JaxvtError("HostTier(backend='gpu') needs a GPU build of jaxvt and a visible GPU; "
                       "rebuild with JAXVT_GPU=CUDA (or HIP) or use backend='cpu'")
    if backend == "cpu" and kind == "write_combined":
      raise JaxvtError("write-combined host memory exists only for a GPU; use kind='pinned' or "
                       "'huge_pages' with backend='cpu'")
    self.backend = backend
    self.kind = kind
    self.coherent = bool(coherent)
    self._buffers: list[HostBuffer] = []
    self._lock = threading.Lock()
    self._closed = False
    self._finalizer = weakref.finalize(self, _free_all, self._buffers, backend == "gpu",
                                       self._lock)

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
      host, device = ext.host_alloc(nbytes, self.coherent, self.backend == "gpu", KINDS[self.kind])
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

  def close(self) -> None:
    """Frees every buffer (idempotent)."""
    self._closed = True
    self._finalizer()

  def __enter__(self) -> HostTier:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"HostTier(backend={self.backend!r}, kind={self.kind!r}, coherent={self.coherent}, "
            f"buffers={len(self._buffers)}, {'closed' if self._closed else _gib(self.nbytes)})")


class ManagedBuffer:
  """Managed (unified) memory; freed by close() / garbage collection / exit."""

  def __init__(self, address: int, nbytes: int):
    self.address = address
    self.nbytes = nbytes
    self._finalizer = weakref.finalize(self, _ext().managed_free, address)

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
