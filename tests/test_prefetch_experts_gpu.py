"""test_prefetch_experts.py's tests on a GPU (CUDA or ROCm): the predicted experts' copy runs on
a stream of jaxvt's own while XLA's stream goes on, and the per-slot experts kernels wait for a
slot's copy on the device; host-tier layers in pinned, device-mapped memory. Run on a GPU host
with `pytest -m gpu tests/test_prefetch_experts_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_prefetch_experts import *  # noqa: E402,F401,F403  (the same tests; fixtures below)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device, tier  # noqa: E402,F401,F811  (the GPU ones)
