#!/usr/bin/env bash
# Sourced by the tools/h200_*.sh scripts on the lent GPU machine (offline): puts the carried gguf
# wheel on PYTHONPATH and builds the CUDA extension with CMake into jaxvt/ffi/.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
t_build=$(date +%s)
# A prebuilt extension (carried: built on the development machine by tools/build_cuda_here.sh,
# or here earlier) is used when it imports and sees the GPU; otherwise CMake builds one (about 5
# minutes on that machine).
# (It must register every GPU op of this checkout's op table, jaxvt/ffi/csrc/handlers/ops.inc,
# and come with its debug module.)
# JAXVT_REBUILD=1 builds from source even so (the GPU sources changed, the registrations not).
if [ -z "${JAXVT_REBUILD:-}" ] && python3 -c "import re; from jaxvt.ffi import _jaxvt_ffi as e, _jaxvt_debug
assert e.gpu_device_count() > 0
ops = re.findall(r'(?m)^JAXVT_OP\((\w+), *\w+, *\w+, *(\w+),', open('jaxvt/ffi/csrc/handlers/ops.inc').read())
assert {t for t, gpu in ops if gpu != '0'} <= set(e.registrations().get(e.gpu_platform(), {}))" 2>/dev/null; then
  echo "prebuilt extension: $(ls jaxvt/ffi/_jaxvt_ffi*.so)"
else
  cmake -S . -B /tmp/build -G Ninja -DJAXVT_GPU=CUDA -DJAXVT_CUDA_ARCHS=90 \
    -DPython_EXECUTABLE="$(which python3)" > "$OUT/build.log" 2>&1 &&
    cmake --build /tmp/build -j 16 >> "$OUT/build.log" 2>&1 &&
    cp /tmp/build/_jaxvt_ffi*.so /tmp/build/_jaxvt_debug*.so jaxvt/ffi/ || { tail -30 "$OUT/build.log"; exit 1; }
fi
echo "build $(( $(date +%s) - t_build )) s"
