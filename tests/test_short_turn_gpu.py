"""test_short_turn.py's engine tests on a GPU (CUDA or ROCm): a short prefill through the expert
cache against the same call streamed through layer rings, bit for bit, with its counters, and a
decode batch of identical rows whose shared experts the per-slot kernels fill once (the second
launch reading them from their slots) against the same step without the cache. Run on a GPU
host with `pytest -m gpu tests/test_short_turn_gpu.py`.

Skipped (with the reason) where JAX sees no GPU or the extension was built without GPU kernels.
"""

from __future__ import annotations

import pytest

from gpu_cases import OK as _OK, REASON as _REASON  # noqa: E402

from test_short_turn import moe_file  # noqa: E402,F401  (the fixture)
from test_short_turn import (  # noqa: E402,F401
    test_a_batch_of_identical_rows_fills_each_expert_once,
    test_short_turns_read_through_the_cache_with_the_streamed_bits)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]
