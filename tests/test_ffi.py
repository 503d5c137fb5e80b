"""jaxvt.ffi kernels against float64 numpy references (gguf-py's dequantizer), on CPU.

Every op x every format in both arithmetic contracts ("ggml": activations quantized to the
weight's ggml vec-dot type; "f32"), mixed per-layer formats, host-tier vs device-tier layers
(bitwise equal), a traced layer index inside lax.scan, expert routing (only routed experts' bytes
may matter), batch shapes and vmap; the ggml-exact model ops (rms_norm, swiglu, rope, attention)
against their jnp formulas. Tolerances: see tests/test_ffi_cases.py. test_ffi_gpu.py runs the
same tests on a GPU by overriding the `device` and `tier` fixtures.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi
from jaxvt.errors import JaxvtError

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="jaxvt's extension is not built (pip install -e .)")

if ffi.available("cpu"):
  from jaxvt.ffi import ops, steps

from test_ffi_cases import (ALL, BF16, F16, F32, NAMES, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0,
                            assert_close, dequant, experts_ref, make_stack, poison_experts,
                            quantize_x)
from test_ffi_cases import device, put, rng, tier  # noqa: F401  (the shared fixtures)

ROWS, COLS = 48, 512
K_AND_SOME = [Q4_K, Q5_K, Q6_K, Q8_0, Q4_1, BF16]


qmatmul = jax.jit(lambda x, w, l, mode="ggml": ops.qmatmul(x, w, l, mode), static_argnums=3)
qembed = jax.jit(lambda i, w, l: ops.qembed(i, w, l))
qdequant = jax.jit(lambda w, l: ops.qdequant(w, l))
experts = jax.jit(lambda x, w, l, i, mode="ggml": ops.qmatmul_experts(x, w, l, i, mode),
                  static_argnums=4)
MODES = ["ggml", "f32"]


@pytest.fixture(params=MODES)
def mode(request):
  """The arithmetic contracts (docs/NUMERICS.md); test_ffi_gpu.py keeps "f32" (ggml arithmetic
  has CPU kernels only)."""
  return request.param


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
@pytest.mark.parametrize("lead", [(), (1,), (3,), (2, 5), (17,)], ids=str)
def test_qmatmul_formats_and_batches(fmt, lead, mode, rng, device):
  s = make_stack(rng, [fmt], ROWS, COLS)
  x = rng.standard_normal((*lead, COLS)).astype(np.float32)
  y = qmatmul(put(x, device), put(s.w, device), 0, mode)
  assert_close(y, s.ref(x, 0, mode=mode))


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K, Q8_0, BF16, F32], ids=NAMES.get)
@pytest.mark.parametrize("batch", [1, 4])
def test_qmatmul_wide_rows(fmt, batch, mode, rng, device):
  """Rows larger than one GPU streaming chunk (2 KiB): the kernel walks them in pieces."""
  s = make_stack(rng, [fmt], 8, 4096)
  x = rng.standard_normal((batch, 4096)).astype(np.float32)
  assert_close(qmatmul(put(x, device), put(s.w, device), 0, mode), s.ref(x, 0, mode=mode))


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
def test_qembed_is_exact(fmt, rng, device):
  """Dequantized weights are formed exactly as ggml does, so rows match gguf-py bit for bit."""
  s = make_stack(rng, [fmt], ROWS, COLS)
  ids = np.array([[0, 5, ROWS - 1], [7, -3, ROWS + 9]], np.int32)  # out of range: clamped
  out = np.asarray(qembed(put(ids, device), put(s.w, device), 0))
  np.testing.assert_array_equal(out, s.mats[0][0][np.clip(ids, 0, ROWS - 1)])


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
@pytest.mark.parametrize("nexp", [0, 3])
def test_qdequant_bf16(fmt, nexp, rng, device):
  s = make_stack(rng, [fmt], ROWS, COLS, experts=nexp)
  out = qdequant(put(s.w, device), 0)
  want = jnp.asarray(s.mats[0] if nexp else s.mats[0][0]).astype(jnp.bfloat16)  # round to nearest even
  assert out.dtype == jnp.bfloat16 and out.shape == want.shape
  np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K, Q8_0], ids=NAMES.get)
def test_staged_linear(fmt, rng, device):
  """Products.stage_rows: with that many rows or more, layers.linear stages the layer as bf16 and
  runs a GEMM (within two bf16 roundings of the float64 product); with fewer, it is the kernel."""
  from jaxvt.ffi.tuning import Products
  from jaxvt.model.layers import Exec, linear
  s = make_stack(rng, [Q4_K, fmt], ROWS, COLS)
  ex = Exec(kernels=True, numerics="f32", products=Products(stage_rows=8))
  w = put(s.w, device)
  x = rng.standard_normal((2, 8, COLS)).astype(np.float32)
  y = np.asarray(jax.jit(lambda x, w: linear(x, w, jnp.int32(1), ex))(put(x, device), w))
  ref = x.astype(np.float64) @ s.mats[1][0].astype(np.float64).T
  bound = np.abs(x).astype(np.float64) @ np.abs(s.mats[1][0]).astype(np.float64).T * 2.0 ** -7
  assert np.all(np.abs(y - ref) <= bound) and not np.array_equal(y, np.asarray(
      qmatmul(put(x.reshape(16, COLS), device), w, 1, "f32")).reshape(y.shape))
  few = x[:, :3]  # 6 rows: the matvec kernel, bit for bit
  got = np.asarray(jax.jit(lambda x, w: linear(x, w, jnp.int32(1), ex))(put(few, device), w))
  np.testing.assert_array_equal(got, np.asarray(qmatmul(put(few, device), w, 1, "f32")))


def scan_matmul(x, w, n_layers, mode):
  """y[l] = qmatmul(x, w, l) for every layer, with l traced inside lax.scan."""
  def body(c, l):
    return c, ops.qmatmul(x, w, l, mode)
  return jax.lax.scan(body, None, jnp.arange(n_layers, dtype=jnp.int32))[1]


def test_mixed_formats_in_scan(mode, rng, device):
  fmts = [Q4_K, Q6_K, Q8_0, BF16, Q4_1, Q5_K]
  s = make_stack(rng, fmts, ROWS, COLS)
  x = rng.standard_normal((2, COLS)).astype(np.float32)
  w, xd = put(s.w, device), put(x, device)
  ys = np.asarray(jax.jit(scan_matmul, static_argnums=(2, 3))(xd, w, len(fmts), mode))
  for l in range(len(fmts)):
    assert_close(ys[l], s.ref(x, l, mode=mode))
    np.testing.assert_array_equal(ys[l], np.asarray(qmatmul(xd, w, l, mode)))
  # Out-of-range layer indices are clamped like a JAX dynamic index.
  np.testing.assert_array_equal(np.asarray(qmatmul(xd, w, 99, mode)), ys[-1])


def test_host_tier_bitwise_equal_to_device_tier(mode, rng, device, tier):
  fmts = [Q4_K, Q6_K, Q8_0, BF16]
  L, E = len(fmts), 4
  base = make_stack(rng, fmts, ROWS, COLS)
  variants = [make_stack(rng, fmts, ROWS, COLS, host=h, tier=tier, raws=base.raws)
              for h in [(), (0, 2), tuple(range(L))]]
  ex = make_stack(rng, fmts, ROWS, COLS, experts=E)
  ex_variants = [make_stack(rng, fmts, ROWS, COLS, experts=E, host=h, tier=tier, raws=ex.raws)
                 for h in [(), (1, 3), tuple(range(L))]]
  x = put(rng.standard_normal((3, COLS)).astype(np.float32), device)
  ids = put(np.array([[0, 3], [3, 1], [2, 2]], np.int32), device)
  tok = put(np.array([1, 0, ROWS - 1], np.int32), device)

  @jax.jit
  def everything(w, we):
    def body(c, l):
      return c, (ops.qmatmul(x, w, l, mode), ops.qembed(tok, w, l), ops.qdequant(w, l),
                 ops.qmatmul_experts(x, we, l, ids, mode))
    return jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32))[1]

  outs = [jax.tree.map(np.asarray, everything(put(v.w, device), put(e.w, device)))
          for v, e in zip(variants, ex_variants)]
  for o in outs[1:]:
    for a, b in zip(outs[0], o):
      np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32))
  for l in range(L):
    assert_close(outs[0][0][l], base.ref(np.asarray(x), l, mode=mode))
    assert_close(outs[0][3][l], experts_ref(np.asarray(x), ex, l, np.asarray(ids), mode))


@pytest.mark.parametrize("fmt", K_AND_SOME, ids=NAMES.get)
@pytest.mark.parametrize("per_slot", [False, True], ids=["x[T]", "x[T,k]"])
def test_experts_routing(fmt, per_slot, mode, rng, device):
  E, T, k = 6, 5, 3
  s = make_stack(rng, [Q4_K, fmt], 32, 512, experts=E)
  ids = np.array([[0, 2, 5], [2, 2, 1], [5, 0, 9], [3, -1, 3], [-7, 1, 1]], np.int32)
  x = rng.standard_normal((T, k, 512) if per_slot else (T, 512)).astype(np.float32)
  y = experts(put(x, device), put(s.w, device), 1, put(ids, device), mode)
  assert y.shape == (T, k, 32)
  assert_close(y, experts_ref(x, s, 1, ids, mode))
  assert not np.asarray(y)[3, 1].any() and not np.asarray(y)[4, 0].any()  # routed nowhere
  # The reference op follows the same contract.
  ref = ops.qmatmul_experts_ref(put(x, device), put(s.w, device), 1, put(ids, device), mode)
  assert_close(ref, experts_ref(x, s, 1, ids, mode))


@pytest.mark.parametrize("fmt", K_AND_SOME, ids=NAMES.get)
def test_experts_read_only_routed_bytes(fmt, mode, rng, device, tier):
  """Non-routed experts full of NaN scales change nothing: their bytes are never read."""
  E, rows, cols = 8, 32, 512
  s = make_stack(rng, [fmt], rows, cols, experts=E)
  ids = np.array([[6, 1], [1, 4]], np.int32)
  poisoned = [poison_experts(s.raws[0], fmt, E, keep={1, 4, 6})]
  x = put(rng.standard_normal((2, cols)).astype(np.float32), device)
  want = np.asarray(experts(x, put(s.w, device), 0, put(ids, device), mode))
  assert np.isfinite(want).all()
  for host in [(), (0,)]:
    p = make_stack(rng, [fmt], rows, cols, experts=E, raws=poisoned, host=host, tier=tier)
    got = np.asarray(experts(x, put(p.w, device), 0, put(ids, device), mode))
    np.testing.assert_array_equal(got, want)
  # The poison is real: routing to a poisoned expert gives NaN.
  bad = np.asarray(experts(x, put(p.w, device), 0, put(np.array([[0, 1], [1, 4]], np.int32), device),
                           mode))
  assert np.isnan(bad[0, 0]).all() and np.isfinite(bad[1]).all()
  # A negative id (a slot of another device's experts, in a sharded MoE) reads nothing: with
  # expert 0 poisoned, its row is exactly 0, not expert 0's NaN.
  nowhere = np.asarray(experts(x, put(p.w, device), 0, put(np.array([[6, -1], [1, 4]], np.int32),
                                                             device), mode))
  np.testing.assert_array_equal(nowhere[0, 1], 0.0)
  np.testing.assert_allclose(nowhere[1], want[1], rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_moe_experts(mode, rng, device):
  E, T, k, d, ffn = 5, 3, 2, 256, 256
  wg = make_stack(rng, [Q4_K], ffn, d, experts=E)
  wu = make_stack(rng, [Q8_0], ffn, d, experts=E)
  wd = make_stack(rng, [Q6_K], d, ffn, experts=E)
  x = rng.standard_normal((T, d)).astype(np.float32)
  ids = np.array([[0, 4], [4, 2], [1, 0]], np.int32)
  gate = rng.uniform(0, 1, (T, k)).astype(np.float32)
  fn = jax.jit(functools.partial(ops.moe_experts, mode=mode))
  out = fn(*put((x, wg.w, wu.w, wd.w, 0, ids, gate), device))
  want = np.zeros((T, d))
  xin = lambda v, f: v.astype(np.float64) if mode == "f32" else quantize_x(v, f)[0]
  for t in range(T):
    for j in range(k):
      e = ids[t, j]
      g = wg.mats[0][e].astype(np.float64) @ xin(x[t], Q4_K)
      u = wu.mats[0][e].astype(np.float64) @ xin(x[t], Q8_0)
      h = g / (1 + np.exp(-g)) * u
      want[t] += gate[t, j] * (wd.mats[0][e].astype(np.float64) @ xin(h.astype(np.float32), Q6_K))
  scale = np.abs(want).max()
  # ggml mode quantizes h, computed here in float64 and by the kernel in float32: a rounding
  # difference can move one int8 step of one Q8_K block (about 1/127 of its largest element).
  tol = 1e-4 if mode == "f32" else 2e-3
  np.testing.assert_allclose(np.asarray(out), want, atol=tol * scale, rtol=0)


def test_multi_and_pair_give_the_bits_of_separate_calls(mode, rng, device, tier):
  """qmatmul_multi (matrices of several shapes, formats and tiers sharing one input) and
  qmatmul_experts2 (a MoE's gate and up) equal their separate calls bit for bit: on a GPU they
  are one launch each, whose rows run the same arithmetic as the single-matrix kernel."""
  L = 2
  stacks = [make_stack(rng, [Q4_K, Q6_K], 96, COLS, host=(1,), tier=tier),
            make_stack(rng, [Q8_0, Q4_K], 40, COLS),
            make_stack(rng, [BF16, Q5_K], 8, COLS, host=(0,), tier=tier),
            make_stack(rng, [Q4_1, Q4_0], 200, COLS, host=(0, 1), tier=tier),
            make_stack(rng, [Q6_K, Q6_K], 16, COLS)]
  ws = [put(st.w, device) for st in stacks]
  for b in (1, 3, 9):
    x = rng.standard_normal((b, COLS)).astype(np.float32)
    xd = put(x, device)
    for l in range(L):
      fused = jax.jit(lambda x, l: ops.qmatmul_multi(x, ws, l, mode))(xd, jnp.int32(l))
      assert len(fused) == len(ws)
      for y, w, st in zip(fused, ws, stacks):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(ops.qmatmul(xd, w, l, mode)))
        assert_close(y, st.ref(x, l, mode=mode))
  E, T, k = 6, 3, 2
  g = make_stack(rng, [Q4_K, Q6_K], 32, 512, experts=E, host=(0,), tier=tier)
  u = make_stack(rng, [Q8_0, Q4_K], 32, 512, experts=E)
  ids = put(np.array([[0, 5], [5, 2], [-1, 3]], np.int32), device)
  wg, wu = put(g.w, device), put(u.w, device)
  for shape in [(T, 512), (T, k, 512)]:
    x = put(rng.standard_normal(shape).astype(np.float32), device)
    for l in range(L):
      a, c = jax.jit(lambda x, l: ops.qmatmul_experts2(x, wg, wu, l, ids, mode))(x, jnp.int32(l))
      np.testing.assert_array_equal(np.asarray(a), np.asarray(experts(x, wg, l, ids, mode)))
      np.testing.assert_array_equal(np.asarray(c), np.asarray(experts(x, wu, l, ids, mode)))


def test_vmap(mode, rng, device):
  s = make_stack(rng, [Q4_K, Q6_K], ROWS, COLS)
  x = rng.standard_normal((4, 3, COLS)).astype(np.float32)
  w = put(s.w, device)
  over_x = jax.jit(jax.vmap(lambda xi: ops.qmatmul(xi, w, 1, mode)))(put(x, device))
  assert_close(over_x, s.ref(x, 1, mode=mode))
  over_layer = jax.jit(jax.vmap(lambda l: ops.qmatmul(x[0], w, l, mode)))(
      jnp.arange(2, dtype=jnp.int32))
  for l in range(2):
    assert_close(over_layer[l], s.ref(x[0], l, mode=mode))
  ids = jnp.array([[1, 2], [3, 4]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(jax.vmap(lambda i: ops.qembed(i, w, 1))(ids)),
                                s.mats[1][0][np.asarray(ids)])


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
def test_threads_and_portable_path_agree(fmt, rng, device):
  """Row splitting across threads changes no bits; in ggml mode the portable path gives the AVX2
  path's bits (both add in ggml's order), in f32 mode it agrees within tolerance."""
  ext = ffi.extension()
  s = make_stack(rng, [fmt], 512, 1024)
  x = rng.standard_normal((5, 1024)).astype(np.float32)
  w, xd = put(s.w, device), put(x, device)
  fns = {m: jax.jit(lambda x, w, m=m: ops.qmatmul(x, w, 0, m) * 1.0) for m in MODES}
  n0 = ext.cpu_threads()
  try:
    ext.set_cpu_threads(1)
    one = {m: np.asarray(f(xd, w)) for m, f in fns.items()}
    ext.set_cpu_threads(3)
    for m, f in fns.items():
      np.testing.assert_array_equal(np.asarray(f(xd, w)), one[m])
    ext.set_cpu_isa("generic")
    np.testing.assert_array_equal(np.asarray(fns["ggml"](xd, w)), one["ggml"])
    assert_close(fns["f32"](xd, w), s.ref(x, 0, mode="f32"))
  finally:
    ext.set_cpu_isa("auto")
    ext.set_cpu_threads(n0)
  for m in MODES:
    assert_close(one[m], s.ref(x, 0, mode=m))


@pytest.mark.parametrize("fmt", [Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, F16, BF16], ids=NAMES.get)
def test_references_match_numpy(fmt, mode, rng, device):
  pytest.importorskip("jaxvt.gguf.quants")
  s = make_stack(rng, [Q8_0, fmt], ROWS, COLS)
  x = rng.standard_normal((3, COLS)).astype(np.float32)
  ref = jax.jit(ops.qmatmul_ref, static_argnums=3)
  assert_close(ref(x, s.w, 1, mode), s.ref(x, 1, mode=mode))
  ids = np.array([2, 0, 40], np.int32)
  np.testing.assert_array_equal(np.asarray(ops.qembed_ref(ids, s.w, 1)), s.mats[1][0][ids])
  np.testing.assert_array_equal(np.asarray(ops.qdequant_ref(s.w, 1)),
                                np.asarray(jnp.asarray(s.mats[1][0]).astype(jnp.bfloat16)))
  e = make_stack(rng, [fmt], 32, 512, experts=4)
  eids = np.array([[3, 0], [1, 1]], np.int32)
  xe = rng.standard_normal((2, 512)).astype(np.float32)
  assert_close(ops.qmatmul_experts_ref(xe, e.w, 0, eids, mode), experts_ref(xe, e, 0, eids, mode))
  assert_close(ops.qmatmul_experts(xe, e.w, 0, eids, mode), experts_ref(xe, e, 0, eids, mode))


def test_kernels_equal_references_on_device(mode, rng, device):
  """On the test's device (CPU here, the GPU in test_ffi_gpu.py) each kernel computes its jnp
  reference's function: the same integers, float32 rounding apart."""
  fmts = [Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32]
  s = make_stack(rng, fmts, ROWS, COLS)
  x = put(rng.standard_normal((3, COLS)).astype(np.float32), device)
  w = put(s.w, device)
  kern = jax.jit(lambda x, w, l: ops.qmatmul(x, w, l, mode))
  ref = jax.jit(lambda x, w, l: ops.qmatmul_ref(x, w, l, mode))
  for l in range(len(fmts)):
    _, tol = s.ref(np.asarray(x), l, mode=mode)
    np.testing.assert_array_less(np.abs(np.asarray(kern(x, w, l)) - np.asarray(ref(x, w, l))), tol)
  e = make_stack(rng, [Q4_1, Q4_K], 32, 512, experts=4)
  ids = put(np.array([[3, 0], [1, 1]], np.int32), device)
  xe = put(rng.standard_normal((2, 512)).astype(np.float32), device)
  for l in range(2):
    a = np.asarray(ops.qmatmul_experts(xe, put(e.w, device), l, ids, mode))
    b = np.asarray(ops.qmatmul_experts_ref(xe, put(e.w, device), l, ids, mode))
    tol = experts_ref(np.asarray(xe), e, l, np.asarray(ids), mode)[1]
    np.testing.assert_array_less(np.abs(a - b), tol)


