"""The router tests of test_moe_route.py on a GPU (CUDA or ROCm): the GPU kernel of
jaxvt_moe_route against the jnp reference on the CPU backend, and the model with
Products.fused_route on and off (GPU_PRODUCTS). Run on a GPU host with
`pytest -m gpu tests/test_moe_route_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import jax
import pytest

from jaxvt import ffi


def _gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


GPU = _gpu()
_REASON = ("JAX sees no GPU" if GPU is None else
           f"jaxvt was built without {GPU.platform} kernels (rebuild with JAXVT_GPU=CUDA or HIP)")
_OK = GPU is not None and ffi.available(GPU.platform)

from test_moe_route import *  # noqa: E402,F401,F403  (the same tests; `device` overridden below)

del test_wide_routers_and_bad_k  # lowering and argument checks: no kernel runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]


@pytest.fixture(scope="module")
def device():
  return GPU
