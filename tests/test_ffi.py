"""jaxvt.ffi kernels against float64 numpy references (gguf-py's dequantizer), on CPU.

Every op x every format, mixed per-layer formats, host-tier vs device-tier layers (bitwise
equal), a traced layer index inside lax.scan, expert routing (only routed experts' bytes may
matter), batch shapes and vmap. Tolerances: see tests/test_ffi_cases.py. test_ffi_gpu.py runs the
same tests on a GPU by overriding the `device` and `tier` fixtures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi
from jaxvt.errors import JaxvtError

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="jaxvt's extension is not built (pip install -e .)")

if ffi.available("cpu"):
  from jaxvt.ffi import ops
  from jaxvt.offload.host_tier import HostTier

from test_ffi_cases import (ALL, BF16, F32, NAMES, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, assert_close,
                            dequant, experts_ref, make_stack, matmul_ref, poison_experts)

ROWS, COLS = 48, 512
K_AND_SOME = [Q4_K, Q5_K, Q6_K, Q8_0, Q4_1, BF16]


@pytest.fixture(scope="module")
def device():
  return jax.devices("cpu")[0]


@pytest.fixture(scope="module")
def tier(device):
  with HostTier(backend="cpu") as t:
    yield t


@pytest.fixture
def rng(request):
  return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def put(tree, device):
  return jax.device_put(tree, device)


qmatmul = jax.jit(lambda x, w, l: ops.qmatmul(x, w, l))
qembed = jax.jit(lambda i, w, l: ops.qembed(i, w, l))
qdequant = jax.jit(lambda w, l: ops.qdequant(w, l))
experts = jax.jit(lambda x, w, l, i: ops.qmatmul_experts(x, w, l, i))


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
@pytest.mark.parametrize("lead", [(), (1,), (3,), (2, 5), (17,)], ids=str)
def test_qmatmul_formats_and_batches(fmt, lead, rng, device):
  s = make_stack(rng, [fmt], ROWS, COLS)
  x = rng.standard_normal((*lead, COLS)).astype(np.float32)
  y = qmatmul(put(x, device), put(s.w, device), 0)
  assert_close(y, matmul_ref(x, s.mats[0][0]))


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K, Q8_0, BF16, F32], ids=NAMES.get)
@pytest.mark.parametrize("batch", [1, 4])
def test_qmatmul_wide_rows(fmt, batch, rng, device):
  """Rows larger than one GPU streaming chunk (2 KiB): the kernel walks them in pieces."""
  s = make_stack(rng, [fmt], 8, 4096)
  x = rng.standard_normal((batch, 4096)).astype(np.float32)
  assert_close(qmatmul(put(x, device), put(s.w, device), 0), matmul_ref(x, s.mats[0][0]))


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


def scan_matmul(x, w, n_layers):
  """y[l] = qmatmul(x, w, l) for every layer, with l traced inside lax.scan."""
  def body(c, l):
    return c, ops.qmatmul(x, w, l)
  return jax.lax.scan(body, None, jnp.arange(n_layers, dtype=jnp.int32))[1]


def test_mixed_formats_in_scan(rng, device):
  fmts = [Q4_K, Q6_K, Q8_0, BF16, Q4_1, Q5_K]
  s = make_stack(rng, fmts, ROWS, COLS)
  x = rng.standard_normal((2, COLS)).astype(np.float32)
  w, xd = put(s.w, device), put(x, device)
  ys = np.asarray(jax.jit(scan_matmul, static_argnums=2)(xd, w, len(fmts)))
  for l in range(len(fmts)):
    assert_close(ys[l], matmul_ref(x, s.mats[l][0]))
    np.testing.assert_array_equal(ys[l], np.asarray(qmatmul(xd, w, l)))
  # Out-of-range layer indices are clamped like a JAX dynamic index.
  np.testing.assert_array_equal(np.asarray(qmatmul(xd, w, 99)), ys[-1])


def test_host_tier_bitwise_equal_to_device_tier(rng, device, tier):
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
      return c, (ops.qmatmul(x, w, l), ops.qembed(tok, w, l), ops.qdequant(w, l),
                 ops.qmatmul_experts(x, we, l, ids))
    return jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32))[1]

  outs = [jax.tree.map(np.asarray, everything(put(v.w, device), put(e.w, device)))
          for v, e in zip(variants, ex_variants)]
  for o in outs[1:]:
    for a, b in zip(outs[0], o):
      np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32))
  for l in range(L):
    assert_close(outs[0][0][l], matmul_ref(np.asarray(x), base.mats[l][0]))
    assert_close(outs[0][3][l], experts_ref(np.asarray(x), ex.mats[l], np.asarray(ids)))


@pytest.mark.parametrize("fmt", K_AND_SOME, ids=NAMES.get)
@pytest.mark.parametrize("per_slot", [False, True], ids=["x[T]", "x[T,k]"])
def test_experts_routing(fmt, per_slot, rng, device):
  E, T, k = 6, 5, 3
  s = make_stack(rng, [Q4_K, fmt], 32, 512, experts=E)
  ids = np.array([[0, 2, 5], [2, 2, 1], [5, 0, 9], [3, -1, 3], [1, 1, 1]], np.int32)
  x = rng.standard_normal((T, k, 512) if per_slot else (T, 512)).astype(np.float32)
  y = experts(put(x, device), put(s.w, device), 1, put(ids, device))
  assert y.shape == (T, k, 32)
  assert_close(y, experts_ref(x, s.mats[1], ids))


@pytest.mark.parametrize("fmt", K_AND_SOME, ids=NAMES.get)
def test_experts_read_only_routed_bytes(fmt, rng, device, tier):
  """Non-routed experts full of NaN scales change nothing: their bytes are never read."""
  E, rows, cols = 8, 32, 512
  s = make_stack(rng, [fmt], rows, cols, experts=E)
  ids = np.array([[6, 1], [1, 4]], np.int32)
  poisoned = [poison_experts(s.raws[0], fmt, E, keep={1, 4, 6})]
  x = put(rng.standard_normal((2, cols)).astype(np.float32), device)
  want = np.asarray(experts(x, put(s.w, device), 0, put(ids, device)))
  assert np.isfinite(want).all()
  for host in [(), (0,)]:
    p = make_stack(rng, [fmt], rows, cols, experts=E, raws=poisoned, host=host, tier=tier)
    got = np.asarray(experts(x, put(p.w, device), 0, put(ids, device)))
    np.testing.assert_array_equal(got, want)
  # The poison is real: routing to a poisoned expert gives NaN.
  bad = np.asarray(experts(x, put(p.w, device), 0, put(np.array([[0, 1], [1, 4]], np.int32), device)))
  assert np.isnan(bad[0, 0]).all() and np.isfinite(bad[1]).all()


def test_moe_experts(rng, device):
  E, T, k, d, ffn = 5, 3, 2, 256, 256
  wg = make_stack(rng, [Q4_K], ffn, d, experts=E)
  wu = make_stack(rng, [Q8_0], ffn, d, experts=E)
  wd = make_stack(rng, [Q6_K], d, ffn, experts=E)
  x = rng.standard_normal((T, d)).astype(np.float32)
  ids = np.array([[0, 4], [4, 2], [1, 0]], np.int32)
  gate = rng.uniform(0, 1, (T, k)).astype(np.float32)
  out = jax.jit(ops.moe_experts)(*put((x, wg.w, wu.w, wd.w, 0, ids, gate), device))
  want = np.zeros((T, d))
  for t in range(T):
    for j in range(k):
      e = ids[t, j]
      g = wg.mats[0][e].astype(np.float64) @ x[t]
      u = wu.mats[0][e].astype(np.float64) @ x[t]
      h = g / (1 + np.exp(-g)) * u
      want[t] += gate[t, j] * (wd.mats[0][e].astype(np.float64) @ h)
  scale = np.abs(want).max()
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-4 * scale, rtol=0)


def test_vmap(rng, device):
  s = make_stack(rng, [Q4_K, Q6_K], ROWS, COLS)
  x = rng.standard_normal((4, 3, COLS)).astype(np.float32)
  w = put(s.w, device)
  over_x = jax.jit(jax.vmap(lambda xi: ops.qmatmul(xi, w, 1)))(put(x, device))
  assert_close(over_x, matmul_ref(x, s.mats[1][0]))
  over_layer = jax.jit(jax.vmap(lambda l: ops.qmatmul(x[0], w, l)))(jnp.arange(2, dtype=jnp.int32))
  for l in range(2):
    assert_close(over_layer[l], matmul_ref(x[0], s.mats[l][0]))
  ids = jnp.array([[1, 2], [3, 4]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(jax.vmap(lambda i: ops.qembed(i, w, 1))(ids)),
                                s.mats[1][0][np.asarray(ids)])


def test_threads_and_portable_path_agree(rng, device):
  """Row splitting across threads changes no bits; the portable path agrees within tolerance."""
  ext = ffi.extension()
  s = make_stack(rng, [Q4_K], 512, 1024)
  x = rng.standard_normal((2, 1024)).astype(np.float32)
  w, xd = put(s.w, device), put(x, device)
  fn = jax.jit(lambda x, w: ops.qmatmul(x, w, 0) * 1.0)
  n0 = ext.cpu_threads()
  try:
    ext.set_cpu_threads(1)
    one = np.asarray(fn(xd, w))
    ext.set_cpu_threads(3)
    np.testing.assert_array_equal(np.asarray(fn(xd, w)), one)
    ext.set_cpu_isa("generic")
    assert_close(fn(xd, w), matmul_ref(x, s.mats[0][0]))
  finally:
    ext.set_cpu_isa("auto")
    ext.set_cpu_threads(n0)
  assert_close(one, matmul_ref(x, s.mats[0][0]))


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K, Q4_1, BF16], ids=NAMES.get)
def test_references_match_numpy(fmt, rng, device):
  pytest.importorskip("jaxvt.gguf.quants")
  s = make_stack(rng, [Q8_0, fmt], ROWS, COLS)
  x = rng.standard_normal((3, COLS)).astype(np.float32)
  assert_close(jax.jit(ops.qmatmul_ref)(x, s.w, 1), matmul_ref(x, s.mats[1][0]))
  ids = np.array([2, 0, 40], np.int32)
  np.testing.assert_array_equal(np.asarray(ops.qembed_ref(ids, s.w, 1)), s.mats[1][0][ids])
  np.testing.assert_array_equal(np.asarray(ops.qdequant_ref(s.w, 1)),
                                np.asarray(jnp.asarray(s.mats[1][0]).astype(jnp.bfloat16)))
  e = make_stack(rng, [fmt], 32, 512, experts=4)
  eids = np.array([[3, 0], [1, 1]], np.int32)
  xe = rng.standard_normal((2, 512)).astype(np.float32)
  assert_close(ops.qmatmul_experts_ref(xe, e.w, 0, eids), experts_ref(xe, e.mats[0], eids))
  assert_close(ops.qmatmul_experts(xe, e.w, 0, eids), experts_ref(xe, e.mats[0], eids))


def test_reference_of_a_host_layer_is_nan(rng, tier):
  pytest.importorskip("jaxvt.gguf.quants")
  s = make_stack(rng, [Q4_K, Q8_0], ROWS, COLS, host=(1,), tier=tier)
  x = np.ones((1, COLS), np.float32)
  assert np.isnan(np.asarray(ops.qmatmul_ref(x, s.w, 1))).all()
  assert_close(ops.qmatmul_ref(x, s.w, 0), matmul_ref(x, s.mats[0][0]))


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
