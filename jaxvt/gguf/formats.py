"""The GGUF block formats jaxvt runs: the one Python table of them.

A row of `cols` elements in a format is `cols // block_elems` consecutive blocks of `block_bytes`
bytes (sizes are ggml's). The kernels walk rows in k-blocks: the format's own block for the
quantized formats (32 or 256 elements), 32 elements for F32 / F16 / BF16, so a matrix the
kernels read needs `cols % 32 == 0`. C++ keeps the same table once, in jaxvt/ffi/csrc/common/formats.h;
tests/test_formats.py compares the two through the extension.

This module needs neither JAX nor the `gguf` package (jaxvt.gguf.quants adds dequantization and
names ggml's other types).
"""

from __future__ import annotations

import dataclasses

from jaxvt.errors import JaxvtError

# ggml type ids (gguf.GGMLQuantizationType).
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30
KUNIT = 32  # elements of the smallest k-block


@dataclasses.dataclass(frozen=True)
class QuantFormat:
  """One GGUF tensor format: `block_elems` elements stored in `block_bytes` bytes."""
  name: str
  type_id: int
  block_elems: int
  block_bytes: int

  @property
  def kblock_elems(self) -> int:
    """Elements of the block the kernels step by (32 for one-element formats)."""
    return max(KUNIT, self.block_elems)

  @property
  def kblock_bytes(self) -> int:
    return self.block_bytes * (self.kblock_elems // self.block_elems)


FORMATS: dict[int, QuantFormat] = {f.type_id: f for f in (
    QuantFormat("F32", F32, 1, 4), QuantFormat("F16", F16, 1, 2),
    QuantFormat("Q4_0", Q4_0, 32, 18), QuantFormat("Q4_1", Q4_1, 32, 20),
    QuantFormat("Q8_0", Q8_0, 32, 34), QuantFormat("Q4_K", Q4_K, 256, 144),
    QuantFormat("Q5_K", Q5_K, 256, 176), QuantFormat("Q6_K", Q6_K, 256, 210),
    QuantFormat("BF16", BF16, 1, 2))}


def _what(type_id: int, name: str | None) -> str:
  n = int(type_id)
  if n in FORMATS:
    return FORMATS[n].name
  return f"{name} (ggml type {n})" if name else f"ggml type {n}"


def get_format(type_id: int, name: str | None = None) -> QuantFormat:
  """The `QuantFormat` of a supported type id; JaxvtError otherwise (`name`: the type's ggml name,
  for the message)."""
  fmt = FORMATS.get(int(type_id))
  if fmt is None:
    supported = ", ".join(f.name for f in FORMATS.values())
    raise JaxvtError(f"tensor format {_what(type_id, name)} is not supported; use a GGUF file "
                     f"whose tensors are {supported} (e.g. re-quantize to Q4_K_M)")
  return fmt


def row_bytes(type_id: int, cols: int, name: str | None = None) -> int:
  """Bytes of one row of `cols` elements in format `type_id`.

  Raises JaxvtError for an unsupported format or `cols` not a positive multiple of the block size.
  """
  fmt = get_format(type_id, name)
  if cols <= 0 or cols % fmt.block_elems:
    raise JaxvtError(
        f"a {fmt.name} row of {cols} elements is not a whole number of {fmt.block_elems}-element "
        f"blocks; use a row length that is a positive multiple of {fmt.block_elems}")
  return cols // fmt.block_elems * fmt.block_bytes
