"""The add_norm tests of test_add_norm.py on a GPU (CUDA or ROCm): the GPU kernel of
jaxvt_add_norm against float64 numpy and its jnp reference, each row's bits independent of the
other rows; the GPU kernel against the CPU kernel (the same bits without the gated term, whose
sigmoid's exp may round otherwise); and the decoder with the fused step on and off under the
GPU's arithmetic. Run on a GPU host with `pytest -m gpu tests/test_add_norm_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_add_norm import *  # noqa: E402,F401,F403  (the same tests; `device` overridden below)
from test_add_norm import _program_calls, _prompt_logits, operands, run

del test_ggml_is_the_ggml_steps_bit_for_bit  # ggml's arithmetic is the CPU's
del test_the_decoder_with_the_fused_step  # its numerics are the CPU's; the GPU's below
del test_bad_operands_are_refused  # argument checks: no kernel runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device  # noqa: E402,F401,F811  (the GPU one)


@pytest.mark.parametrize("gated,dotted", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("T,d,K", [(1, 2048, 0), (8, 2048, 0), (5, 4096, 0), (3, 100, 0),
                                   (1, 2048, 8), (8, 2048, 8), (4, 3000, 8), (2, 2048, 12),
                                   (2, 4097, 3), (2, 5000, 0)])
def test_the_gpu_kernel_is_the_cpu_kernel(device, T, d, K, gated, dotted):
  """norm.h fixes every sum's order, so the two kernels give the same bits but for the gated
  term's exp (CUDA's expf and glibc's may round an ulp apart)."""
  o = operands(T, d, seed=d - T, K=K)
  gpu = run(o, 2, gated, dotted, device=device)
  cpu = run(o, 2, gated, dotted)
  for a, b in zip(gpu, cpu):
    if gated:
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * np.abs(b).max())
    else:
      np.testing.assert_array_equal(a, b)


def test_the_decoder_with_the_fused_step_on_a_gpu(tiny):
  """The GPU row's arithmetic ("q8") with fused_norm on and off: the prompt's logits within
  float32 rounding, the fused program holding the calls."""
  eng = tiny
  ids = np.random.default_rng(1).integers(5, eng.cfg.vocab_size, 13).tolist()
  on = dataclasses.replace(eng.ex, products=dataclasses.replace(eng.ex.products, fused_norm=True))
  off = dataclasses.replace(eng.ex, products=dataclasses.replace(eng.ex.products,
                                                                 fused_norm=False))
  assert _program_calls(eng, on, 13) > 0 and _program_calls(eng, off, 13) == 0
  a, b = _prompt_logits(eng, on, ids), _prompt_logits(eng, off, ids)
  assert np.isfinite(a).all()
  np.testing.assert_allclose(a, b, atol=2e-3 * np.abs(b).max(), rtol=0)
