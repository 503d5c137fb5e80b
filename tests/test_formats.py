"""One table of formats per language: jaxvt.gguf.formats (Python) and csrc/common/formats.h (C++,
read through the extension) agree with each other and with the gguf package's ggml sizes."""

from __future__ import annotations

import gguf
import pytest

from jaxvt import ffi
from jaxvt.gguf import formats
from jaxvt.qweight import FMT_MASK, HOST_BIT

needs_ffi = pytest.mark.skipif(ffi.extension() is None, reason="jaxvt extension not built")


def test_python_table_is_ggmls():
  assert sorted(formats.FORMATS) == [0, 1, 2, 3, 8, 12, 13, 14, 30]
  for t, f in formats.FORMATS.items():
    gt = gguf.GGMLQuantizationType(t)
    assert (f.name, f.type_id) == (gt.name, t)
    assert (f.block_elems, f.block_bytes) == gguf.GGML_QUANT_SIZES[gt]
    assert f.kblock_elems % f.block_elems == 0 and f.kblock_elems % formats.KUNIT == 0


@needs_ffi
def test_cpp_table_equals_python_table():
  """formats.h's kFormats and its k-block functions, as the compiled extension has them."""
  cpp = {row[0]: row for row in ffi.extension().formats()}
  assert set(cpp) == set(formats.FORMATS)
  for t, f in formats.FORMATS.items():
    assert cpp[t] == (f.type_id, f.name, f.block_elems, f.block_bytes, f.kblock_elems,
                      f.kblock_bytes), t


@needs_ffi
def test_host_bit_is_the_kernels():
  assert ffi.extension().host_bit() == HOST_BIT and FMT_MASK == HOST_BIT - 1
  assert all(t & FMT_MASK == t for t in formats.FORMATS)
