"""test_grouped.py's tests on a GPU (CUDA or ROCm), host-tier layers in pinned, device-mapped
memory, and the GPU kernel against the CPU backend's kernel and reference. Run on a GPU host with
`pytest -m gpu tests/test_grouped_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_grouped import *  # noqa: E402,F401,F403  (the same tests; fixtures overridden below)
from test_grouped import ALL, E, NAMES, Q4_K, Q6_K, check, grouped, grouped_ref, put, routing  # noqa: E402
from test_ffi_cases import make_stack  # noqa: E402

del test_grouped_user_errors  # CPU-only: nothing device-specific

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device, tier  # noqa: E402,F401,F811  (the GPU ones)


@pytest.fixture(scope="module")
def ulps():
  """Tensor cores accumulate each 16-element product in float32 without a specified rounding:
  allow 4x the round-to-nearest bound (still ~100x below one wrong element's effect)."""
  return 4.0


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
def test_gpu_kernel_equals_cpu_backend(fmt, rng, device, tier, ulps):
  """Every format: the GPU kernel against the CPU backend's kernel and jnp reference on the same
  operands (within the float32-sum bound), and a host-tier copy of the layer against its
  device-tier copy, bit for bit."""
  from jaxvt.ffi import grouped as gops, ops
  cpu = jax.devices("cpu")[0]
  n, rows, cols, t, k = 16, 80, 1024, 96, 4
  dev = make_stack(rng, [Q4_K, fmt], rows, cols, experts=n)
  host = make_stack(rng, [Q4_K, fmt], rows, cols, experts=n, host=(1,), tier=tier, raws=dev.raws)
  ids = routing(rng, t=t, k=k, experts=n)
  x = rng.standard_normal((t, cols)).astype(np.float32)
  want = grouped_ref(x, dev.mats[1], ids, ulps)
  g = np.asarray(grouped(put(x, device), put(dev.w, device), 1, put(ids, device)))
  check(g, want)
  h = np.asarray(grouped(put(x, device), put(host.w, device), 1, put(ids, device)))
  np.testing.assert_array_equal(h, g)
  c = np.asarray(grouped(put(x, cpu), put(dev.w, cpu), 1, put(ids, cpu)))
  r = np.asarray(jax.jit(gops.qmatmul_grouped_ref)(put(x, cpu), put(dev.w, cpu), 1, put(ids, cpu)))
  _, tol, _, _ = want
  assert np.all(np.abs(g - c) <= 2 * tol) and np.all(np.abs(g - r) <= 2 * tol)


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K])
def test_gpu_prefill_shape(fmt, rng, device, tier):
  """The 35B model's expert shapes at a 256-token prefill (top 8 of 64 experts here, so several
  32-slot tiles per expert): GPU against the CPU backend's kernel, host tier against device
  tier, gate/up (512 x 2048, x per token) and down (2048 x 512, x per slot)."""
  cpu = jax.devices("cpu")[0]
  n, t, k = 64, 256, 8
  ids = np.stack([rng.permutation(n)[:k] for _ in range(t)]).astype(np.int32)
  for rows, cols, per_slot in [(512, 2048, False), (2048, 512, True)]:
    dev = make_stack(rng, [fmt], rows, cols, experts=n)
    host = make_stack(rng, [fmt], rows, cols, experts=n, host=(0,), tier=tier, raws=dev.raws)
    x = rng.standard_normal((t, k, cols) if per_slot else (t, cols)).astype(np.float32)
    g = np.asarray(grouped(put(x, device), put(dev.w, device), 0, put(ids, device)))
    np.testing.assert_array_equal(
        np.asarray(grouped(put(x, device), put(host.w, device), 0, put(ids, device))), g)
    c = np.asarray(grouped(put(x, cpu), put(dev.w, cpu), 0, put(ids, cpu)))
    _, tol, _, _ = grouped_ref(x, dev.mats[0], ids, 5.0)
    assert np.all(np.abs(g - c) <= tol)
