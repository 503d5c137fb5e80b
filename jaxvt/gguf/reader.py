"""Reading GGUF files, memory-mapped: one walk of the header, every length checked.

`open_gguf(path)` returns a `GGUFFile`: decoded metadata and a tensor index whose entries hold
numpy views into one read-only memory map of the file (raw GGUF blocks, rows x row_bytes).
Nothing is copied until the loader places a tensor. `read_metadata(path, prefixes)` is the same
walk for the key/value section alone (the tokenizer's metadata without the tensor index).

A GGUF file is untrusted input. `check_path` opens it without blocking and refuses anything but
a readable, non-empty regular file (a FIFO, a directory, a device, an empty path) before a byte
is read; the header walk bounds every count and length by the file's size, so a hostile file
cannot make it allocate more than the file holds or loop past its end. Every way a file can be
wrong is a one-line JaxvtError.

The walk builds only what is kept: a Python value per metadata entry (arrays of strings as
lists of str, numeric arrays as lists) and a view per tensor. gguf.GGUFReader, which builds two
numpy views per array element (about 200,000 for a 49k-token vocabulary), took most of a load's
time and fragmented the Python heap: its short-lived objects interleaved with objects JAX keeps
for the life of the process, and each load left arenas pinned (~1 MiB of RSS per load/close).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import stat
import struct
from typing import Any, Callable, Iterable, Iterator, Mapping

import gguf
import numpy as np

from jaxvt.errors import JaxvtError, escape

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays nest at most this deep
LAZY_ARRAY = 1024  # open_gguf decodes arrays this long (the vocabulary) when they are read

# GGUF value types (gguf.GGUFValueType) -> struct format; 8 (string) and 9 (array) apart.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Tensor types gguf.GGUFReader exposes as typed elements; every other type as raw uint8 blocks.
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
          28: np.float64}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  type_id: int  # ggml type id
  shape: tuple[int, ...]  # numpy order: rows... , cols (cols = GGUF ne0, contiguous)
  data: np.ndarray  # memmap view: uint8 [..., row_bytes] for block formats; typed for floats
  n_bytes: int
  offset: int = -1  # where its bytes start in the file (-1: not from a file)

  def raw(self) -> np.ndarray:
    """The tensor's bytes as uint8 [prod(shape[:-1]), row_bytes] (a view; no copy)."""
    flat = self.data.reshape(-1).view(np.uint8)
    rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
    return flat.reshape(rows, -1)


class Metadata(Mapping):
  """A GGUF file's key/value metadata as a read-only mapping. Arrays of LAZY_ARRAY elements or
  more (the vocabulary: tokens, merges, token types) are decoded from the file each time they
  are read and never held here, so an opened file keeps no Python object per token."""

  def __init__(self, buf, values: dict[str, Any], lazy: dict[str, tuple[int, int]]):
    self._buf, self._values, self._lazy = buf, values, lazy

  def __getitem__(self, key: str) -> Any:
    if key in self._lazy:
      pos, size = self._lazy[key]
      w = _Walk(self._buf, size)
      w.pos = pos
      return w.value(_ARRAY, f"metadata '{key}'", True)
    return self._values[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._values)

  def __len__(self) -> int:
    return len(self._values)

  def __repr__(self) -> str:
    return f"Metadata({len(self)} keys, {len(self._lazy)} arrays read on use)"


