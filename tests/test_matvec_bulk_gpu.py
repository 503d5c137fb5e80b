"""The matvec kernel's two ways of reading a matrix under ggml's arithmetic give the same bits:
whole rows through the bulk-copy engine (matvec_bulk.cuh, CUDA sm_90+) and the per-warp windows
(bulk=0), from either tier, at stage sizes that cut the matrix into one chunk or hundreds, for 1 to
8 activation rows. Both are also checked against ggml's recipe in numpy-dequantized float64 (a
tolerance: the recipe quantizes the activations). Run on a GPU host: `pytest -m gpu
tests/test_matvec_bulk_gpu.py`."""

from __future__ import annotations

import numpy as np
import pytest

from jaxvt import ffi
from gpu_cases import OK as _OK, REASON as _REASON
from test_ffi_cases import dequant, random_blocks
from test_ffi import Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

# (format, rows, cols): this model family's shapes (a 16-unit row, which the kernel takes two
# rows a warp; 64-unit rows; a 14336-column row of 21 KiB) and odd row counts.
SHAPES = [(Q4_K, 512, 2048), (Q6_K, 2048, 512), (Q4_K, 2048, 512), (Q6_K, 1001, 2048),
          (Q8_0, 777, 1024), (Q4_0, 300, 4096), (Q4_1, 64, 2048), (Q5_K, 513, 2048),
          (Q6_K, 96, 14336)]


def outputs(raw, x, fmt, rows, cols, **kw):
  dbg = ffi.debug_extension()
  raw = np.ascontiguousarray(raw)
  x = np.ascontiguousarray(x, np.float32)
  y = np.full((x.shape[0], rows), np.nan, np.float32)
  dbg.matvec_outputs(fmt, rows, cols, x.shape[0], raw.ctypes.data, x.ctypes.data, y.ctypes.data,
                     **kw)
  return y


@pytest.mark.parametrize("fmt,rows,cols", SHAPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_bulk_and_windows_give_the_same_bits(fmt, rows, cols, batch):
  rng = np.random.default_rng(rows * 31 + cols + batch)
  raw = random_blocks(rng, fmt, rows, cols)
  x = rng.standard_normal((batch, cols)).astype(np.float32)
  base = outputs(raw, x, fmt, rows, cols, bulk=0)
  assert np.isfinite(base).all()
  want = x.astype(np.float64) @ dequant(raw, fmt).astype(np.float64).T
  scale = np.abs(x).max() * np.abs(dequant(raw, fmt)).sum(axis=1).max()
  np.testing.assert_allclose(base, want, atol=0.02 * scale, rtol=0)
  for bulk in (-1, 4096, 65536):  # the default; many small chunks; one chunk a block
    for tier in (True, False):
      for cap in (0, 3):  # the kernel's grid; three blocks looping over every chunk
        got = outputs(raw, x, fmt, rows, cols, bulk=bulk, device_tier=tier, grid_cap=cap)
        assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), (bulk, tier, cap)
