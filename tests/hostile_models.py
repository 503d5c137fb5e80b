"""Hostile GGUF files for the tests, built at test time from the default model with gguf's writer
(and, for headers no writer would produce, by patching the bytes of one it did produce)."""

from __future__ import annotations

import os
import struct
import unicodedata
from typing import Any, Iterable

import gguf
import numpy as np

from jaxvt.gguf.default_model import default_model_path
from jaxvt.gguf.reader import open_gguf

ARCH_KEY = "general.architecture"


def _add(w: gguf.GGUFWriter, key: str, value: Any) -> None:
  if isinstance(value, bool):
    w.add_bool(key, value)
  elif isinstance(value, int):
    if 0 <= value < 2**32:
      w.add_uint32(key, value)
    elif -2**63 <= value < 2**63:
      w.add_int64(key, value)
    else:
      w.add_uint64(key, value)
  elif isinstance(value, float):
    w.add_float32(key, value)
  elif isinstance(value, str):
    w.add_string(key, value)
  else:
    w.add_array(key, list(value))


def _finish(w: gguf.GGUFWriter) -> None:
  """Writes what `w` holds (header, metadata, tensors) and closes the file."""
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def write_model(path, *, metadata: dict[str, Any] | None = None, drop: Iterable[str] = (),
                tensors: bool | Iterable[str] = False, rename: dict[str, str] | None = None,
                extra_tensors: Iterable[tuple[str, np.ndarray]] = ()) -> str:
  """A GGUF file at `path` with the default model's metadata (keys in `drop` left out, those in
  `metadata` replaced or added; general.architecture included) and, with `tensors` (True: all,
  or a collection of names), its tensors' bytes under their names (`rename` maps some to new
  names), plus `extra_tensors`. Returns str(path)."""
  src = open_gguf(default_model_path())
  md = dict(src.metadata)
  md.update(metadata or {})
  for key in drop:
    md.pop(key, None)
  w = gguf.GGUFWriter(str(path), md.pop(ARCH_KEY, "llama"))
  for key, value in md.items():
    if key not in ("general.alignment",):
      _add(w, key, value)
  keep = set(src.tensors) if tensors is True else set(tensors or ())
  for name, t in src.tensors.items():
    if name in keep:
      dtype = gguf.GGMLQuantizationType(t.type_id)
      w.add_tensor((rename or {}).get(name, name), np.asarray(t.data),
                   raw_dtype=None if dtype == gguf.GGMLQuantizationType.F32 else dtype)
  for name, arr in extra_tensors:
    w.add_tensor(name, arr)
  _finish(w)
  return str(path)


def write_gguf(path, arch: str = "llama", kv: dict[str, Any] | None = None,
               tensors: Iterable[tuple[str, np.ndarray, Any]] = ()) -> str:
  """A valid GGUF file at `path` with only `kv` (and general.architecture = `arch`) and
  `tensors`, each (name, array, gguf raw dtype or None for the array's own); returns str(path)."""
  w = gguf.GGUFWriter(str(path), arch)
  for key, value in (kv or {}).items():
    _add(w, key, value)
  for name, arr, raw_dtype in tensors:
    w.add_tensor(name, arr, raw_dtype=raw_dtype)
  _finish(w)
  return str(path)


def small_gguf(path, kv: dict[str, Any] | None = None) -> bytes:
  """A valid GGUF file with only `kv` (and general.architecture = llama); returns its bytes."""
  with open(write_gguf(path, kv=kv), "rb") as f:
    return f.read()


def patched(path, data: bytes, *patches: tuple[int, str, Any]) -> str:
  """Writes `data` to `path` with each (offset, struct format, value) packed over it."""
  buf = bytearray(data)
  for offset, fmt, value in patches:
    struct.pack_into(fmt, buf, offset, value)
  with open(path, "wb") as f:
    f.write(bytes(buf))
  return str(path)


def control_chars(text: str) -> list[str]:
  """The characters of `text` that are not printable text (newlines excepted)."""
  return [c for c in text if c != "\n" and unicodedata.category(c)[0] == "C"]


def one_line_error(rc: int, out: str, err: str, *needles: str) -> str:
  """Asserts the one-line-error contract; returns the line."""
  assert rc == 2, (rc, err[-2000:])
  assert "Traceback" not in err and "Exception ignored" not in err, err
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("jaxvt: error: "), err
  assert not control_chars(out + err), (out + err)[:2000]
  for n in needles:
    assert n.lower() in lines[0].lower(), (n, lines[0])
  return lines[0]


def fifo(path) -> str:
  os.mkfifo(path)
  return str(path)