@dataclasses.dataclass
class GGUFFile:
  path: str
  metadata: Mapping[str, Any]
  tensors: dict[str, TensorInfo]
  _map: Any = None  # the file's memory map, which every tensor view shares
  _file: Any = None  # the file, open (read_into reads it with pread)

  @property
  def arch(self) -> str:
    return str(self.metadata.get("general.architecture", ""))

  @property
  def identity(self) -> tuple[int, int, int, int] | None:
    """(device, inode, size, modification time in ns) of the open file: what a tokenizer built
    from this file's metadata carries, so that jaxvt.load can take it instead of building it
    again (None once closed)."""
    if self._file is None or self._file.closed:
      return None
    st = os.fstat(self._file.fileno())
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

  def read_into(self, dst: np.ndarray, t: TensorInfo, start: int = 0) -> None:
    """dst (flat uint8, written whole) = bytes [start, start + dst.size) of tensor t, read from
    the open file with pread: one copy from the page cache in the kernel, with no page of the
    memory map faulted into this process (docs/BENCHMARKS.md, "Reading the weights"), and a
    file cut short since it was opened is the one-line error where a read through the map
    ends the process (SIGBUS). Releases the GIL while it reads."""
    if self._file is None or t.offset < 0 or start < 0 or start + dst.size > t.n_bytes:
      raise ValueError(f"read_into: bytes {start}..{start + dst.size} of tensor '{t.name}' "
                       "are not in this file")
    view, pos, fd = memoryview(dst).cast("B"), t.offset + start, self._file.fileno()
    while len(view):
      got = os.preadv(fd, [view], pos)
      if got <= 0:
        raise self._ended_early(t)
      view, pos = view[got:], pos + got

  def _ended_early(self, t: TensorInfo) -> JaxvtError:
    return JaxvtError(f"{escape(self.path)} changed while it was read (tensor "
                      f"'{escape(t.name, 80)}' ends early); open it again")


  def read_ranges(self, parts: list[tuple[TensorInfo, int, int, int]],
                  read: Callable[[int, list[tuple[int, int, int]]], int]) -> None:
    """read_into for many pieces at once: each (tensor, start, destination address, bytes) part
    gets bytes [start, start + bytes) of its tensor, read by `read(fd, [(file offset, address,
    bytes), ...])` (the extension's read_ranges: native threads, the GIL released once), which
    returns -1, or the file offset where the file ended early (the error read_into raises)."""
    for t, start, _, n in parts:
      if self._file is None or t.offset < 0 or start < 0 or n < 0 or start + n > t.n_bytes:
        raise ValueError(f"read_ranges: bytes {start}..{start + n} of tensor '{t.name}' are not "
                         "in this file")
    short = read(self._file.fileno(), [(t.offset + s, a, n) for t, s, a, n in parts])
    if short >= 0:
      raise self._ended_early(next((t for t, s, _, n in parts
                                    if t.offset + s <= short < t.offset + s + n), parts[0][0]))


def check_path(path: str) -> int:
  """Checks that `path` is a readable, non-empty regular file starting with the GGUF magic;
  returns its size. Raises JaxvtError. Opens without blocking (a FIFO or a device never stalls
  it) and looks at the type of what it opened, not at the name."""
  if not isinstance(path, (str, os.PathLike)):
    raise JaxvtError(f"the model path must be a str or os.PathLike, not {type(path).__name__}")
  if not os.fspath(path):
    raise JaxvtError("the model path is empty; pass --model PATH to a .gguf file (or leave "
                     "--model out for the default model)")
  path = os.fspath(path)
  shown = escape(path)
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
  except FileNotFoundError:
    raise JaxvtError(f"model file not found: {shown} (pass --model PATH to a .gguf file)") from None
  except IsADirectoryError:
    raise JaxvtError(f"{shown} is a directory; pass --model PATH to a .gguf file") from None
  except PermissionError:
    raise JaxvtError(f"cannot read {shown}: permission denied; make the file readable or copy "
                     "it somewhere you can read") from None
  except OSError as e:
    raise JaxvtError(f"cannot open {shown} ({escape(e.strerror or e)}); pass --model PATH to a "
                     ".gguf file") from None
  try:
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
      raise JaxvtError(f"{shown} is a directory; pass --model PATH to a .gguf file")
    if not stat.S_ISREG(st.st_mode):
      kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a socket"
              if stat.S_ISSOCK(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
              or stat.S_ISBLK(st.st_mode) else "not a regular file")
      raise JaxvtError(f"{shown} is {kind}, not a file; pass --model PATH to a .gguf file")
    if st.st_size == 0:
      raise JaxvtError(f"{shown} is empty (0 bytes); download or convert the model again")
    try:
      magic = os.pread(fd, 4, 0)
    except OSError as e:
      raise JaxvtError(f"cannot read {shown} ({escape(e.strerror or e)}); download or copy the "
                       "model again") from None
  finally:
    os.close(fd)
  if magic != GGUF_MAGIC:
    raise JaxvtError(f"{shown} is not a GGUF file (magic {magic!r}); convert the model with "
                     "llama.cpp's convert_hf_to_gguf.py")
  return st.st_size


class _Corrupt(Exception):
  """A header that does not hold together; open_gguf turns it into the one-line error."""


_U64 = struct.Struct("<Q")