def test_reference_of_a_host_layer_is_nan(rng, tier):
  pytest.importorskip("jaxvt.gguf.quants")
  s = make_stack(rng, [Q4_K, Q8_0], ROWS, COLS, host=(1,), tier=tier)
  x = np.ones((1, COLS), np.float32)
  assert np.isnan(np.asarray(ops.qmatmul_ref(x, s.w, 1))).all()
  assert_close(ops.qmatmul_ref(x, s.w, 0), s.ref(x, 0))


def test_dequant_helper_matches_gguf(rng):
  """The fixture's own truth: gguf-py dequantizes our random blocks to finite values."""
  for f in ALL:
    assert np.isfinite(dequant(make_stack(rng, [f], 4, 256).raws[0], f)).all()


def test_user_errors(rng):
  s = make_stack(rng, [Q4_K], ROWS, COLS)
  e = make_stack(rng, [Q4_K], 32, 256, experts=3)
  with pytest.raises(JaxvtError, match="columns"):
    ops.qmatmul(np.zeros((2, COLS + 32), np.float32), s.w, 0)
  with pytest.raises(JaxvtError, match="qmatmul_experts"):
    ops.qmatmul(np.zeros((2, 256), np.float32), e.w, 0)
  with pytest.raises(JaxvtError, match="experts"):
    ops.qmatmul_experts(np.zeros((2, COLS), np.float32), s.w, 0, np.zeros((2, 1), np.int32))
  with pytest.raises(JaxvtError, match="layer index"):
    ops.qmatmul(np.zeros((COLS,), np.float32), s.w, 0.5)
  with pytest.raises(JaxvtError, match=r"\[T, k\]"):
    ops.qmatmul_experts(np.zeros((3, 256), np.float32), e.w, 0, np.zeros((2, 1), np.int32))


