"""Batch invariance of the GPU matvec kernels: a row's result does not depend on how many rows
share the launch (DESIGN: a row alone and the same row inside a batch of 8 give the same bits).
The dense kernels take one row a pass at batch 1 and several above it (kernels_gpu.cu,
plan_launch: 4 a pass, 16 in float32 above 4 rows); the routed experts' kernel serves each slot
alone. Each row's float32 order must be the same on every path, whatever the rows a pass. Run on a GPU host with `pytest -m gpu tests/test_batch_invariance_gpu.py`.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from gpu_cases import OK as _OK, REASON as _REASON
from test_ffi_cases import (BF16, F32, Q4_0, Q4_K, Q6_K, Q8_0, make_stack,  # noqa: F401
                            random_blocks)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device, tier  # noqa: E402,F401  (the GPU fixtures)


@pytest.fixture
def rng():
  return np.random.default_rng(43)


def put(a, device):
  return jax.device_put(a, device)


BATCHES = (1, 2, 3, 5, 8, 9, 16)


@pytest.mark.parametrize("mode", ["q8", "f32"])
@pytest.mark.parametrize("fmt,rows,cols", [(Q4_K, 70, 2048), (Q6_K, 33, 4096), (Q8_0, 96, 512),
                                           (Q4_0, 2048, 256), (BF16, 40, 2048), (F32, 24, 8192)])
def test_dense_row_alone_equals_the_row_in_a_batch(mode, fmt, rows, cols, rng, device, tier):
  """Every row of batches of 1-16 rows equals that row computed alone, bit for bit, from either
  tier (layer 0 device, layer 1 host: the same blocks)."""
  from jaxvt.ffi import ops
  raw = random_blocks(rng, fmt, rows, cols)
  s = make_stack(rng, [fmt, fmt], rows, cols, host=(1,), tier=tier, raws=[raw, raw])
  w = put(s.w, device)
  x = rng.standard_normal((max(BATCHES), cols)).astype(np.float32)
  f = jax.jit(lambda x, w, l: ops.qmatmul(x, w, l, mode))
  alone = np.stack([np.asarray(f(put(x[i:i + 1], device), w, 0))[0] for i in range(len(x))])
  assert np.isfinite(alone).all() and np.abs(alone).max() > 0
  for layer in (0, 1):
    for b in BATCHES:
      got = np.asarray(f(put(x[:b], device), w, layer))
      np.testing.assert_array_equal(got, alone[:b], err_msg=f"batch {b}, layer {layer}")


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_multi_row_alone_equals_the_row_in_a_batch(mode, rng, device):
  """The one-launch form of several matrices (router and shared expert's gate / up of the 35B
  shape, in their formats) keeps each row's bits at any batch."""
  from jaxvt.ffi import ops
  cols = 2048
  stacks = [make_stack(rng, [F32], 64, cols), make_stack(rng, [Q4_K], 128, cols),
            make_stack(rng, [Q6_K], 128, cols)]
  ws = [put(s.w, device) for s in stacks]
  x = rng.standard_normal((8, cols)).astype(np.float32)
  f = jax.jit(lambda x, ws: ops.qmatmul_multi(x, ws, 0, mode))
  alone = [np.concatenate([np.asarray(f(put(x[i:i + 1], device), ws)[j]) for i in range(8)])
           for j in range(len(ws))]
  for b in (2, 5, 8):
    got = f(put(x[:b], device), ws)
    for j in range(len(ws)):
      np.testing.assert_array_equal(np.asarray(got[j]), alone[j][:b], err_msg=f"matrix {j}, batch {b}")


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_experts_token_alone_equals_the_token_in_a_batch(mode, rng, device):
  """The routed experts (8 slots a token, experts of 512 x 2048 in Q4_K): a token's outputs are
  the same bits alone and among 8 tokens."""
  from jaxvt.ffi import ops
  e = make_stack(rng, [Q4_K], 512, 2048, experts=32)
  w = put(e.w, device)
  ids = np.stack([rng.choice(32, 8, replace=False) for _ in range(8)]).astype(np.int32)
  x = rng.standard_normal((8, 2048)).astype(np.float32)
  f = jax.jit(lambda x, w, i: ops.qmatmul_experts(x, w, 0, i, mode))
  alone = np.concatenate([np.asarray(f(put(x[t:t + 1], device), w, put(ids[t:t + 1], device)))
                          for t in range(8)])
  got = np.asarray(f(put(x, device), w, put(ids, device)))
  np.testing.assert_array_equal(got, alone)
