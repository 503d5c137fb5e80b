"""The kernel tests of test_ffi.py on a GPU (CUDA or ROCm), with host-tier layers in pinned,
device-mapped memory. Run on a GPU host with `pytest -m gpu tests/test_ffi_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi


from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_ffi import *  # noqa: E402,F401,F403  (the same tests; fixtures overridden below)
from test_ffi import (BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0,  # noqa: E402
                      ROWS, COLS, assert_close, experts_ref, make_stack, put)
from test_ffi_cases import random_blocks  # noqa: E402
from test_numerics import (  # noqa: E402,F401
    test_exact_div_is_correctly_rounded_without_float_division)

# CPU-only checks that the import brought along.
del test_threads_and_portable_path_agree, test_user_errors, test_available_and_register_are_idempotent
del test_dequant_helper_matches_gguf, test_reference_of_a_host_layer_is_nan, test_references_match_numpy
# ggml mode's norm / RoPE / attention steps are a CPU contract (docs/NUMERICS.md), and its jnp
# formulas assume float32 products rounded before each addition, which XLA:GPU does not keep (it
# contracts them into FMAs). Those tests run in test_ffi.py; here the kernels run in "f32" and
# "q8" modes (the `mode` fixture below) and are also checked against references computed on the
# CPU backend. (The activation quantizers are not among them: they divide exactly
# (numerics.exact_div), so they must give the numpy recipe's values on a GPU too.)
del test_ggml_norm_and_swiglu_kernels
del test_ggml_rope_kernel, test_ggml_attention_kernel, test_kernels_equal_references_on_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device, tier  # noqa: E402,F401,F811  (the GPU ones)


@pytest.fixture(params=["f32", "q8"])
def mode(request):
  """"f32", and "q8": ggml's integer products (the GPU default). "ggml" mode's other steps
  (norms, RoPE, attention in ggml's rounding) are a CPU contract."""
  return request.param


def test_tier_is_pinned_and_device_mapped(tier):
  buf = tier.alloc(1 << 20)
  assert tier.backend == "gpu" and buf.device_address != 0
  buf.array[:] = 7
  assert int(buf.array.sum()) == 7 << 20


def test_layer_operand_changes_between_replays(mode, rng, device, tier):
  """The layer index is read on the device, so repeated calls of one compiled program (which XLA
  may replay as a CUDA graph, skipping the handler's host code) still follow the operand."""
  from jaxvt.ffi import ops
  fmts = [Q4_K, Q6_K, Q8_0]
  s = make_stack(rng, fmts, ROWS, COLS, host=(1,), tier=tier)
  x = rng.standard_normal((2, COLS)).astype(np.float32)
  w, xd = put(s.w, device), put(x, device)

  @jax.jit
  def f(x, l):
    outs = []
    for _ in range(6):  # several custom calls in a row: a command-buffer candidate
      outs.append(ops.qmatmul(x, w, l, mode))
    return jnp.stack(outs)

  for l in [0, 1, 2, 1, 0, 2, 2]:
    ys = np.asarray(f(xd, jnp.int32(l)))
    for y in ys:
      assert_close(y, s.ref(x, l, mode=mode))


def test_managed_and_probes():
  probes = ffi.debug_extension()
  assert probes.measure_dma_h2d(64 << 20, 3) > 1.0
  assert probes.measure_zero_copy_read(64 << 20, 3) > 1.0
  m = probes.measure_managed(64 << 20)
  assert m is None or (m[0] > 0 and m[1] > 0)


def test_kernels_on_gpu_equal_references_on_cpu(mode, rng, device):
  """Each GPU kernel computes its jnp reference's function, evaluated by the CPU backend."""
  from jaxvt.ffi import ops
  cpu = jax.devices("cpu")[0]
  fmts = [Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32]
  s = make_stack(rng, fmts, ROWS, COLS)
  x = rng.standard_normal((3, COLS)).astype(np.float32)
  kern = jax.jit(lambda x, w, l: ops.qmatmul(x, w, l, mode))
  ref = jax.jit(lambda x, w, l: ops.qmatmul_ref(x, w, l, mode))
  wg, wc = put(s.w, device), put(s.w, cpu)
  for l in range(len(fmts)):
    _, tol = s.ref(x, l, mode=mode)
    a = np.asarray(kern(put(x, device), wg, l))
    b = np.asarray(ref(put(x, cpu), wc, l))
    np.testing.assert_array_less(np.abs(a - b), tol)
  e = make_stack(rng, [Q4_1, Q4_K], 32, 512, experts=4)
  ids = np.array([[3, 0], [1, 1]], np.int32)
  xe = rng.standard_normal((2, 512)).astype(np.float32)
  for l in range(2):
    a = np.asarray(ops.qmatmul_experts(put(xe, device), put(e.w, device), l, put(ids, device),
                                       mode))
    b = np.asarray(ops.qmatmul_experts_ref(put(xe, cpu), put(e.w, cpu), l, put(ids, cpu), mode))
    np.testing.assert_array_less(np.abs(a - b), experts_ref(xe, e, l, ids, mode)[1])


@pytest.mark.parametrize("kind", ["pinned", "write_combined", "huge_pages"])
def test_every_host_kind_gives_the_device_tiers_bits(mode, rng, device, kind):
  """A host-tier copy (each allocation kind, page-aligned) and a device-tier copy (packed at odd
  offsets) of one matrix give identical bits: the kernel cuts rows into windows by address, and
  the float32 order must not depend on where the cuts fall. Rows of 1680-11760 bytes cross
  several windows and carry k-blocks over; batch 1, 4 and 16."""
  from jaxvt.ffi import ops
  from benchmarks.arms import KindTier
  with KindTier(kind, backend="gpu") as t:
    for fmt, rows, cols in [(Q6_K, 40, 4096), (Q6_K, 24, 14336), (Q4_K, 36, 14336),
                            (Q8_0, 33, 4096), (Q4_1, 70, 2048), (BF16, 20, 4096)]:
      raw = random_blocks(rng, fmt, rows, cols)
      s = make_stack(rng, [fmt, fmt], rows, cols, host=(1,), tier=t, raws=[raw, raw])
      w = put(s.w, device)
      for b in (1, 4, 16):
        x = rng.standard_normal((b, cols)).astype(np.float32)
        xd = put(x, device)
        a = np.asarray(ops.qmatmul(xd, w, 0, mode))
        h = np.asarray(ops.qmatmul(xd, w, 1, mode))
        np.testing.assert_array_equal(a, h)
        assert_close(h, s.ref(x, 1, mode=mode))
      del w


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K, Q8_0, Q4_0])
def test_two_rows_per_warp_give_the_same_bits_in_either_tier(fmt, rng, device, tier):
  """Under integer products at batch 1, rows of at most 16 units (512 columns or fewer) are
  computed two per warp (accumulate_q8_pair) where a warp's run holds several rows: the grid of
  one wave over many rows. Those rows must give the same bits from either tier, dense and per
  routed slot, and the reference's values."""
  from jaxvt.ffi import ops

  def jitted(fn, *args):
    return [np.asarray(jax.jit(lambda *a: fn(*a))(*args))]

  for rows, cols in [(8192, 512), (16384, 256)]:
    raw = random_blocks(rng, fmt, rows, cols)
    s = make_stack(rng, [fmt, fmt], rows, cols, host=(1,), tier=tier, raws=[raw, raw])
    w = put(s.w, device)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    outs = [y for l in (0, 1)
            for y in jitted(lambda x, w, l=l: ops.qmatmul(x, w, l, "q8"), put(x, device), w)]
    for y in outs[1:]:
      np.testing.assert_array_equal(y, outs[0])
    assert_close(outs[0], s.ref(x, 0, mode="q8"))
    del w
  if fmt not in (Q4_K, Q6_K):
    return
  # the routed experts' down product of the 35B shape: 8 slots, experts of 2048 x 512
  raw = random_blocks(rng, fmt, 16 * 2048, 512)  # the same experts in both layers
  e = make_stack(rng, [fmt, fmt], 2048, 512, experts=16, host=(1,), tier=tier, raws=[raw, raw])
  we = put(e.w, device)
  ids = rng.choice(16, (1, 8), replace=False).astype(np.int32)
  xe = rng.standard_normal((1, 8, 512)).astype(np.float32)
  for l in (0, 1):
    a, = jitted(lambda x, w, i, l=l: ops.qmatmul_experts(x, w, l, i, "q8"),
                    put(xe, device), we, put(ids, device))
    outs.append(a)
    assert_close(a, experts_ref(xe, e, l, ids, "q8"))
  np.testing.assert_array_equal(outs[-2], outs[-1])  # device tier (layer 0) and host tier (1)