def test_available_and_register_are_idempotent():
  assert ffi.available("cpu")
  assert "cpu" in ffi.register() and ffi.register() == ffi.register()
  assert ffi.available("gpu") == ("CUDA" in ffi.extension().registrations())


def test_targets_are_the_registrations_and_cover_every_call_site():
  """Python's target names come from the extension's op table: each target a wrapper in
  jaxvt/ffi/*.py calls is in the table, and registered on the CPU unless the table has it for
  GPUs only."""
  regs = ffi.extension().registrations()
  assert ffi.targets("cpu") == set(regs["cpu"])
  assert ffi.targets() == {name for names in regs.values() for name in names}
  assert ffi.targets("tpu") == frozenset()
  here = os.path.dirname(os.path.abspath(ffi.__file__))
  called = set()
  for name in os.listdir(here):
    if name.endswith(".py"):
      with open(os.path.join(here, name), encoding="utf-8") as f:
        called |= set(re.findall(r'"(jaxvt_[a-z0-9_]+)"', f.read()))
  with open(os.path.join(here, "csrc", "handlers", "ops.inc"), encoding="utf-8") as f:
    rows = dict(re.findall(r"(?m)^JAXVT_OP\((\w+), *\w+, *(\w+),", f.read()))  # target: cpu
  assert called and called <= set(rows)
  assert called - ffi.targets("cpu") == {t for t, cpu in rows.items() if cpu == "0"}


