"""The GPU grouped kernel's tile logic, run on the CPU: kernels_gpu_grouped.cu compiled by the host
C++ compiler against a small emulation of the CUDA subset it uses (a thread per CUDA thread, one
block at a time, std::barrier for __syncthreads), so CI checks the device code's tile lookup,
staging of GGUF bytes at unaligned addresses, partial k-steps, partial row and slot tiles, zero
rows for slots routed nowhere and the scatter back to slot order, without a GPU.

Both tile products are run: the float32 FMA one (the HIP build's, and a host compile's), and the
wmma one with nvcuda::wmma emulated as CUDA documents it (load_matrix_sync's row- and column-major
layouts and leading dimensions, mma_sync D = A B + C, store_matrix_sync), which checks how the
kernel lays its tiles out for the tensor cores; the tensor cores themselves are checked on a GPU
by test_grouped_gpu.py. Compared with float64 numpy on the bf16-rounded operands (the bound of
test_grouped.py) for every format. Skipped where the sources or a C++20 compiler are missing.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi

CSRC = os.path.join(os.path.dirname(os.path.abspath(ffi.__file__)), "csrc")
KERNEL = os.path.join(CSRC, "kernels", "gpu", "kernels_gpu_grouped.cu")
CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(
    not (ffi.available("cpu") and CXX and os.path.exists(KERNEL)),
    reason="needs jaxvt's extension, its C++ sources and a C++20 compiler")

from test_ffi_cases import ALL, BF16, NAMES, Q4_0, Q4_K, Q6_K, Q8_0, make_stack  # noqa: E402
from test_grouped import grouped_ref, routing  # noqa: E402

# What the kernel's source needs of the CUDA runtime and of vendor.h, for a host compile (vendor.h
# itself is skipped by defining its include guard).
FAKE_VENDOR = """#pragma once
#include <cstdint>
#define JAXVT_FFI_CSRC_VENDOR_H_
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
typedef void* gpuStream_t;
typedef int gpuError_t;
constexpr gpuError_t gpuSuccess = 0, gpuErrorInvalidValue = 1;
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
"""

# nvcuda::wmma as the CUDA programming guide specifies it, every lane holding the whole tile.
FAKE_BF16 = """#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 { uint16_t bits; };
inline float emu_bf16(__nv_bfloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
"""

FAKE_MMA = """#pragma once
#include "cuda_bf16.h"
namespace nvcuda::wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment { float v[16][16]; };
template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const __nv_bfloat16* p, unsigned ld) {
  const bool rows = std::is_same_v<Layout, row_major>;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) f.v[i][j] = emu_bf16(rows ? p[i * ld + j] : p[i + j * ld]);
}
template <class F>
void fill_fragment(F& f, float x) {
  for (auto& r : f.v)
    for (float& e : r) e = x;
}
template <class A, class B, class C>
void mma_sync(C& d, const A& a, const B& b, const C& c) {
  C out;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = c.v[i][j];
      for (int k = 0; k < 16; ++k) s += a.v[i][k] * b.v[k][j];
      out.v[i][j] = s;
    }
  d = out;
}
template <class C>
void store_matrix_sync(float* p, const C& f, unsigned ld, layout_t layout) {
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) p[layout == mem_row_major ? i * ld + j : i + j * ld] = f.v[i][j];
}
}  // namespace nvcuda::wmma
"""

SHIM = """#pragma once
#include <type_traits>
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include "fake_vendor.h"
#define __shared__ static
#define __launch_bounds__(...)
struct EmuDim { unsigned x = 1, y = 1, z = 1; };
inline thread_local EmuDim threadIdx, blockIdx;
inline EmuDim gridDim, blockDim;
inline std::barrier<>* g_bar = nullptr;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
template <class F>
void emulate_launch(dim3 grid, int threads, F body) {
  gridDim = {grid.x, grid.y, grid.z};
  blockDim = {static_cast<unsigned>(threads), 1, 1};
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> bar(threads);
      g_bar = &bar;
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          threadIdx = {static_cast<unsigned>(t), 0, 0};
          blockIdx = {bx, by, 0};
          body();
          bar.arrive_and_drop();
        });
      for (auto& th : ts) th.join();
    }
}
"""

ENTRY = """
extern "C" int run_grouped(const uint8_t* data, int64_t stride, const uint32_t* table,
                           const int32_t* fmts, int64_t n_layers, int32_t layer, const uint16_t* x,
                           int64_t x_div, const int32_t* order, const int32_t* offsets,
                           int64_t slots, float* y, int64_t rows, int64_t cols, int64_t experts) {
  jaxvt::gpu::WeightArgs w{data, stride, table, fmts, n_layers, &layer};
  return static_cast<int>(jaxvt::gpu::launch_qmatmul_grouped(nullptr, w, x, x_div, order, offsets,
                                                             slots, y, rows, cols, experts));
}
"""


@pytest.fixture(scope="module", params=["fma", "wmma"])
def kernel(request, tmp_path_factory):
  d = tmp_path_factory.mktemp("emulated")
  src = open(KERNEL).read()
  launch = re.search(r"qmatmul_grouped_kernel<<<grid, kThr, 0, s>>>\((.*?)\);", src, re.S)
  assert launch, "the kernel's launch statement changed: update this test's emulation"
  src = src.replace(launch.group(0), "emulate_launch(grid, kThr, [&] { qmatmul_grouped_kernel(%s); });"
                    % launch.group(1))
  src = src.replace("return gpuGetLastError();", "return gpuSuccess;")
  src = '#include "shim.h"\n' + src + ENTRY
  for name, text in [("fake_vendor.h", FAKE_VENDOR), ("cuda_bf16.h", FAKE_BF16),
                     ("mma.h", FAKE_MMA), ("shim.h", SHIM), ("emu.cc", src)]:
    (d / name).write_text(text)
  so = str(d / "emu.so")
  arch = ["-D__CUDA_ARCH__=900"] if request.param == "wmma" else []
  subprocess.run([CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-DJAXVT_GPU_CUDA=1",
                  *arch, f"-I{d}", f"-I{CSRC}", str(d / "emu.cc"), "-o", so], check=True,
                 capture_output=True)
  lib = ctypes.CDLL(so)
  p, i64 = ctypes.c_void_p, ctypes.c_int64
  lib.run_grouped.argtypes = [p, i64, p, p, i64, ctypes.c_int32, p, i64, p, p, i64, p, i64, i64,
                              i64]
  return lib


def run(lib, x: np.ndarray, s, layer: int, ids: np.ndarray | None) -> np.ndarray:
  """The emulated kernel on stack s: experts routed by ids [T, k], or (ids None) a dense matrix
  times every row of x. -> float32 [slots, rows]."""
  from jaxvt.ffi import grouped as gops, ops
  m = s.w.meta
  data, table, fmts = (np.ascontiguousarray(np.asarray(a)) for a in (s.w.data, s.w.table, s.w.fmts))
  xb = np.ascontiguousarray(np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16))
                            .view(np.uint16).reshape(-1, m.cols))
  if ids is None:
    slots = xb.shape[0]
    order, offsets = np.arange(slots, dtype=np.int32), np.array([0, slots], np.int32)
  else:
    slots = ids.size
    order, offsets = (np.ascontiguousarray(np.asarray(a))
                      for a in gops.group_slots(jnp.asarray(ids), m.experts))
  y = np.full((slots, m.rows), np.nan, np.float32)
  rc = lib.run_grouped(data.ctypes.data, data.shape[1], table.ctypes.data, fmts.ctypes.data,
                       len(fmts), layer, xb.ctypes.data, slots // xb.shape[0], order.ctypes.data,
                       offsets.ctypes.data, slots, y.ctypes.data, m.rows, m.cols, m.experts)
  assert rc == 0
  return y


def check(y, ref) -> None:
  want, tol, _, _ = ref
  assert y.shape == want.shape and np.all(np.abs(y - want) <= tol)  # NaN (a row never written) fails


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
def test_emulated_kernel(fmt, kernel):
  rng = np.random.default_rng(fmt)
  # 48 rows (one partial row tile), 5 experts, 160 slots with some routed nowhere / clamped:
  # several 32-slot tiles per expert.
  s = make_stack(rng, [Q4_K, fmt], 48, 512, experts=5)
  ids = routing(rng, t=40, k=4, experts=5)
  x = rng.standard_normal((40, 512)).astype(np.float32)
  check(run(kernel, x, s, 1, ids).reshape(40, 4, 48), grouped_ref(x, s.mats[1], ids))
  # x per slot; 70 rows (a full row tile and one of 6); for 32-element formats 352 columns (a
  # k-step of 256 and one of 96: 3 of a sub-step's 4 units).
  cols = 512 if fmt in (Q4_K, 13, Q6_K) else 352
  s = make_stack(rng, [fmt], 70, cols, experts=3)
  ids = routing(rng, t=20, k=2, experts=3)
  x = rng.standard_normal((20, 2, cols)).astype(np.float32)
  check(run(kernel, x, s, 0, ids).reshape(20, 2, 70), grouped_ref(x, s.mats[0], ids))


@pytest.mark.parametrize("fmt", [Q4_K, Q6_K, Q4_0, Q8_0, BF16], ids=NAMES.get)
def test_emulated_dense(fmt, kernel):
  """qmatmul_tiled's launch: one group of every row of x (70 rows: three slot tiles)."""
  rng = np.random.default_rng(100 + fmt)
  s = make_stack(rng, [fmt], 80, 512)
  x = rng.standard_normal((70, 512)).astype(np.float32)
  want = grouped_ref(x, s.mats[0], np.zeros((70, 1), np.int32))
  check(run(kernel, x, s, 0, None)[:, None], want)
