"""numerics.exact_div and the activation quantizers built on it: float32 division correctly
rounded on every backend (XLA:GPU's own float32 division is PTX div.full.f32, within 2 ulp).
tests/test_ffi_gpu.py runs these on a GPU too."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt.ffi import numerics


@pytest.fixture
def rng(request):
  return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _sloppy_division(fn, *args):
  """fn(*args) evaluated with every float division one ulp high, as a backend whose division is
  not correctly rounded may give (XLA:GPU lowers float32 division to PTX div.full.f32, within 2
  ulp); integer division and everything else as usual."""
  from jax.extend import core
  def run(jaxpr, consts, *vals):
    env = {}
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = c
    for v, x in zip(jaxpr.invars, vals):
      env[v] = x
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      sub = next((p for p in eqn.params.values() if isinstance(p, core.ClosedJaxpr)), None)
      if eqn.primitive.name == "div" and jnp.issubdtype(ins[0].dtype, jnp.floating):
        outs = [jnp.nextafter(jax.lax.div(*ins), jnp.float32(np.inf))]
      elif sub is not None and eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call"):
        outs = run(sub.jaxpr, sub.consts, *ins)
      else:
        outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    return [read(v) for v in jaxpr.outvars]

  closed = jax.make_jaxpr(fn)(*args)
  return run(closed.jaxpr, closed.consts, *args)


def test_exact_div_is_correctly_rounded_without_float_division(rng):
  """numerics.exact_div equals IEEE float32 division (numpy) on random operands, ties and
  special values, and the activation quantizers built on it give the same bits when every float
  division of the backend is off by an ulp (the old quantizers did not: their scales moved)."""
  n = 200000
  a = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
  b = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
  m = rng.integers(1 << 23, 1 << 24, n)  # quotients just beside a tie: a = b * (q + 1/2 ulp)
  b2 = np.float32(3.0) ** rng.integers(0, 12, n).astype(np.float32)
  a2 = (m.astype(np.float64) * 2.0 ** -23 * b2.astype(np.float64)).astype(np.float32)
  special = np.array([np.inf, -np.inf, np.nan, 1.0, -1.0, 0.0], np.float32)
  sa, sb = [v.ravel() for v in np.meshgrid(special, special)]
  a = np.concatenate([a, a2, sa, [127, -127, 1]]).astype(np.float32)
  b = np.concatenate([b, b2, sb, [7, 3, 3]]).astype(np.float32)
  got = np.asarray(jax.jit(numerics.exact_div)(a, b))
  with np.errstate(all="ignore"):
    want = np.where(((a == 0) | (b == 0)) & np.isfinite(a) & np.isfinite(b), np.float32(0), a / b)
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  assert same.all(), (a[~same][:5], b[~same][:5], got[~same][:5], want[~same][:5])
  x = (rng.standard_normal((4, 512)) * rng.uniform(1e-3, 1e3, (4, 1))).astype(np.float32)
  for quantize in (numerics.quantize_q8, numerics.quantize_q8k):
    for g, w in zip(_sloppy_division(quantize, x), quantize(x)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