# ---------------------------------------------------------------------------------------------
# ggml arithmetic: activation quantizers, and the ggml-exact model ops against their formulas


@pytest.mark.parametrize("fmt", [Q8_0, Q4_1, Q4_K, F16, BF16], ids=NAMES.get)
def test_activation_quantizers_match_numpy(fmt, rng):
  """jnp quantizers (numerics) give the numpy recipe's values: scales, ties, zero blocks."""
  from jaxvt.ffi import numerics
  x = (rng.standard_normal((4, 512)) * rng.uniform(1e-3, 1e3, (4, 1))).astype(np.float32)
  x[0, :256] = 0                                    # an all-zero block
  x[1, :32] = np.arange(32, dtype=np.float32) - 16  # integers: many exact .5 ties after scaling
  x[2, 7] = -3 * np.abs(x[2]).max()                 # negative extreme (Q8_K picks the sign)
  want = quantize_x(x, fmt)[0]
  if fmt in (Q8_0, Q4_1):
    q, d, _ = jax.jit(numerics.quantize_q8)(x)
    got = np.asarray(q, np.float64) * np.asarray(d, np.float64)[..., None]
  elif fmt == Q4_K:
    q, d, bs = jax.jit(numerics.quantize_q8k)(x)
    got = np.asarray(q, np.float64) * np.asarray(d, np.float64)[..., None]
    sums = np.asarray(q, np.int64).reshape(4, 2, 16, 16).sum(-1)
    np.testing.assert_array_equal(np.asarray(bs), sums)
  else:
    got = np.asarray(numerics.round_to(x, jnp.float16 if fmt == F16 else jnp.bfloat16))
  np.testing.assert_array_equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_to_is_exact_and_survives_excess_precision(dtype, rng):
  """numerics.round_to equals numpy's / ml_dtypes' conversion (nearest even; float16's
  subnormals, overflow to inf, NaN) and compiles to reduce-precision, not to a pair of converts
  that XLA:GPU's excess precision removes (which made the GPU references multiply unrounded
  operands)."""
  import ml_dtypes
  from jaxvt.ffi import numerics
  x = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-10, 6, 20000)).astype(np.float32)
  ties = np.float32(1 + 2.0 ** -11) * np.arange(1, 65, dtype=np.float32)  # float16 ties
  edge = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 2.0 ** -24,
                   1.5 * 2.0 ** -24, 2.0 ** -25, 2.0 ** -26, 2.0 ** -14 * 0.999, 3e38,
                   1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8], np.float32)
  x = np.concatenate([x, ties, -ties, edge])
  with np.errstate(over="ignore"):  # overflow to inf is among the cases
    ref = x.astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16).astype(np.float32)
  f = jax.jit(lambda v: numerics.round_to(v, jnp.dtype(dtype)))
  np.testing.assert_array_equal(np.asarray(f(x)), ref)
  hlo = f.lower(x).as_text()
  assert "reduce_precision" in hlo and "bf16" not in hlo and "f16>" not in hlo, hlo


