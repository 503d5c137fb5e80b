#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-server (the llama.cpp arms of `python -m
# benchmarks.offload` and `python -m benchmarks.serve`) from the source vendored in the
# llama-cpp-python sdist, pruned into .llama/llama.cpp (git-ignored;
# carried to the GPU machine with the device tool's `carry`). No network is needed.
#
#   bash tools/build_llamacpp.sh              # CUDA, sm_90, into /tmp/llama-build (H200 box)
#   LLAMA_GPU=none bash tools/build_llamacpp.sh  # CPU only (to check the script anywhere)
#   env: LLAMA_SRC (default .llama/llama.cpp), LLAMA_BUILD (default /tmp/llama-build),
#        LLAMA_JOBS (default 16), LLAMA_ARCHS (default 90), LLAMA_CMAKE_EXTRA (more -D flags)
#
# Preparing .llama/ on a machine with PyPI access (about 3 MB compressed after pruning):
#   pip download --no-binary :all: --no-deps llama-cpp-python -d /tmp/llsd
#   tar xzf /tmp/llsd/llama_cpp_python-*.tar.gz -C /tmp/llsd
#   mkdir -p .llama && cp -a /tmp/llsd/llama_cpp_python-*/vendor/llama.cpp .llama/
#   bash tools/build_llamacpp.sh --prune
# The binaries are bin/llama-bench and bin/llama-server under the build folder; the folder is
# printed last. llama-server is built without its web UI (LLAMA_USE_PREBUILT_UI=OFF: no download).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${LLAMA_SRC:-.llama/llama.cpp}
BUILD=${LLAMA_BUILD:-/tmp/llama-build}
GPU=${LLAMA_GPU:-CUDA}
[ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp source at $SRC (see this script's header)"; exit 2; }

if [ "${1:-}" = --prune ]; then  # what the two tools do not need: models, docs, tests, other
  # backends, the web UI's sources (its CMake script, kept, embeds no UI when none is built)
  ( cd "$SRC" && rm -rf models docs tests media benches gguf-py conversion examples pocs skills \
      app .github .devops ci requirements tools/mtmd/test-* tools/mtmd/tests* \
      tools/mtmd/legacy-models tools/server/tests tools/server/bench tools/server/public* \
      tools/ui/src tools/ui/static tools/ui/tests tools/ui/scripts tools/ui/*.json \
      tools/ui/*.ts tools/ui/*.js &&
    find scripts -type f ! -name 'ui-assets.cmake' ! -name 'build-info*' -delete &&
    cd ggml/src && rm -rf ggml-cann ggml-et ggml-metal ggml-virtgpu ggml-sycl ggml-vulkan \
      ggml-webgpu ggml-zdnn ggml-opencl ggml-hexagon ggml-zendnn ggml-openvino )
  # the sdist's `.git` file (a gitdir that does not exist) makes the source a nested git
  # repository, which a copy of the working tree may carry without some of its files (then
  # llama-bench does not build). It is not needed.
  rm -f "$SRC/.git"
  du -sh "$SRC"
  exit 0
fi

flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF
       -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
       -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON)
if [ "$GPU" = CUDA ]; then
  flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${LLAMA_ARCHS:-90}")
  # ggml-cuda links cuBLAS. A toolkit without it (nvcc alone) borrows the pip wheel's
  # (nvidia-cublas: nvidia/cu13/{include,lib}) from python3's packages, with an rpath to it.
  cuda_lib=$(dirname "$(readlink -f "$(which nvcc)")")/../targets/x86_64-linux/lib
  if ! ls "$cuda_lib"/libcublas.so* /usr/local/cuda/lib64/libcublas.so* >/dev/null 2>&1; then
    wheel=$(python3 -c "
import glob, os, sys
hits = [h for p in sys.path for h in glob.glob(os.path.join(p, 'nvidia', '*', 'lib', 'libcublas.so.*'))]
print(os.path.dirname(os.path.dirname(hits[0])) if hits else '')")
    [ -n "$wheel" ] || { echo "no cuBLAS in the CUDA toolkit or python3's packages"; exit 2; }
    echo "cuBLAS from $wheel"
    lib=$(ls "$wheel"/lib/libcublas.so.* | head -1); lt=$(ls "$wheel"/lib/libcublasLt.so.* | head -1)
    flags+=("-DCUDA_cublas_LIBRARY=$lib" "-DCUDA_cublasLt_LIBRARY=$lt"
            "-DCMAKE_CXX_FLAGS=-I$wheel/include" "-DCMAKE_CUDA_FLAGS=-I$wheel/include"
            "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath,$wheel/lib")
  fi
  # the driver library (ggml's VMM pool links it): the loader's, else the toolkit's stub, else
  # build without the VMM pool
  drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF; exit}')
  [ -n "$drv" ] || drv=$(ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null | head -1)
  if [ -n "$drv" ]; then
    flags+=("-DCUDA_cuda_driver_LIBRARY=$drv")
  elif ! ls "$cuda_lib"/stubs/libcuda.so >/dev/null 2>&1; then
    echo "no libcuda found: building without ggml's VMM pool"; flags+=(-DGGML_CUDA_NO_VMM=ON)
  fi
else
  # a CPU check build still targets a common x86-64 level (GGML_NATIVE is off)
  flags+=(-DGGML_CUDA=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
fi
t0=$(date +%s)
# LLAMA_CMAKE_EXTRA: more -D flags, e.g. -DGGML_CUDA_FA=OFF (about 40 fewer CUDA files)
cmake -S "$SRC" -B "$BUILD" -G Ninja "${flags[@]}" ${LLAMA_CMAKE_EXTRA:-}
cmake --build "$BUILD" --target llama-bench llama-server -j "${LLAMA_JOBS:-16}"
echo "llama-bench and llama-server built in $(( $(date +%s) - t0 )) s"
echo "$BUILD/bin"
