#!/usr/bin/env bash
# One device-tool call on the lent H200: build the CUDA extension, run the GPU tests and the
# GPU benchmarks; logs and docs/BENCHMARKS.md come back under $OUT.
#   device run (carry .whl, and .llama for llama.cpp): bash tools/h200_run.sh [tier|llamacpp|offload|all]
#   mesh (kind nvidia-h200-x2, not part of all): bash tools/h200_run.sh mesh
set -uo pipefail
what=${1:-all}
source tools/h200_build.sh
t0=$(date +%s)
if [ "$what" = all ] || [ "$what" = tier ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ffi_gpu.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
  timeout 200 python3 -m jaxvt.bench tier --total-mib 128 2>&1 | tail -60 > "$OUT/tier.txt"
fi
# llama.cpp's llama-bench, the offload sweep's fourth arm, from the carried .llama/ source
# (carry: .llama; tools/build_llamacpp.sh). `llamacpp` builds it in the foreground (a call of
# its own before `offload`, on the same warm machine); `offload` without it builds it in the
# background at nice 19 on 12 cores, and the sweep runs llama-bench last, once it is built.
LLAMA_BIN=/tmp/llama-build/bin/llama-bench
if [ "$what" = llamacpp ]; then
  bash tools/build_llamacpp.sh > "$OUT/llama_build.log" 2>&1; tail -3 "$OUT/llama_build.log"
fi
if [ "$what" = offload ] && [ ! -x $LLAMA_BIN ] && [ ! -e /tmp/llama-build/.building ] && [ -d .llama/llama.cpp ]; then
  mkdir -p /tmp/llama-build && touch /tmp/llama-build/.building
  ( LLAMA_JOBS=12 nice -n 19 bash tools/build_llamacpp.sh > "$OUT/llama_build.log" 2>&1
    rm -f /tmp/llama-build/.building ) &
  echo "building llama-bench in the background (log: llama_build.log)"
fi
if [ "$what" = all ] || [ "$what" = offload ]; then
  python3 -m jaxvt.bench offload --time-limit ${OFFLOAD_S:-540} 2>&1 | tee "$OUT/offload.txt" | tail -60
fi
# issue #7: one device vs tp=2 over both GPUs of a 2-GPU host, with and without offload
if [ "$what" = mesh ]; then
  python3 -m jaxvt.bench mesh --time-limit ${MESH_S:-480} 2>&1 | tee "$OUT/mesh.txt" | tail -40
fi
cp docs/BENCHMARKS.md "$OUT/" 2>/dev/null
ls docs/*.png 2>/dev/null && cp docs/*.png "$OUT/"
echo "total $(( $(date +%s) - t0 )) s"
