"""The router tests of test_moe_route.py on a GPU (CUDA or ROCm): the GPU kernel of
jaxvt_moe_route against the jnp reference on the CPU backend, and the model with
Products.fused_route on and off (GPU_PRODUCTS). Run on a GPU host with
`pytest -m gpu tests/test_moe_route_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_moe_route import *  # noqa: E402,F401,F403  (the same tests; `device` overridden below)

del test_wide_routers_and_bad_k  # lowering and argument checks: no kernel runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device  # noqa: E402,F401,F811  (the GPU one)