class _Walk:
  """A cursor over the header bytes; every read is bounded by the file's end."""

  def __init__(self, buf, size: int):
    self.buf, self.size, self.pos = buf, size, 0

  def need(self, n: int, what: str) -> None:
    if n < 0 or self.pos + n > self.size:
      raise _Corrupt(f"{what} runs past the end of the file (needs {n} bytes at byte {self.pos})")

  def scalar(self, fmt: str, what: str):
    n = struct.calcsize(fmt)
    self.need(n, what)
    (v,) = struct.unpack_from(fmt, self.buf, self.pos)
    self.pos += n
    return v

  def string(self, what: str, keep: bool = True) -> str | None:
    n = self.scalar("<Q", what)
    self.need(n, what)
    s = (bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace") if keep
         else None)
    self.pos += n
    return s

  def strings(self, count: int, what: str, keep: bool) -> list[str] | None:
    """`count` strings in a row (a vocabulary: tens of thousands), as `string` reads them one
    at a time, in one tight loop."""
    buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
    out = [] if keep else None
    for _ in range(count):
      if pos + 8 > size:
        self.pos = pos
        self.need(8, what)
      (n,) = unpack(buf, pos)
      pos += 8
      if n > size - pos:
        self.pos = pos
        self.need(n, what)
      if keep:
        out.append(str(buf[pos:pos + n], "utf-8", "replace"))
      pos += n
    self.pos = pos
    return out

  def value(self, vtype: int, what: str, keep: bool, depth: int = 0) -> Any:
    if vtype == _STRING:
      return self.string(what, keep)
    if vtype in _SCALAR:
      return self.scalar(_SCALAR[vtype], what)
    if vtype != _ARRAY:
      raise _Corrupt(f"{what} has unknown value type {vtype}")
    if depth >= MAX_ARRAY_DEPTH:
      raise _Corrupt(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
    etype = self.scalar("<I", what)
    count = self.scalar("<Q", what)
    if etype in _SCALAR:
      dt = np.dtype(_SCALAR[etype])
      self.need(count * dt.itemsize, what)
      out = (np.frombuffer(self.buf, dt, count, self.pos).tolist() if keep and count else
             [] if keep else None)
      self.pos += count * dt.itemsize
      return out
    if etype not in (_STRING, _ARRAY):
      raise _Corrupt(f"{what} is an array of unknown value type {etype}")
    self.need(count * 8, what)  # every element takes at least its 8-byte length
    if etype == _STRING:
      return self.strings(count, what, keep)
    out = [] if keep else None
    for _ in range(count):
      v = self.value(etype, what, keep, depth + 1)
      if keep:
        out.append(v)
    return out


def _walk_metadata(w: _Walk, n_kv: int, prefixes: tuple[str, ...] | None,
                   lazy: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
  """The metadata's values by key (keys starting with `prefixes`, when given). With `lazy`,
  arrays of LAZY_ARRAY elements or more are walked (checked) but not decoded: their positions
  go into `lazy` and their keys map to None."""
  md: dict[str, Any] = {}
  w.need(n_kv * 12, "the metadata")  # a key (8-byte length) and a type (4 bytes) each
  for i in range(n_kv):
    key = w.string(f"metadata key {i}")
    vtype = w.scalar("<I", f"metadata '{key}'")
    keep = prefixes is None or key.startswith(prefixes)
    if keep and key in md:
      raise _Corrupt(f"metadata key '{escape(key, 80)}' appears twice")
    start = w.pos
    if lazy is not None and vtype == _ARRAY and w.size - w.pos >= 12 and struct.unpack_from(
        "<Q", w.buf, w.pos + 4)[0] >= LAZY_ARRAY:
      w.value(vtype, f"metadata '{key}'", False)
      lazy[key] = (start, w.size)
      md[key] = None
      continue
    value = w.value(vtype, f"metadata '{key}'", keep)
    if keep:
      md[key] = value
  return md


def _header(buf, size: int) -> tuple[_Walk, int, int]:
  """(cursor after the counts, tensor count, key/value count)."""
  w = _Walk(buf, size)
  w.need(24, "the header")
  if bytes(buf[:4]) != GGUF_MAGIC:
    raise _Corrupt(f"the magic is {bytes(buf[:4])!r}, not b'GGUF'")
  version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
  if version not in VERSIONS:
    if version & 0xFFFF == 0:
      raise _Corrupt("it is a big-endian GGUF file, which jaxvt does not read")
    raise _Corrupt(f"it is GGUF version {version}; jaxvt reads versions "
                   f"{', '.join(map(str, VERSIONS))}")
  w.pos = 24
  return w, n_tensors, n_kv


def _tensor_infos(w: _Walk, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
  w.need(n_tensors * 24, "the tensor index")  # name length, n_dims, type, offset at least
  infos = []
  for i in range(n_tensors):
    name = w.string(f"tensor {i}'s name")
    n_dims = w.scalar("<I", f"tensor '{name}'")
    if not 1 <= n_dims <= MAX_DIMS:
      raise _Corrupt(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    w.need(8 * n_dims, f"tensor '{name}'")
    dims = struct.unpack_from(f"<{n_dims}Q", w.buf, w.pos)
    w.pos += 8 * n_dims
    type_id = w.scalar("<I", f"tensor '{name}'")
    offset = w.scalar("<Q", f"tensor '{name}'")
    infos.append((name, tuple(reversed(dims)), type_id, offset))
  return infos


def _tensor(mm: np.ndarray, path: str, name: str, shape: tuple[int, ...], type_id: int,
            start: int, size: int) -> TensorInfo:
  shown = escape(name, 80)
  try:
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
  except (ValueError, KeyError):
    raise _Corrupt(f"tensor '{shown}' has unknown type id {type_id}") from None
  n = 1
  for d in shape:
    n *= d
  if shape[-1] % block:
    raise _Corrupt(f"tensor '{shown}' has {shape[-1]} columns, not whole blocks of {block}")
  n_bytes = n // block * type_size
  end = start + n_bytes
  if end > size:
    raise JaxvtError(f"{escape(path)} is truncated: tensor '{shown}' ends at byte {end} of "
                     f"{size}; download or convert it again")
  raw = mm[start:end]
  if type_id in _TYPED:
    dt = np.dtype(_TYPED[type_id])
    if start % dt.itemsize:
      raise _Corrupt(f"tensor '{shown}' starts at byte {start}, not aligned for {dt}")
    data = raw.view(dt).reshape(shape)
  else:
    data = raw.reshape(shape[:-1] + (shape[-1] // block * type_size,))
  return TensorInfo(name, type_id, shape, data, n_bytes, start)


def _map(path: str, size: int):
  """(the file's memory map, the file open for reading: the same inode the map shows)."""
  f = open(path, "rb", buffering=0)
  try:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  except BaseException:
    f.close()
    raise
  if len(m) != size:  # the file changed between the check and the map
    m.close()
    f.close()
    raise JaxvtError(f"{escape(path)} changed while it was being opened; try again")
  return m, f


def _corrupt(path: str, e: Exception) -> JaxvtError:
  return JaxvtError(f"{escape(path)} is truncated or corrupt ({escape(e, 200)}); download or "
                    "convert it again")


def open_gguf(path: str) -> GGUFFile:
  """Opens and validates `path`; raises JaxvtError for a missing, unreadable, special, empty,
  non-GGUF, truncated or corrupt file."""
  size = check_path(path)
  path = os.fspath(path)
  m, f = _map(path, size)
  mm = np.frombuffer(m, np.uint8)  # the tensors' views share it; it keeps the map alive
  try:
    w, n_tensors, n_kv = _header(m, size)
    lazy: dict[str, tuple[int, int]] = {}
    metadata = Metadata(m, _walk_metadata(w, n_kv, None, lazy), lazy)
    infos = _tensor_infos(w, n_tensors)
    align = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
      raise _Corrupt(f"general.alignment is {escape(align, 40)}, not a power of two")
    data_start = -(-w.pos // align) * align
    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_id, offset in infos:
      if name in tensors:
        raise JaxvtError(f"{escape(path)} holds tensor '{escape(name, 80)}' twice; the file is "
                         "corrupt")
      tensors[name] = _tensor(mm, path, name, shape, type_id, data_start + offset, size)
  except _Corrupt as e:
    f.close()
    raise _corrupt(path, e) from None
  except BaseException:
    f.close()
    raise
  return GGUFFile(path, metadata, tensors, mm, f)


def read_metadata(path: str, prefixes: Iterable[str] | None = None) -> dict[str, Any]:
  """The key/value metadata of the GGUF file at `path` (only keys starting with one of
  `prefixes`, when given), decoded as open_gguf decodes it; tensor data is never touched."""
  size = check_path(path)
  path = os.fspath(path)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    try:
      w, _, n_kv = _header(m, min(size, len(m)))
      return _walk_metadata(w, n_kv, tuple(prefixes) if prefixes is not None else None)
    except _Corrupt as e:
      raise _corrupt(path, e) from None
