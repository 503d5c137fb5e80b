#!/usr/bin/env bash
# One device call on the lent H200 for the integration's correctness: the GPU kernel tests (matvec
# / fused / experts in "f32" and "q8", the grouped and tile kernels), then the determinism test
# (tests/test_determinism_gpu.py: processes x budgets on a 35B-shaped file, 128 tokens, two
# prompts, sampled tokens and logits' hashes), then generate's rates on the 35B-shaped model.
#   device run (carry .whl and the prebuilt extension): bash tools/h200_trust.sh
set -uo pipefail
source tools/h200_build.sh
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ffi_gpu.py tests/test_grouped_gpu.py 2>&1 | tail -12 | tee "$OUT/gpu_tests.txt"
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_determinism_gpu.py 2>&1 | tail -25 | tee "$OUT/determinism.txt"
