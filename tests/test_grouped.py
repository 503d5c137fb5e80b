"""The grouped routed-experts product (jaxvt.ffi.grouped.qmatmul_grouped, qmatmul_tiled, moe_grouped) on CPU.

Contract ("bf16" arithmetic): y[t, j] = bf16(W[layer, ids[t, j]]) @ bf16(x[t] or x[t, j]), each
weight dequantized exactly (gguf-py's floats) and rounded to bf16, as is each activation; sums in
float32. A product of two bf16 numbers (8-bit significands) is exact in float32, so the only
rounding after the two bf16 roundings is the float32 sum: a sum of n terms in any order is within
n * 2^-24 * sum|terms| of the exact sum (the standard gamma_n bound, to first order). The tests
check the kernel against
  * float64 numpy on the bf16-rounded operands, with that bound (tight: one wrong element, scale
    or nibble is far outside it), and against the unrounded float64 product with the bf16 bound
    (2^-8 + 2^-17) * sum|w x| on top (the two roundings, relative 2^-9 each);
  * the jnp reference beside the op (gops.qmatmul_grouped_ref), same bound.
Routing: ids above range are clamped, a negative id gives a zero row and reads nothing; slots
are sorted by expert on the device (gops.group_slots) and the rows land back in slot order.
test_grouped_gpu.py runs these tests on a GPU by overriding the `device` and `tier` fixtures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="jaxvt's extension is not built (pip install -e .)")

if ffi.available("cpu"):
  from jaxvt.ffi import grouped as gops, ops

from test_ffi_cases import (ALL, BF16, F16, F32, NAMES, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0,  # noqa: F401
                            _bf16, make_stack, poison_experts)
from test_ffi_cases import device, put, rng, tier  # noqa: F401  (the shared fixtures)

E, ROWS, COLS = 5, 48, 512
# A 40-token prefill, top 4 of 5 experts plus a few odd ids: runs of 0 to 40 slots per expert (so
# several 32-slot tiles of one expert), slots routed nowhere, ids above range.
T, K = 40, 4


@pytest.fixture(scope="module")
def ulps():
  """The float32-sum bound's factor: 1 (n * 2^-24 * sum|terms|); test_grouped_gpu.py widens it
  for tensor cores, whose float32 accumulation inside one mma step is not specified to round to
  nearest."""
  return 1.0


def routing(rng, t: int = T, k: int = K, experts: int = E) -> np.ndarray:
  ids = np.stack([rng.permutation(experts)[:k] for _ in range(t)]).astype(np.int32)
  ids[3, 1], ids[7, 0], ids[11, k - 1] = -1, -5, experts + 3  # nowhere, nowhere, clamped
  return ids


def grouped_ref(x: np.ndarray, mats: np.ndarray, ids: np.ndarray, ulps: float = 1.0):
  """(float64 y on bf16-rounded operands [T, k, rows], its bound, the unrounded float64 product,
  its bound) for x [T, cols] or [T, k, cols], mats float32 [E, rows, cols]."""
  n, rows, cols = mats.shape
  xs = np.broadcast_to(x[:, None] if x.ndim == 2 else x, (*ids.shape, cols))
  y, terms, exact = (np.zeros((*ids.shape, rows)) for _ in range(3))
  clamped = np.clip(ids, 0, n - 1)
  for e in range(n):
    t, j = np.nonzero((clamped == e) & (ids >= 0))
    w = mats[e].astype(np.float64)
    wb, xb = _bf16(mats[e]).astype(np.float64), _bf16(xs[t, j]).astype(np.float64)
    y[t, j] = xb @ wb.T
    terms[t, j] = np.abs(xb) @ np.abs(wb).T
    exact[t, j] = xs[t, j].astype(np.float64) @ w.T
  tol = ulps * cols * 2.0 ** -24 * terms + 1e-30
  return y, tol, exact, tol + (2.0 ** -8 + 2.0 ** -17) * terms


def check(y, ref) -> None:
  want, tol, exact, tol_exact = ref
  y = np.asarray(y, np.float64)
  assert y.shape == want.shape, (y.shape, want.shape)
  bad = ~(np.abs(y - want) <= tol)
  assert not bad.any(), (f"{bad.sum()} of {bad.size} outside the float32-sum bound (worst "
                         f"{np.nanmax(np.abs(y - want) / tol):.3g}x)")
  assert np.all(np.abs(y - exact) <= tol_exact)


grouped = jax.jit(lambda x, w, l, i: gops.qmatmul_grouped(x, w, l, i))
tiled = jax.jit(lambda x, w, l: gops.qmatmul_tiled(x, w, l))


def test_group_slots_sorts_by_expert(rng, device):
  ids = routing(rng)
  order, offsets = jax.jit(gops.group_slots, static_argnums=1)(put(ids, device), E)
  order, offsets = np.asarray(order), np.asarray(offsets)
  flat = ids.reshape(-1)
  key = np.where(flat < 0, E, np.minimum(flat, E - 1))
  np.testing.assert_array_equal(order, np.argsort(key, kind="stable"))
  np.testing.assert_array_equal(offsets, np.searchsorted(np.sort(key), np.arange(E + 1)))
  assert offsets[-1] == np.sum(flat >= 0) and sorted(order) == list(range(flat.size))


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
@pytest.mark.parametrize("per_slot", [False, True], ids=["x[T]", "x[T,k]"])
def test_grouped_formats(fmt, per_slot, rng, device, ulps):
  s = make_stack(rng, [Q4_K, fmt], ROWS, COLS, experts=E)
  ids = routing(rng)
  x = rng.standard_normal((T, K, COLS) if per_slot else (T, COLS)).astype(np.float32)
  y = np.asarray(grouped(put(x, device), put(s.w, device), 1, put(ids, device)))
  check(y, grouped_ref(x, s.mats[1], ids, ulps))
  assert not y[3, 1].any() and not y[7, 0].any()  # routed nowhere: exactly 0
  ref = np.asarray(jax.jit(gops.qmatmul_grouped_ref)(put(x, device), put(s.w, device), 1,
                                                    put(ids, device)))
  check(ref, grouped_ref(x, s.mats[1], ids, ulps))


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, Q8_0, F16, BF16, F32], ids=NAMES.get)
def test_grouped_partial_k_step(fmt, rng, device, ulps):
  """cols = 352: a k-step of 256 elements, then one of 96 (3 of the 4 units of a sub-step), and
  rows = 70: a full tile of 64 weight rows and one of 6."""
  s = make_stack(rng, [fmt], 70, 352, experts=3)
  ids = routing(rng, t=20, k=2, experts=3)
  x = rng.standard_normal((20, 352)).astype(np.float32)
  check(grouped(put(x, device), put(s.w, device), 0, put(ids, device)),
        grouped_ref(x, s.mats[0], ids, ulps))


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K, Q8_0, BF16], ids=NAMES.get)
def test_grouped_reads_only_routed_experts(fmt, rng, device, tier):
  """Experts no slot is routed to are full of NaN scales and change nothing, in either tier; a
  negative id reads nothing (expert 0 is poisoned, and its row stays 0)."""
  n = 8
  s = make_stack(rng, [fmt], 32, COLS, experts=n)
  ids = np.array([[6, 1], [1, -1], [4, 6], [1, 1]], np.int32)
  x = put(rng.standard_normal((4, COLS)).astype(np.float32), device)
  want = np.asarray(grouped(x, put(s.w, device), 0, put(ids, device)))
  assert np.isfinite(want).all() and not want[1, 1].any()
  poisoned = [poison_experts(s.raws[0], fmt, n, keep={1, 4, 6})]
  for host in [(), (0,)]:
    p = make_stack(rng, [fmt], 32, COLS, experts=n, raws=poisoned, host=host, tier=tier)
    np.testing.assert_array_equal(np.asarray(grouped(x, put(p.w, device), 0, put(ids, device))),
                                  want)
  bad = np.asarray(grouped(x, put(p.w, device), 0, put(np.array([[0, 1]] * 4, np.int32), device)))
  assert np.isnan(bad[:, 0]).all() and np.isfinite(bad[:, 1]).all()  # the poison is real


def test_grouped_host_tier_bitwise_equal_to_device_tier(rng, device, tier, ulps):
  """Mixed formats, a traced layer index in lax.scan, host-tier layers by address: the bits of the
  device-tier copies."""
  fmts = [Q4_K, Q6_K, Q8_0, Q5_K]
  base = make_stack(rng, fmts, ROWS, COLS, experts=E)
  variants = [make_stack(rng, fmts, ROWS, COLS, experts=E, host=h, tier=tier, raws=base.raws)
              for h in [(), (1, 3), tuple(range(len(fmts)))]]
  ids = put(routing(rng), device)
  x = put(rng.standard_normal((T, COLS)).astype(np.float32), device)

  @jax.jit
  def scan(w):
    body = lambda c, l: (c, gops.qmatmul_grouped(x, w, l, ids))
    return jax.lax.scan(body, None, jnp.arange(len(fmts), dtype=jnp.int32))[1]

  outs = [np.asarray(scan(put(v.w, device))) for v in variants]
  for o in outs[1:]:
    np.testing.assert_array_equal(o, outs[0])
  for l in range(len(fmts)):
    check(outs[0][l], grouped_ref(np.asarray(x), base.mats[l], np.asarray(ids), ulps))


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K, Q4_1, F16], ids=NAMES.get)
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 33), (96,)], ids=str)
def test_tiled_dense(fmt, lead, rng, device, tier, ulps):
  s = make_stack(rng, [Q8_0, fmt], ROWS, COLS, host=(1,), tier=tier)
  d = make_stack(rng, [Q8_0, fmt], ROWS, COLS, raws=s.raws)
  x = rng.standard_normal((*lead, COLS)).astype(np.float32)
  y = np.asarray(tiled(put(x, device), put(s.w, device), 1))
  ids = np.zeros((int(np.prod(lead)), 1), np.int32)
  want = grouped_ref(x.reshape(-1, COLS), s.mats[1], ids, ulps)
  check(y.reshape(-1, 1, ROWS), want)
  np.testing.assert_array_equal(np.asarray(tiled(put(x, device), put(d.w, device), 1)), y)
  ref = jax.jit(gops.qmatmul_tiled_ref)(put(x, device), put(d.w, device), 1)
  check(np.asarray(ref).reshape(-1, 1, ROWS), want)


def test_moe_grouped(rng, device):
  """gate, up (x per token), float32 SwiGLU, down (x per slot), weighted sum, against float64
  numpy on bf16-rounded operands; and the jnp reference."""
  n, t, k, d, f = 6, 24, 3, 256, 512
  wg = make_stack(rng, [Q4_K], f, d, experts=n)
  wu = make_stack(rng, [Q8_0], f, d, experts=n)
  wd = make_stack(rng, [Q6_K], d, f, experts=n)
  x = rng.standard_normal((t, d)).astype(np.float32)
  ids = np.stack([rng.permutation(n)[:k] for _ in range(t)]).astype(np.int32)
  ids[5, 2] = -1
  gate = rng.uniform(0, 1, (t, k)).astype(np.float32)
  args = put((x, wg.w, wu.w, wd.w, 0, ids, gate), device)
  out = np.asarray(jax.jit(gops.moe_grouped)(*args))
  ref = np.asarray(jax.jit(gops.moe_grouped_ref)(*args))
  want, step = np.zeros((t, d)), np.zeros((t, d))
  bf = lambda a: _bf16(a).astype(np.float64)
  for i in range(t):
    for j in range(k):
      e = ids[i, j]
      if e < 0:
        continue
      g = bf(wg.mats[0][e]) @ bf(x[i])
      u = bf(wu.mats[0][e]) @ bf(x[i])
      h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
      want[i] += gate[i, j] * (bf(wd.mats[0][e]) @ bf(h))
      step[i] += gate[i, j] * (np.abs(bf(wd.mats[0][e])) @ np.abs(h)) * 2.0 ** -8
  # The float32 h rounds to a different bf16 than float64's in a few elements (one bf16 step,
  # 2^-8 of that element): allow that on the down product's largest terms.
  scale = np.abs(want).max()
  np.testing.assert_allclose(out, want, atol=2e-3 * scale, rtol=0)
  np.testing.assert_allclose(ref, want, atol=2e-3 * scale, rtol=0)
  # The kernel and the reference sum gate/up in different orders (tensor cores on a GPU), so
  # their float32 h can straddle a bf16 rounding boundary too: at most one bf16 step of each h
  # element apart (`step`), plus float32 sums (measured on the H200: 0.012 of 24684 apart).
  assert np.all(np.abs(out - ref) <= step + 1e-5 * scale)


def test_grouped_user_errors(rng):
  from jaxvt.errors import JaxvtError
  s = make_stack(rng, [Q4_K], ROWS, COLS, experts=E)
  dense = make_stack(rng, [Q4_K], ROWS, COLS)
  with pytest.raises(JaxvtError, match="stacked-experts"):
    gops.qmatmul_grouped(np.zeros((2, COLS), np.float32), dense.w, 0, np.zeros((2, 1), np.int32))
  with pytest.raises(JaxvtError, match="must be"):
    gops.qmatmul_grouped(np.zeros((2, COLS + 32), np.float32), s.w, 0, np.zeros((2, 1), np.int32))
  with pytest.raises(JaxvtError, match="qmatmul_tiled got a stacked-experts"):
    gops.qmatmul_tiled(np.zeros((2, COLS), np.float32), s.w, 0)
