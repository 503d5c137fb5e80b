"""The swiglu-product tests of test_swiglu_product.py on a GPU (CUDA or ROCm): the kernels form
swiglu(g, u) as they hold their activation rows, in numerics.swiglu's expression, so the fused
call gives the bits of XLA's swiglu step followed by the plain product (both exps the device
library's); the decoder (on the GPU) with the fused down products as on the CPU. Run on a
GPU host with `pytest -m gpu tests/test_swiglu_product_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_swiglu_product import *  # noqa: E402,F401,F403  (the same tests; `device` overridden)

del test_float32_products_are_refused  # argument checks: no kernel runs
del test_mismatched_shapes_are_refused

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device  # noqa: E402,F401,F811  (the GPU one)
