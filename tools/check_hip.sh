#!/usr/bin/env bash
# Compile-checks jaxvt's GPU sources as HIP (AMD): object files with linked device code, no GPU
# needed. Usage: tools/check_hip.sh [offload-arch ...] (default: gfx1030 gfx1200 gfx1201).
#
# Everything comes from Debian 12's archive (apt-get installs what is missing):
#   gfx10xx and older  Debian's hipcc (HIP 5.2, clang 15), as a Debian ROCm user builds.
#   gfx12xx (RDNA4)    HIP 5.2's clang 15 does not know gfx12, so clang++-19 (package clang-19,
#                      with lld-19 for the device link, clang-tools-19 for its offload bundler
#                      and llvm-19) compiles the same sources
#                      against Debian's HIP 5.2 headers and device libraries. Those libraries
#                      predate gfx12 by one file only: oclc_isa_version_12xx.bc, which holds one
#                      constant (__oclc_ISA_version, 12000 for gfx1200). It is generated here
#                      from Debian's gfx1030 file with llvm-dis/llvm-as, beside symlinks to the
#                      others, in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
archs=("$@")
[ "${#archs[@]}" != 0 ] || archs=(gfx1030 gfx1200 gfx1201)

apt_install() {  # apt_install PACKAGE...: installs what is missing from Debian's archive
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ "${#missing[@]}" = 0 ] && return 0
  echo "check_hip: apt-get install ${missing[*]}"
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

export HIP_PLATFORM=amd  # without it hipcc silently compiles with nvcc
xla_inc="$(python -c 'import jax.ffi; print(jax.ffi.include_dir())')"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
src=jaxvt/ffi/csrc
files=($(cd "$src" && find . -name '*.cu' | sed 's|^\./||' | sort))  # every GPU source CMake compiles
flags=(-x hip -std=c++17 -O3 -fPIC -DJAXVT_GPU_HIP=1 -DJAXVT_WITH_GPU=1 -I"$src" -I"$xla_inc")
bitcode=/usr/lib/x86_64-linux-gnu/amdgcn/bitcode  # Debian's rocm-device-libs

device_libs() {  # device_libs ARCH: a device-library directory that knows gfx12xx ARCH
  local dir="$out/device-libs" num="${1#gfx}"
  if [ ! -d "$dir" ]; then
    mkdir "$dir"
    ln -s "$bitcode"/*.bc "$dir"/
  fi
  if [ ! -e "$dir/oclc_isa_version_$num.bc" ]; then
    # major * 1000 + minor * 100 + stepping: gfx1030 10300, gfx1200 12000, gfx1201 12001
    local version=$(( ${num:0:-2} * 1000 + ${num: -2:1} * 100 + 16#${num: -1} ))
    llvm-dis-19 "$bitcode/oclc_isa_version_1030.bc" -o - \
      | sed "s/constant i32 10300,/constant i32 $version,/" \
      | llvm-as-19 -o "$dir/oclc_isa_version_$num.bc"
  fi
  echo "$dir"
}

for arch in "${archs[@]}"; do
  case "$arch" in
    gfx12*)
      # clang-tools-19: clang-offload-bundler, which clang++-19 runs to bundle the device code
      apt_install clang-19 clang-tools-19 lld-19 llvm-19 libamdhip64-dev rocm-device-libs
      cxx=(clang++-19 --offload-arch="$arch" --rocm-device-lib-path="$(device_libs "$arch")")
      ;;
    *)
      command -v hipcc >/dev/null 2>&1 || apt_install hipcc
      cxx=(hipcc --offload-arch="$arch")
      ;;
  esac
  # The arch's sources compile side by side (a CI machine's cores; each needs well under 2 GiB);
  # a failure prints that compiler's output.
  pids=()
  for f in "${files[@]}"; do
    echo "${cxx[0]} --offload-arch=$arch $src/$f"
    o="$out/$(echo "${f%.cu}" | tr / _)-$arch"
    "${cxx[@]}" "${flags[@]}" -c "$src/$f" -o "$o.o" > "$o.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  for i in "${!files[@]}"; do
    if ! wait "${pids[$i]}"; then
      echo "check_hip: ${files[$i]} failed for $arch:"
      cat "$out/$(echo "${files[$i]%.cu}" | tr / _)-$arch.log"
      failed=1
    fi
  done
  [ "$failed" = 0 ] || exit 1
  echo "HIP compile check passed ($arch)"
done
