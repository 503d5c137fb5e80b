"""Reading GGUF files through the `gguf` package, memory-mapped.

`open_gguf(path)` returns a `GGUFFile`: decoded metadata and a tensor index whose entries hold
np.memmap views into the file (raw GGUF blocks, rows x row_bytes). Nothing is copied until the
loader places a tensor. Every way a file can be wrong becomes a one-line JaxvtError.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import numpy as np

from jaxvt.errors import JaxvtError

GGUF_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  type_id: int  # ggml type id
  shape: tuple[int, ...]  # numpy order: rows... , cols (cols = GGUF ne0, contiguous)
  data: np.ndarray  # memmap view: uint8 [..., row_bytes] for block formats; typed for floats
  n_bytes: int

  def raw(self) -> np.ndarray:
    """The tensor's bytes as uint8 [prod(shape[:-1]), row_bytes] (a view; no copy)."""
    flat = self.data.reshape(-1).view(np.uint8)
    rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
    return flat.reshape(rows, -1)


@dataclasses.dataclass
class GGUFFile:
  path: str
  metadata: dict[str, Any]
  tensors: dict[str, TensorInfo]
  _reader: Any = None  # keeps the memmap alive

  @property
  def arch(self) -> str:
    return str(self.metadata.get("general.architecture", ""))


def _decode_field(field) -> Any:
  try:
    return field.contents()
  except Exception:  # an undecodable value is reported by whoever needs the key
    return None


def check_path(path: str) -> int:
  """Cheap checks (exists, is a file, GGUF magic); returns the size. Raises JaxvtError."""
  if not os.path.exists(path):
    raise JaxvtError(f"model file not found: {path} (pass --model PATH to a .gguf file)")
  if os.path.isdir(path):
    raise JaxvtError(f"{path} is a directory; pass --model PATH to a .gguf file")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise JaxvtError(f"{path} is not a GGUF file (magic {magic!r}); convert the model with "
                     "llama.cpp's convert_hf_to_gguf.py")
  return size


@functools.cache
def _reader_class():
  import gguf

  class Reader(gguf.GGUFReader):
    """gguf's reader, slicing a plain ndarray view of its np.memmap: the reader slices once per
    metadata element (about a million times for a 248k-token vocabulary), and np.memmap's
    __getitem__/__array_finalize__ made that 3-4x slower (20-30 s for a Qwen3.6 file)."""

    def _get(self, offset, dtype, count=1, override_order=None):
      flat = self.__dict__.get("_flat")
      if flat is None:
        flat = self.__dict__["_flat"] = self.data.view(np.ndarray)
      dt = np.dtype(dtype)
      count = int(count)
      arr = flat[offset:offset + dt.itemsize * count].view(dt)[:count]
      return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None
                                             else override_order))

  return Reader


def open_gguf(path: str) -> GGUFFile:
  """Opens and validates `path`; raises JaxvtError for missing, non-GGUF or truncated files."""
  size = check_path(path)
  try:
    reader = _reader_class()(path, "r")
  except (ValueError, IndexError, OSError, KeyError, EOFError) as e:
    raise JaxvtError(f"{path} is truncated or corrupt ({type(e).__name__}: {e}); "
                     "download or convert it again") from None
  metadata = {k: _decode_field(f) for k, f in reader.fields.items()}
  tensors: dict[str, TensorInfo] = {}
  for t in reader.tensors:
    if t.name in tensors:
      raise JaxvtError(f"{path} holds tensor '{t.name}' twice; the file is corrupt")
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size:
      raise JaxvtError(f"{path} is truncated: tensor '{t.name}' ends at byte {end} of {size}; "
                       "download or convert it again")
    shape = tuple(int(n) for n in reversed([int(x) for x in t.shape]))
    tensors[t.name] = TensorInfo(t.name, int(t.tensor_type), shape, t.data, int(t.n_bytes))
  return GGUFFile(path, metadata, tensors, reader)
