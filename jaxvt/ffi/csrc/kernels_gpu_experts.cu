// The routed-experts kernel (qmatmul_experts; CUDA, and HIP via hipcc -x hip): reads only the
// experts the router picked, each once per 16 slots routed to it, with the matvec core of
// matvec.cuh (so an expert's rows give the bits a dense qmatmul of them gives).
#include <cstdint>

#include "formats.h"
#include "kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

#include "matvec.cuh"

// The expert of a routed id: ids above range are clamped into it; a negative id routes its slot
// nowhere (-1: its output row is zero, nothing is read; a sharded MoE marks the slots of other
// devices' experts so).
__device__ __forceinline__ int expert_id(int32_t v, int64_t n) { return v < 0 ? -1 : clamp_id(v, n); }

// grid.y: slot s. The first slot routed to an expert owns it and serves every slot routed to it,
// BT at a time; the other slots' blocks exit at once. Non-routed experts are never touched.
template <int BT>
__global__ void __launch_bounds__(kThreads, 2) qmatmul_experts_kernel(
    WeightArgs w, const float* x, int x_per_slot, const int32_t* ids, int64_t slots, int64_t k,
    float* y, int64_t rows, int64_t cols, int64_t experts) {
  __shared__ uint4 smem[kWarps][kSlotU4];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int64_t s = blockIdx.y;
  const int e = expert_id(ids[s], experts);
  if (e < 0) {  // routed nowhere: this block's share of the slot's output row is 0
    for (int64_t r = threadIdx.x + static_cast<int64_t>(blockIdx.x) * kThreads; r < rows;
         r += static_cast<int64_t>(gridDim.x) * kThreads)
      y[s * rows + r] = 0.f;
    return;
  }
  for (int64_t t = 0; t < s; ++t)
    if (expert_id(ids[t], experts) == e) return;
  const LayerRef L = layer_ref(w);
  if (!fmt_supported(L.fmt)) {
    for (int64_t r = threadIdx.x + static_cast<int64_t>(blockIdx.x) * kThreads; r < rows;
         r += static_cast<int64_t>(gridDim.x) * kThreads)
      for (int64_t t = s; t < slots; ++t)
        if (expert_id(ids[t], experts) == e) y[t * rows + r] = __int_as_float(0x7fc00000);
    return;
  }
  const uint8_t* base = L.base + static_cast<int64_t>(e) * rows * row_bytes(L.fmt, cols);
  Rows<BT> R;
  R.x = x;
  R.y = y;
  R.cols = cols;
  R.rows = rows;
  R.b0 = 0;
  R.k = k;
  R.x_per_slot = x_per_slot;
  R.dense = 0;
  __shared__ int32_t served[BT];
  __shared__ int served_n;
  R.slot = served;
  // Every thread of the block runs the same group loop (it depends on ids only), so the
  // barriers below are reached uniformly.
  for (int64_t pos = s; pos < slots;) {
    __syncthreads();  // the previous group's readers are done with `served`
    if (threadIdx.x == 0) {
      int n = 0;
      for (int64_t t = pos; t < slots && n < BT; ++t)
        if (expert_id(ids[t], experts) == e) served[n++] = static_cast<int32_t>(t);
      for (int b = n; b < BT; ++b) served[b] = static_cast<int32_t>(s);
      served_n = n;
    }
    __syncthreads();
    R.nb = served_n;
    pos = static_cast<int64_t>(served[R.nb - 1]) + 1;
    matvec_fmt<BT>(L.fmt, base, R, rows, cols, smem[wib], lane,
                   static_cast<int64_t>(blockIdx.x) * kWarps + wib,
                   static_cast<int64_t>(gridDim.x) * kWarps);
    while (pos < slots && expert_id(ids[pos], experts) != e) ++pos;
  }
}

}  // namespace

gpuError_t launch_qmatmul_experts(gpuStream_t s, const WeightArgs& w, const float* x, bool x_per_slot,
                                  const int32_t* ids, int64_t slots, int64_t k, float* y,
                                  int64_t rows, int64_t cols, int64_t experts) {
  if (slots <= 0 || rows <= 0) return gpuSuccess;
  // Slots whose expert another slot owns exit at once, so size the grid for the owners: assume
  // min(slots, experts) of them share one wave of resident blocks.
  static const int64_t resident = resident_blocks(qmatmul_experts_kernel<1>);
  const int64_t owners = slots < experts ? slots : (experts > 0 ? experts : 1);
  int64_t cap = 2 * resident / owners;
  if (cap < 1) cap = 1;
  const dim3 grid(blocks_for(rows, cap), slots), block(kThreads);
  if (slots <= 4) {
    qmatmul_experts_kernel<1><<<grid, block, 0, s>>>(w, x, x_per_slot, ids, slots, k, y, rows,
                                                     cols, experts);
  } else if (slots <= 64) {
    qmatmul_experts_kernel<4><<<grid, block, 0, s>>>(w, x, x_per_slot, ids, slots, k, y, rows,
                                                     cols, experts);
  } else {
    qmatmul_experts_kernel<16><<<grid, block, 0, s>>>(w, x, x_per_slot, ids, slots, k, y, rows,
                                                      cols, experts);
  }
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
