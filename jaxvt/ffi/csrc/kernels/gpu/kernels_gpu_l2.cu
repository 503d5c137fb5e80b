// The L2-prefetch probe kernel (kernels_gpu.h launch_l2_prefetch; CUDA, and HIP via hipcc -x hip,
// where it launches nothing): a layer's bytes asked into the L2 cache, one
// cp.async.bulk.prefetch.L2 per piece. benchmarks.kernels --l2 times a matvec after it against
// the matvec alone.
#include <cstdint>

#include "common/formats.h"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

#if defined(JAXVT_GPU_CUDA)
constexpr int kL2Threads = 128;
constexpr int64_t kL2Piece = 16384;  // bytes one instruction asks for

__global__ void __launch_bounds__(kL2Threads) l2_prefetch_kernel(WeightArgs w, int64_t rows,
                                                                int64_t cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const LayerRef L = resolve_layer(w.data, w.stride, w.table, w.fmts, w.n_layers, *w.layer);
  if (L.host || !fmt_supported(L.fmt)) return;
  uintptr_t a = reinterpret_cast<uintptr_t>(L.base);
  // whole 16-byte words inside the layer (the instruction's alignment)
  const int64_t bytes = rows * row_bytes(L.fmt, cols);
  const uintptr_t end = (a + static_cast<uintptr_t>(bytes)) & ~uintptr_t{15};
  a = (a + 15) & ~uintptr_t{15};
  const uintptr_t step = static_cast<uintptr_t>(gridDim.x) * kL2Threads * kL2Piece;
  for (uintptr_t p = a + (static_cast<uintptr_t>(blockIdx.x) * kL2Threads + threadIdx.x) * kL2Piece;
       p < end; p += step) {
    const uint32_t n = static_cast<uint32_t>(end - p < kL2Piece ? end - p : kL2Piece);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(n) : "memory");
  }
#else
  (void)w, (void)rows, (void)cols;
#endif
}
#endif

}  // namespace

gpuError_t launch_l2_prefetch(gpuStream_t s, const WeightArgs& w, int64_t rows, int64_t cols) {
#if defined(JAXVT_GPU_CUDA)
  if (!bulk_engine() || rows <= 0 || cols <= 0) return gpuSuccess;
  // sized for a byte an element; the kernel's loop covers wider formats
  const int64_t blocks = (rows * cols / kL2Piece + kL2Threads - 1) / kL2Threads;
  l2_prefetch_kernel<<<static_cast<unsigned>(blocks > 0 ? blocks : 1), kL2Threads, 0, s>>>(
      w, rows, cols);
  return gpuGetLastError();
#else
  (void)s, (void)w, (void)rows, (void)cols;
  return gpuSuccess;
#endif
}

}  // namespace jaxvt::gpu
