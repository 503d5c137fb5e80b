"""Bytes onto the device and into host buffers, for the loader: a stack's rows (Row: a tensor of
the open file, or an array) written on copy threads in COPY_CHUNK pieces, packed on the host and
uploaded in pieces under a budget of host bytes (Budget), or read into pinned staging buffers
and copied by the extension straight into the device array (device_stack); LoadTimes keeps the
books of where the time went. jaxvt.loader decides what goes where and calls these.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi
from jaxvt.gguf.reader import GGUFFile, TensorInfo


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _set_rows(buf, i, rows, axis: int = 0):
  return jax.lax.dynamic_update_slice_in_dim(buf, rows, i, axis)


COPY_CHUNK = 64 << 20  # bytes per thread task when reading or copying a row
# Bytes of a device stack uploaded per transfer on an accelerator. A GPU client copies a host
# array into pinned staging memory of the array's size while device_put runs; pinning
# multi-GiB buffers is slow and they stay pinned, so stacks go up in pieces that reuse it.
UPLOAD_PIECE = 512 << 20


def upload_max() -> int:
  """Host bytes of packed stacks held at once: a quarter of free RAM, >= 1 GiB."""
  try:
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):
    free = 0
  return max(1 << 30, free // 4)


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1),
                                               thread_name_prefix="jaxvt-copy")


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of a stack: `size` bytes that `write(dst, start)` puts into dst (flat uint8):
  the row's bytes [start, start + dst.size). Writers run on threads and release the GIL.
  `file`: (GGUFFile, TensorInfo) when the row is a whole tensor of an open file (file_row),
  which the staged path reads on native threads (GGUFFile.read_ranges)."""
  size: int
  write: Callable[[np.ndarray, int], None]
  file: tuple | None = None


def array_row(a: np.ndarray) -> Row:
  """A row copied from an array (a view into the file's memory map, or a shard of one)."""
  a = np.asarray(a).reshape(-1)
  return Row(a.size, lambda dst, start: np.copyto(dst, a[start:start + dst.size]))


def file_row(gf: GGUFFile, t: TensorInfo) -> Row:
  """A whole tensor's bytes, read from the open file (GGUFFile.read_into)."""
  return Row(t.n_bytes, lambda dst, start: gf.read_into(dst, t, start), (gf, t))


def _as_row(r) -> Row:
  return r if isinstance(r, Row) else array_row(r())


def write_rows(dsts: list[np.ndarray], rows: list[Row], starts: list[int] | None = None) -> None:
  """dsts[i][:] = rows[i]'s bytes from starts[i] on (default 0), in COPY_CHUNK pieces on the copy
  threads."""
  starts = starts or [0] * len(rows)
  jobs = [(dst[i:i + COPY_CHUNK], r, s + i) for dst, r, s in zip(dsts, rows, starts)
          for i in range(0, dst.size, COPY_CHUNK)]
  if len(jobs) <= 1:
    for d, r, i in jobs:
      r.write(d, i)
    return
  for f in [_pool().submit(r.write, d, i) for d, r, i in jobs]:
    f.result()


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
  """dst[:] = src for flat uint8 arrays, in COPY_CHUNK pieces on threads (numpy drops the GIL
  while copying)."""
  write_rows([dst], [array_row(src)])


def pack_rows(tensors: list[TensorInfo], stride: int) -> np.ndarray:
  """uint8 [len(tensors), stride]: each tensor's raw bytes in one row, zero-padded."""
  return _pack([array_row(t.raw()) for t in tensors], stride)


def _pack(rows: list, stride: int) -> np.ndarray:
  rows = [_as_row(r) for r in rows]
  out = np.empty((len(rows), stride), np.uint8)
  for dst, r in zip(out, rows):
    dst[r.size:] = 0
  write_rows([dst[:r.size] for dst, r in zip(out, rows)], rows)
  return out


class Budget:
  """Host bytes of packed pieces alive at once, across the threads that place stacks: a piece
  waits until it fits under `limit` (or nothing else is held)."""

  def __init__(self, limit: int):
    self.limit, self.held = limit, 0
    self._cv = threading.Condition()

  @contextlib.contextmanager
  def hold(self, n: int):
    with self._cv:
      self._cv.wait_for(lambda: self.held == 0 or self.held + n <= self.limit)
      self.held += n
    try:
      yield
    finally:
      with self._cv:
        self.held -= n
        self._cv.notify_all()


@dataclasses.dataclass
class LoadTimes:
  """Where placing spent its time, summed over the threads that did it (they overlap, so the
  parts add up to more than the wall time): `read` packing rows from the file, `upload`
  handing packed stacks to the device, `host` filling host-tier buffers, `arrays` making the
  device stacks' arrays (the staged path, once), `wait` waiting for a staging buffer; bytes
  of each."""
  read: float = 0.0
  upload: float = 0.0
  host: float = 0.0
  arrays: float = 0.0
  wait: float = 0.0
  read_bytes: int = 0
  upload_bytes: int = 0
  host_bytes: int = 0
  arrays_bytes: int = 0
  wait_bytes: int = 0
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def add(self, part: str, seconds: float, nbytes: int) -> None:
    with self._lock:
      setattr(self, part, getattr(self, part) + seconds)
      setattr(self, part + "_bytes", getattr(self, part + "_bytes") + nbytes)


