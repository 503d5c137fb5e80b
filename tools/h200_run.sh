#!/usr/bin/env bash
# One device-tool call on the lent H200: build the CUDA extension, run the GPU tests and the
# GPU benchmarks; logs and docs/BENCHMARKS.md come back under $OUT.
#   device run (carry .whl): bash tools/h200_run.sh [tier|offload|all]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
# CMake directly (no pip/isolation on the offline machine); the .so lands in jaxvt/ffi/.
cmake -S . -B /tmp/build -G Ninja -DJAXVT_GPU=CUDA -DJAXVT_CUDA_ARCHS=90 \
  -DPython_EXECUTABLE="$(which python3)" > "$OUT/build.log" 2>&1 &&
  cmake --build /tmp/build -j 16 >> "$OUT/build.log" 2>&1 &&
  cp /tmp/build/_jaxvt_ffi*.so jaxvt/ffi/ || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
if [ "$what" = all ] || [ "$what" = tier ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ffi_gpu.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
  timeout 200 python3 -m jaxvt.bench tier --total-mib 128 2>&1 | tail -60 > "$OUT/tier.txt"
fi
if [ "$what" = all ] || [ "$what" = offload ]; then
  python3 -m jaxvt.bench offload --time-limit ${OFFLOAD_S:-240} 2>&1 | tee "$OUT/offload.txt" | tail -40
fi
cp docs/BENCHMARKS.md "$OUT/" 2>/dev/null
ls docs/*.png 2>/dev/null && cp docs/*.png "$OUT/"
echo "total $(( $(date +%s) - t0 )) s"
