#!/usr/bin/env bash
# One device call on the lent H200 for the tile kernels (jaxvt.ffi.grouped): their GPU tests with
# the whole output (every failure's message, not a tail), and tools/grouped_diag.py, which says
# which slots and rows of a tile are wrong and how. Logs come back under $OUT.
#   device run (carry .whl and the prebuilt extension): bash tools/h200_grouped.sh
set -uo pipefail
source tools/h200_build.sh
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=line tests/test_grouped_gpu.py \
  > "$OUT/grouped_tests.txt" 2>&1
tail -5 "$OUT/grouped_tests.txt"
timeout 120 python3 tools/grouped_diag.py > "$OUT/grouped_diag.txt" 2>&1
grep -v ": ok (" "$OUT/grouped_diag.txt" | head -60