def _fill_range(dst: np.ndarray, rows: list[Row], stride: int, lo: int,
                address: int | None = None) -> None:
  """dst (flat uint8) = bytes [lo, lo + dst.size) of the stack whose row i is rows[i] at
  i * stride, zero-padded to stride. With dst's `address` (memory that stays put: a staging
  buffer), file rows are read by the extension on native threads in one call per file."""
  hi = lo + dst.size
  ext = ffi.extension() if address is not None else None  # read(fd, ranges): native threads
  read = (None if ext is None or not hasattr(ext, "read_ranges") else lambda fd, ranges:
          ext.read_ranges(fd, ranges, _pool()._max_workers, COPY_CHUNK))  # pylint: disable=protected-access
  dsts, parts, starts, native = [], [], [], {}
  for i in range(lo // stride, -(-hi // stride)):
    a, b = max(lo, i * stride), min(hi, (i + 1) * stride)  # this row's slice of [lo, hi)
    end = min(b, i * stride + rows[i].size)  # where its bytes end and padding starts
    if end > a and read and rows[i].file:
      gf, t = rows[i].file
      native.setdefault(id(gf), (gf, []))[1].append((t, a - i * stride, address + a - lo, end - a))
    elif end > a:
      dsts.append(dst[a - lo:end - lo])
      parts.append(rows[i])
      starts.append(a - i * stride)
    dst[max(a, end) - lo:b - lo] = 0
  write_rows(dsts, parts, starts)
  for gf, items in native.values():
    gf.read_ranges(items, read)


def _staged_stack(rows: list[Row], stride: int, device, lead: int, staging,
                  times: LoadTimes, data: jax.Array | None = None) -> jax.Array:
  """device_stack through pinned buffers (host_tier.Staging): each piece of the stack read into
  one, then copied by the extension straight into the device array's memory: `data` (made by
  the loader, one program for every stack) or a new one. Nothing else reads or writes that
  array until it is returned (it is ready before the first copy)."""
  shape = (1,) * lead + (len(rows), stride)
  data = jnp.zeros(shape, jnp.uint8, device=device) if data is None else data
  if data.shape != shape:
    raise ValueError(f"the stack's device array is {data.shape}, not {shape}")
  data.block_until_ready()
  dst = data.unsafe_buffer_pointer()
  total = len(rows) * stride
  for lo in range(0, total, staging.piece):
    n = min(staging.piece, total - lo)
    tw = time.perf_counter()
    with staging.buffer() as buf:
      t0 = time.perf_counter()
      times.add("wait", t0 - tw, 0)
      _fill_range(buf.array[:n], rows, stride, lo, buf.host_address)
      t1 = time.perf_counter()
      staging.upload(dst + lo, buf, n, device)
      times.add("read", t1 - t0, n)
      times.add("upload", time.perf_counter() - t1, n)
  return data


def device_stack(rows: list, stride: int, device, lead: int = 0,
                  budget: Budget | None = None, times: LoadTimes | None = None,
                  staging=None, data: jax.Array | None = None) -> jax.Array:
  """uint8 [(1,) * lead, len(rows), stride] on `device` (row i: rows[i] zero-padded). With
  `staging` (host_tier.Staging), through its pinned buffers (_staged_stack). Otherwise packed
  on the host and uploaded in one transfer, or in pieces (UPLOAD_PIECE on an accelerator, at
  most upload_max() bytes) written into one donated device array (device memory stays 1x)."""
  times = times or LoadTimes()
  if staging is not None:
    return _staged_stack([_as_row(r) for r in rows], stride, device, lead, staging, times, data)
  budget = budget or Budget(upload_max())
  piece = upload_max() if device.platform == "cpu" else min(UPLOAD_PIECE, upload_max())
  per = max(1, piece // stride)
  lead_shape = (1,) * lead

  def packed(part: list) -> np.ndarray:
    t0 = time.perf_counter()
    arr = _pack(part, stride).reshape(lead_shape + (len(part), stride))
    times.add("read", time.perf_counter() - t0, arr.nbytes)
    return arr

  def put(arr: np.ndarray) -> jax.Array:
    t0 = time.perf_counter()
    out = jax.device_put(arr, device)  # returns once the host array has been taken
    times.add("upload", time.perf_counter() - t0, arr.nbytes)
    return out

  if len(rows) <= per:
    with budget.hold(len(rows) * stride):
      return put(packed(rows))
  data = jnp.zeros(lead_shape + (len(rows), stride), jnp.uint8, device=device)
  for i in range(0, len(rows), per):
    with budget.hold(min(per, len(rows) - i) * stride):
      data = _set_rows(data, jnp.int32(i), put(packed(rows[i:i + per])), lead)
  return data

