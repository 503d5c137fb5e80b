"""The fused Gated DeltaNet step's tests of test_gdn_step.py on a GPU (CUDA or ROCm): the kernel
runs on the GPU, its jnp reference on the CPU backend; the model test decodes on the GPU with
the engine's GPU rule, gdn_fused on and off. Run on a GPU host with
`pytest -m gpu tests/test_gdn_step_gpu.py`; skipped (with the reason) where JAX sees no GPU or the
extension has no GPU kernels."""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_gdn_step import *  # noqa: E402,F401,F403  (the same tests; the device fixture below)

del test_shape_errors  # the wrapper's checks, before any kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device  # noqa: E402,F401,F811  (the GPU one)
