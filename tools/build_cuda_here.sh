#!/usr/bin/env bash
# Builds the CUDA extension for the lent H200's Python (3.12) on this machine, with no GPU: nvcc
# (CUDA 13), CPython 3.12's headers and a 3.12 venv holding nanobind and jax (for the XLA FFI
# headers). The result is byte-identical to the H200's own build of the same sources,
# so device time is not spent building: carry jaxvt/ffi/_jaxvt_ffi.cpython-312-x86_64-linux-gnu.so
# and jaxvt/ffi/_jaxvt_debug.cpython-312-x86_64-linux-gnu.so (the probes) to the device call.
#
#   bash tools/build_cuda_here.sh [PYTHON3.12]   # default: pyenv's 3.12, venv in /tmp/venv312
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}
[ -x "$PY" ] || { echo "build_cuda_here: no Python 3.12 found (pass its path)" >&2; exit 2; }
command -v nvcc > /dev/null || { echo "build_cuda_here: nvcc not found" >&2; exit 2; }
V=${VENV312:-/tmp/venv312}
if [ ! -x "$V/bin/python" ]; then
  "$PY" -m venv "$V"
  "$V/bin/pip" install -q nanobind "jax==0.11.*" cmake ninja
fi
export PATH="$V/bin:$PATH"
B=${BUILD_DIR:-/tmp/jaxvt-cuda-build}
cmake -S . -B "$B" -G Ninja -DJAXVT_GPU=CUDA -DJAXVT_CUDA_ARCHS=90 \
  -DPython_EXECUTABLE="$V/bin/python" > /dev/null
cmake --build "$B" -j "$(nproc)"
cp "$B"/_jaxvt_ffi.cpython-312-x86_64-linux-gnu.so "$B"/_jaxvt_debug.cpython-312-x86_64-linux-gnu.so \
  jaxvt/ffi/
echo "built jaxvt/ffi/_jaxvt_ffi.cpython-312-x86_64-linux-gnu.so and _jaxvt_debug (the probes)"