def test_ggml_norm_and_swiglu_kernels(rng):
  x = (rng.standard_normal((5, 7, 576)) * 3).astype(np.float32)
  x[0, 0] = 0
  w = rng.uniform(0.5, 2, 576).astype(np.float32)
  k = np.asarray(jax.jit(lambda x, w: steps.rms_norm(x, w, 1e-5))(x, w))
  r = np.asarray(jax.jit(lambda x, w: steps.rms_norm(x, w, 1e-5, kernels=False))(x, w))
  np.testing.assert_allclose(k, r, rtol=2e-6, atol=1e-30)
  x64 = x.astype(np.float64)
  np.testing.assert_allclose(k, x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w,
                             rtol=2e-6, atol=1e-30)
  g = (rng.standard_normal((3, 1541)) * 8).astype(np.float32)  # a tail past the 8-lane blocks
  g[0, :4] = [-200.0, 200.0, 0.0, -90.0]                       # exp under/overflow paths
  u = rng.standard_normal((3, 1541)).astype(np.float32)
  k = np.asarray(jax.jit(steps.swiglu)(g, u))
  g64 = g.astype(np.float64)
  # atol: at g = -90 float32's exp(90) overflows, so silu is 0 where float64 gives 1e-37 * |u|
  np.testing.assert_allclose(k, g64 / (1 + np.exp(-g64)) * u, rtol=1e-6, atol=1e-35)
  np.testing.assert_allclose(k, np.asarray(steps.swiglu(g, u, kernels=False)), rtol=1e-6, atol=1e-37)


