"""The fused attention decode step's tests of test_attn_step.py on a GPU (CUDA or ROCm): the kernel
runs on the GPU, its jnp reference on the CPU backend; the model tests decode on the GPU with the
engine's GPU rule, attn_fused on and off, and check the compiled decode program updates the cache
stacks in place. Run on a GPU host with `pytest -m gpu tests/test_attn_step_gpu.py`; skipped
(with the reason) where JAX sees no GPU or the extension has no GPU kernels."""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_attn_step import *  # noqa: E402,F401,F403  (the same tests; the device fixture below)

del test_shape_errors, test_chunk_rule  # the wrapper's checks and rule, before any kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device  # noqa: E402,F401,F811  (the GPU one)
