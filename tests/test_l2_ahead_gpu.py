"""The L2-prefetch tests of test_l2_ahead.py on a GPU (CUDA or ROCm): there the prefetch launches
run (CUDA sm_90+; elsewhere the call passes x through), and x, the products read after them and
the decoder's logits are unchanged bit for bit. Run on a GPU host with
`pytest -m gpu tests/test_l2_ahead_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_l2_ahead import *  # noqa: E402,F401,F403  (the same tests; `device` overridden)

del test_bad_operands_are_refused  # argument checks: no kernel runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device, tier  # noqa: E402,F401,F811  (the GPU ones)