@pytest.mark.parametrize("neox,n_dims", [(False, 64), (True, 64), (True, 32)])
def test_ggml_rope_kernel(neox, n_dims, rng):
  from jaxvt.ffi import numerics
  x = rng.standard_normal((2, 9, 5, 64)).astype(np.float32)
  pos = np.array([[0, 1, 2, 3, 4, 100, 1000, 4095, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]],
                 np.int32)[:, :9]
  f = lambda x, p, kern: steps.rope(x, p, n_dims, 10000.0, neox, kernels=kern)
  k = np.asarray(jax.jit(functools.partial(f, kern=True))(x, pos))
  r = np.asarray(jax.jit(functools.partial(f, kern=False))(x, pos))
  np.testing.assert_allclose(k, r, rtol=0, atol=2e-5)
  np.testing.assert_array_equal(k[..., n_dims:], x[..., n_dims:])
  np.testing.assert_array_equal(k[0, 0], x[0, 0])  # position 0: cos 1, sin 0
  # float64 truth from the same float32 angles (ggml's repeated multiplication from
  # powf(10000, -2/n_dims), here the float64 power rounded once to float32)
  ts = np.float32(10000.0 ** (-2.0 / n_dims))
  assert ts == numerics.theta_scale(10000.0, n_dims)
  th = np.zeros((2, 9, n_dims // 2), np.float32)
  th[..., 0] = pos
  for i in range(1, n_dims // 2):
    th[..., i] = th[..., i - 1] * ts
  c, sn = np.cos(th.astype(np.float64))[:, :, None], np.sin(th.astype(np.float64))[:, :, None]
  xr = x[..., :n_dims].astype(np.float64)
  if neox:
    x0, x1 = xr[..., :n_dims // 2], xr[..., n_dims // 2:]
    want = np.concatenate([x0 * c - x1 * sn, x0 * sn + x1 * c], -1)
  else:
    x0, x1 = xr[..., 0::2], xr[..., 1::2]
    want = np.stack([x0 * c - x1 * sn, x0 * sn + x1 * c], -1).reshape(xr.shape)
  np.testing.assert_allclose(k[..., :n_dims], want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("base", [10000.0, 500000.0, 1000000.0, 10000000.0])
@pytest.mark.parametrize("n_dims", [16, 32, 64, 80, 96, 128, 256])
def test_theta_scale_is_powf(base, n_dims):
  """ggml's theta_scale is powf(base, -2.0f / n_dims): equal to the C library's powf (the
  kernels call it) and to the float64 power rounded to float32, on any CPU."""
  from jaxvt.ffi import numerics
  e = np.float32(-2.0) / np.float32(n_dims)
  want = np.float32(float(base) ** float(e))
  assert numerics.theta_scale(base, n_dims) == want
  libm = ctypes.util.find_library("m")
  if libm:
    powf = ctypes.CDLL(libm).powf
    powf.restype, powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    assert np.float32(powf(base, float(e))) == want


def _attention_f64(q, kc, vc, layer, pos, scale):
  """float64 softmax attention with q and the probabilities rounded to the cache dtype."""
  b, t, H, D = q.shape
  K = kc.shape[3]
  ks, vs = kc[layer].astype(np.float64), vc[layer].astype(np.float64)
  cd = kc.dtype
  qq = q.astype(cd).astype(np.float64)
  out = np.zeros((b, t, H, vc.shape[-1]))
  for bi in range(b):
    for ti in range(t):
      p = pos[bi, ti]
      for h in range(H):
        sc = ks[bi, :p + 1, h // (H // K)] @ qq[bi, ti, h] * scale
        e = np.exp(sc - sc.max())
        pr = (e / e.sum()).astype(np.float32).astype(cd).astype(np.float64)
        out[bi, ti, h] = pr @ vs[bi, :p + 1, h // (H // K)]
  return out


@pytest.mark.parametrize("cache", ["float16", "float32"])
@pytest.mark.parametrize("t", [1, 5])
def test_ggml_attention_kernel(cache, t, rng):
  """Kernel (ggml's orders and roundings) vs the jnp formula vs float64: GQA, a stacked cache
  read at a traced layer, padded rows (positions past the real ones; zeros), 1 or several
  queries."""
  A, b, S, H, K, D, Dv = 3, 2, 256, 6, 2, 64, 32
  cd = np.dtype(cache)
  kc = (rng.standard_normal((A, b, S, K, D)) * 2).astype(cd)
  vc = rng.standard_normal((A, b, S, K, Dv)).astype(cd)
  q = rng.standard_normal((b, t, H, D)).astype(np.float32)
  pos = np.stack([np.arange(40, 40 + t), np.arange(7, 7 + t)]).astype(np.int32)
  nq = np.array([t, max(t - 2, 1)], np.int32)  # row 1: its last queries are padding
  args = (q, kc, vc, np.int32(1), pos, nq)
  f = lambda *a, kern: steps.attention(*a, 256, 0.125, kernels=kern)
  k = np.asarray(jax.jit(functools.partial(f, kern=True))(*args))
  r = np.asarray(jax.jit(functools.partial(f, kern=False))(*args))
  want = _attention_f64(q, kc, vc, 1, pos, 0.125)
  want[np.arange(t)[None, :] >= nq[:, None]] = 0.0  # padding queries: zeros, not computed
  # With an f16 cache a probability may round to the other f16 neighbour (2^-11 relative).
  tol = 2e-3 if cache == "float16" else 2e-6
  np.testing.assert_allclose(k, r, rtol=0, atol=tol)
  np.testing.assert_allclose(k, want, rtol=0, atol=tol)
