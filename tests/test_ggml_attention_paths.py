"""The CPU attention kernel's AVX2 copy gives the portable copy's bits (both follow ggml's order),
for every recipe (1 query or several; f16 or f32 cache), ragged lengths, a GQA group, columns and
head sizes that leave a remainder past the 8-wide blocks, scores far apart (ggml_v_expf's
underflow branch), and any thread count. The portable copy itself is checked against the jnp
formula and float64 in tests/test_ffi.py, and the whole against llama.cpp in
tests/test_llamacpp_match.py."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxvt import ffi

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="jaxvt's extension is not built (pip install -e .)")

if ffi.available("cpu"):
  from jaxvt.ffi import steps


def _run(q, kc, vc, pos, nq, kv_len, scale):
  f = jax.jit(functools.partial(steps.attention, kv_len=kv_len, scale=scale, kernels=True))
  return np.asarray(f(q, kc, vc, np.int32(1), pos, nq))


def _fast_and_portable(ext, args):
  """The AVX2 path's output at 2 threads (checked equal to 1 thread's) and the portable path's."""
  n0 = ext.cpu_threads()
  try:
    ext.set_cpu_threads(2)
    fast = _run(*args)
    ext.set_cpu_threads(1)
    np.testing.assert_array_equal(_run(*args), fast)
    ext.set_cpu_isa("generic")
    return fast, _run(*args)
  finally:
    ext.set_cpu_isa("auto")
    ext.set_cpu_threads(n0)

@pytest.mark.parametrize("cache", ["float16", "float32"])
@pytest.mark.parametrize("t", [1, 2, 37])
@pytest.mark.parametrize("D,Dv", [(64, 64), (48, 36)])
@pytest.mark.parametrize("spread", [1.0, 40.0])
def test_avx2_attention_is_the_portable_bits(cache, t, D, Dv, spread):
  ext = ffi.extension()
  if ext.cpu_isa() != "avx2":
    pytest.skip("this CPU has no AVX2+FMA+F16C path to compare")
  rng = np.random.default_rng(7 + t + D)
  A, b, S, H, K, kv_len = 2, 2, 304, 6, 2, 296  # kv_len % 32 == 8: vec_dot's double tail
  cd = np.dtype(cache)
  kc = (rng.standard_normal((A, b, S, K, D)) * 2).astype(cd)
  vc = rng.standard_normal((A, b, S, K, Dv)).astype(cd)
  q = (rng.standard_normal((b, t, H, D)) * spread).astype(np.float32)
  # row 0 ends at the last cached position and beyond (clamped), row 1 at ragged lengths
  pos = np.stack([np.arange(kv_len - t + 3, kv_len + 3),
                  np.arange(5, 5 + 7 * t, 7)]).astype(np.int32)
  nq = np.array([t, max(t - 1, 1)], np.int32)
  args = (q, kc, vc, pos, nq, kv_len, 0.125)
  fast, portable = _fast_and_portable(ext, args)
  assert np.isfinite(fast).all()
  np.testing.assert_array_equal(fast.view(np.uint32), portable.view(np.uint32))


@pytest.mark.parametrize("H,K", [(9, 3), (8, 2)])
def test_tiled_prompt_attention_is_the_portable_bits(H, K):
  """A prefill-sized call (>= 16 query tokens, f16 cache) takes the tiled AVX2 kernel: its bits
  are the portable per-query copy's for a GQA group of 3 (the default model's) or 4 (a group
  split into tiles of 3 and 1), a row of llama.cpp's one-token recipe inside the call (n_query
  1: per query), padding queries, a position that sees nothing, a row of positions that jump, and
  1 or 2 threads; and a query row's bits do not change with the tokens that share its call."""
  ext = ffi.extension()
  if ext.cpu_isa() != "avx2":
    pytest.skip("this CPU has no AVX2+FMA+F16C path to compare")
  rng = np.random.default_rng(11 + H)
  A, b, S, D, t, kv_len = 1, 3, 360, 64, 40, 352
  kc = (rng.standard_normal((A, b, S, K, D)) * 2).astype(np.float16)
  vc = rng.standard_normal((A, b, S, K, D)).astype(np.float16)
  q = (rng.standard_normal((b, t, H, D)) * 3).astype(np.float32)
  pos = np.stack([np.arange(300, 300 + t), np.arange(-1, t - 1),
                  np.sort(rng.choice(kv_len, t, replace=False))]).astype(np.int32)
  nq = np.array([1, t, t - 5], np.int32)
  args = (q, kc, vc, pos, nq, kv_len, 0.125)
  fast, portable = _fast_and_portable(ext, args)
  assert np.isfinite(fast).all() and np.abs(fast[1, 1:]).max() > 0
  np.testing.assert_array_equal(fast[1, 0], 0.0)  # position -1 sees nothing
  np.testing.assert_array_equal(fast[2, t - 5:], 0.0)  # padding
  np.testing.assert_array_equal(fast.view(np.uint32), portable.view(np.uint32))
  # row 2's first 17 tokens alone (still a tiled call), and its token 3 in a 2-token call
  few = _run(q[2:, :17], kc[:, 2:], vc[:, 2:], pos[2:, :17], np.array([17], np.int32), kv_len,
             0.125)
  np.testing.assert_array_equal(few[0].view(np.uint32), fast[2, :17].view(np.uint32))
  two = _run(q[2:, 3:5], kc[:, 2:], vc[:, 2:], pos[2:, 3:5], np.array([2], np.int32), kv_len,
             0.125)
  np.testing.assert_array_equal(two[0].view(np.uint32), fast[2, 3:5].view(np.uint32))
