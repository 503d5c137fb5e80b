#!/usr/bin/env bash
# Compile-checks jaxvt's GPU sources as HIP (AMD) with Debian's hipcc: object files only, no GPU
# needed. Installs hipcc when missing. Usage: tools/check_hip.sh [offload-arch] (default gfx1030,
# the newest target Debian 12's HIP 5.2 knows).
set -euo pipefail
cd "$(dirname "$0")/.."
arch="${1:-gfx1030}"
if ! command -v hipcc >/dev/null 2>&1; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y hipcc
fi
export HIP_PLATFORM=amd  # without it hipcc silently compiles with nvcc
xla_inc="$(python -c 'import jax.ffi; print(jax.ffi.include_dir())')"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
src=jaxvt/ffi/csrc
for f in kernels_gpu.cu kernels_gpu_experts.cu handlers_gpu.cu memory_gpu.cu; do
  echo "hipcc --offload-arch=$arch $src/$f"
  hipcc -x hip --offload-arch="$arch" -std=c++17 -O3 -fPIC -DJAXVT_GPU_HIP=1 -DJAXVT_WITH_GPU=1 \
    -I"$src" -I"$xla_inc" -c "$src/$f" -o "$out/${f%.cu}.o"
done
echo "HIP compile check passed ($arch)"
