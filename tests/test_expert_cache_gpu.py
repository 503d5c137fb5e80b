"""test_expert_cache.py's tests on a GPU (CUDA or ROCm): the decision as one block of the device
computes it, the per-slot experts kernels reading hits from HBM and writing fills as they stream
the host tier's pinned, device-mapped memory, and the engine's greedy tokens with the cache. Run
on a GPU host with `pytest -m gpu tests/test_expert_cache_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_expert_cache import *  # noqa: E402,F401,F403  (the same tests; fixtures below)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device, tier  # noqa: E402,F401,F811  (the GPU ones)
