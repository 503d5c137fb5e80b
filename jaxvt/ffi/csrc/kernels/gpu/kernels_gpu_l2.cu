// Weights pulled into the device's L2 cache ahead of the launches that read them (CUDA sm_90+:
// cp.async.bulk.prefetch.L2, one instruction per piece, nothing to wait for; elsewhere the launch
// does nothing). A decode step's matvec kernels are short: each pays a chain of dependent memory
// round trips (launch, the layer's address, its activations, the first weight bytes) and reaches
// full bandwidth only after it. Weights already in L2 when such a kernel starts shorten the chain
// and let the bytes stream from HBM while earlier kernels run.
//
// Only device-tier layers are prefetched (a host-tier layer crosses the bus, which L2 prefetch
// does not drive); nothing here changes what any kernel computes.
#include <cstdint>

#include "common/formats.h"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

#if defined(JAXVT_GPU_CUDA)
constexpr int kL2Threads = 128;
// Bytes one prefetch instruction asks for.
constexpr int64_t kL2Piece = 16384;

// grid.y: (stack i, slot s) = (y / per, y % per), per = max(slots, 1); grid.x splits a region's
// pieces. The region: stack i's layer, or with ids its expert ids[s] (a negative id: nothing).
__global__ void __launch_bounds__(kL2Threads) l2_prefetch_kernel(L2Set P, const int32_t* ids,
                                                                int64_t slots) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int64_t per = slots > 0 ? slots : 1;
  const int i = static_cast<int>(blockIdx.y / per);
  const WeightArgs& w = P.w[i];
  const LayerRef L = resolve_layer(w.data, w.stride, w.table, w.fmts, w.n_layers, *w.layer);
  if (L.host || !fmt_supported(L.fmt)) return;
  const int64_t matrix = P.rows[i] * row_bytes(L.fmt, P.cols[i]);
  const int64_t experts = P.experts[i] > 0 ? P.experts[i] : 1;
  uintptr_t a = reinterpret_cast<uintptr_t>(L.base);
  int64_t bytes = matrix * experts;
  if (ids != nullptr) {
    const int32_t e = ids[blockIdx.y % per];
    if (e < 0) return;
    a += static_cast<uintptr_t>((e < experts ? e : experts - 1) * matrix);
    bytes = matrix;
  }
  // whole 16-byte words inside the region (the instruction's alignment)
  const uintptr_t end = (a + static_cast<uintptr_t>(bytes)) & ~uintptr_t{15};
  a = (a + 15) & ~uintptr_t{15};
  const uintptr_t step = static_cast<uintptr_t>(gridDim.x) * kL2Threads * kL2Piece;
  for (uintptr_t p = a + (static_cast<uintptr_t>(blockIdx.x) * kL2Threads + threadIdx.x) * kL2Piece;
       p < end; p += step) {
    const uint32_t n = static_cast<uint32_t>(end - p < kL2Piece ? end - p : kL2Piece);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(n) : "memory");
  }
#else
  (void)P, (void)ids, (void)slots;
#endif
}
#endif

}  // namespace

gpuError_t launch_l2_prefetch(gpuStream_t s, const L2Set& set, const int32_t* ids, int64_t slots) {
  if (set.n < 1 || set.n > kMaxL2) return gpuErrorInvalidValue;
#if defined(JAXVT_GPU_CUDA)
  static const bool engine = [] {
    int dev = 0, major = 0;
    if (gpuGetDevice(&dev) != gpuSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      (void)gpuGetLastError();
      return false;
    }
    return major >= 9;
  }();
  if (!engine || (ids != nullptr && slots <= 0)) return gpuSuccess;
  // the grid sized for a byte an element (the kernel's loop covers wider formats)
  int64_t most = 0;
  for (int i = 0; i < set.n; ++i) {
    const int64_t e = ids != nullptr || set.experts[i] < 1 ? 1 : set.experts[i];
    const int64_t b = set.rows[i] * set.cols[i] * e;
    most = b > most ? b : most;
  }
  const int64_t pieces = (most + kL2Piece - 1) / kL2Piece;
  const int64_t bx = (pieces + kL2Threads - 1) / kL2Threads;
  const dim3 grid(static_cast<unsigned>(bx > 0 ? bx : 1),
                  static_cast<unsigned>(set.n * (ids != nullptr ? slots : 1)));
  l2_prefetch_kernel<<<grid, kL2Threads, 0, s>>>(set, ids, slots);
  return gpuGetLastError();
#else
  (void)s, (void)ids, (void)slots;
  return gpuSuccess;
#endif
}

}  // namespace jaxvt::gpu
