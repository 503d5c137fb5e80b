// The routed-experts kernels (qmatmul_experts; CUDA, and HIP via hipcc -x hip): read only the
// experts the router picked with the matvec core of matvec.cuh (so an expert's rows give the bits
// a dense qmatmul of them gives): calls of up to kExpertsSlotMax slots stream each slot's expert on
// its own (decode, short prompts); larger ones read each routed expert once per 4 or 16 slots.
#include <cstdint>
#include <cstdio>  // printf: the phase stamps of a -DJAXVT_MV_PHASES=1 build (matvec.cuh)

#include "common/expert_cache.h"
#include "common/formats.h"
#include "common/prefetch.h"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

#include "kernels/gpu/matvec.cuh"

// The expert of a routed id: ids above range are clamped into it; a negative id routes its slot
// nowhere (-1: its output row is zero, nothing is read; a sharded MoE marks the slots of other
// devices' experts so).
__device__ __forceinline__ int expert_id(int32_t v, int64_t n) { return v < 0 ? -1 : clamp_id(v, n); }

// Where the block reads expert e of layer `layer`: from the decode expert ring when it holds that
// expert of that layer (thread 0 waits, sleeping, for the slot's copy; a copy that does not
// complete within about 16 ms leaves the host-tier address), else `base`. Block-uniform; every
// thread of the block must call it.
constexpr int64_t kXSpinLimit = int64_t{1} << 14;
__device__ const uint8_t* ring_expert(const uint8_t* ring, int32_t layer, int e,
                                      const uint8_t* base) {
  if (ring == nullptr) return base;
  __shared__ const uint8_t* where;
  if (threadIdx.x == 0) {
    where = base;
    const prefetch::XHeader* h = reinterpret_cast<const prefetch::XHeader*>(ring);
    const int j = prefetch::expert_slot(h, layer, e);
    if (j >= 0) {
      const uint32_t seq = h->seq;
      const volatile uint32_t* tag = &h->tag[j];
      int64_t i = 0;
      while (*tag != seq && i < kXSpinLimit) {
        gpuSleep();
        ++i;
      }
      if (*tag == seq) {
        __threadfence();
        where = ring + prefetch::kXHeader + j * h->slot;
      }
    }
  }
  __syncthreads();
  return where;
}

// grid.y: (matrix m, slot s) = (y / slots, y % slots); m picks w0 / y0 or w1 / y1 (two stacks of
// the same shape that read the same x: a MoE's gate and up). The first slot routed to an expert
// owns it and serves every slot routed to it, BT at a time; the other slots' blocks exit at once.
// Non-routed experts are never touched. Each group's activation rows are held in dynamic
// shared memory as XM says (matvec.cuh) before the warps stream the expert.
// Routed ids are cached in shared memory for calls of up to this many slots; larger calls read
// them from global memory.
constexpr int kIdsCached = 512;

template <int BT, int XM>
__global__ void __launch_bounds__(kThreads, 2) qmatmul_experts_kernel(
    WeightArgs w0, WeightArgs w1, const float* x, int x_per_slot, const int32_t* ids_g,
    int64_t slots, int64_t k, float* y0, float* y1, int64_t rows, int64_t cols, int64_t experts) {
  __shared__ uint4 smem[kWarps][kSlotU4];
  __shared__ int32_t ids_s[kIdsCached];
  extern __shared__ float4 xs_dyn[];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int64_t m = blockIdx.y / slots, s = blockIdx.y % slots;
  float* const y = m ? y1 : y0;
  const int32_t* ids = ids_g;
  if (slots <= kIdsCached) {  // one parallel load instead of a serial scan of global memory
    for (int64_t t = threadIdx.x; t < slots; t += blockDim.x) ids_s[t] = ids_g[t];
    __syncthreads();
    ids = ids_s;
  }
  const int e = expert_id(ids[s], experts);
  if (e < 0) {  // routed nowhere: this block's share of the slot's output row is 0
    for (int64_t r = threadIdx.x + static_cast<int64_t>(blockIdx.x) * kThreads; r < rows;
         r += static_cast<int64_t>(gridDim.x) * kThreads)
      y[s * rows + r] = 0.f;
    return;
  }
  int earlier = 0;  // does an earlier slot own this expert? (the block's threads split the scan)
  for (int64_t t = threadIdx.x; t < s; t += blockDim.x) earlier |= expert_id(ids[t], experts) == e;
  if (__syncthreads_or(earlier)) return;
  const LayerRef L = layer_ref(m ? w1 : w0);
  if (!fmt_supported(L.fmt)) {
    for (int64_t r = threadIdx.x + static_cast<int64_t>(blockIdx.x) * kThreads; r < rows;
         r += static_cast<int64_t>(gridDim.x) * kThreads)
      for (int64_t t = s; t < slots; ++t)
        if (expert_id(ids[t], experts) == e) y[t * rows + r] = __int_as_float(0x7fc00000);
    return;
  }
  const uint8_t* base = L.base + static_cast<int64_t>(e) * rows * row_bytes(L.fmt, cols);
  Rows<BT> R;  // (field by field, as the GPU-tested build had it: dense_rows changes its code)
  R.x = x;
  R.u = (m ? w1 : w0).up;
  R.y = y;
  R.cols = cols;
  R.rows = rows;
  R.b0 = 0;
  R.k = k;
  R.x_per_slot = x_per_slot;
  R.dense = 0;
  R.xs = nullptr;
  R.xs_stride = xs_stride(cols);
  R.xq = nullptr;
  R.xq_stride = xq_bytes(cols);
  R.xq_upad = xq_upad(cols);
  const bool quantized = L.fmt != kF32 && L.fmt != kF16 && L.fmt != kBF16;
  __shared__ int32_t served[BT];
  __shared__ int served_n;
  R.slot = served;
  // Every thread of the block runs the same group loop (it depends on ids only), so the
  // barriers below are reached uniformly.
  for (int64_t pos = s; pos < slots;) {
    __syncthreads();  // the previous group's readers are done with `served` and the held rows
    if (threadIdx.x == 0) {
      int n = 0;
      for (int64_t t = pos; t < slots && n < BT; ++t)
        if (expert_id(ids[t], experts) == e) served[n++] = static_cast<int32_t>(t);
      for (int b = n; b < BT; ++b) served[b] = static_cast<int32_t>(s);
      served_n = n;
    }
    __syncthreads();
    R.nb = served_n;
    if (XM == 1 || (XM == 2 && !quantized)) {
      hold_x_store<BT>(xs_dyn, hold_x_load<BT>(R, R.nb), R, R.nb);
      R.xs = xs_dyn;
    } else if (XM == 2) {
      hold_xq<BT>(reinterpret_cast<uint8_t*>(xs_dyn), R, R.nb, act_type(L.fmt));
      R.xq = reinterpret_cast<const uint8_t*>(xs_dyn);
    }
    pos = static_cast<int64_t>(served[R.nb - 1]) + 1;
    matvec_fmt<BT, XM>(L.fmt, base, R, rows, cols, smem[wib], lane,
                       static_cast<int64_t>(blockIdx.x) * kWarps + wib,
                       static_cast<int64_t>(gridDim.x) * kWarps);
    while (pos < slots && expert_id(ids[pos], experts) != e) ++pos;
  }
}

// Decode and short prompts (at most kExpertsSlotMax slots): every (matrix, slot) pair streams its
// own expert, as a dense matvec of one row would: no ownership scan and no group loop (at BT = 1
// the general kernel above spilled ~1.2 KB of registers per thread, and its prologue is serial).
// Slots that share an expert read it once each; each slot's row is the same dot in the same order
// either way, so the bits are those of qmatmul_experts_kernel and of a dense qmatmul of the
// expert's rows. Dynamic shared memory: the warps' slots, then the held activation row (XM as in
// matvec.cuh).
// phase (with the expert cache, where a call's slots may share an expert: a batch of rows, a short
// prompt): 0 computes every slot but the later slots of an expert the call fills (the first fills
// it, reading the bus once), 1 only those later slots, reading the slot the first launch filled;
// -1 (one token: its k experts are distinct) every slot in one launch.
template <int XM>
__global__ void __launch_bounds__(kThreads, kMvBlocks) qmatmul_experts_slot_kernel(
    WeightArgs w0, WeightArgs w1, const float* x, int x_per_slot, const int32_t* ids,
    int64_t slots, int64_t k, float* y0, float* y1, int64_t rows, int64_t cols, int64_t experts,
    int phase, int64_t bulk) {
  extern __shared__ uint4 smem_slots[];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int64_t m = blockIdx.y / slots, s = blockIdx.y % slots;
  float* const y = (m ? y1 : y0) + s * rows;
  const int e = expert_id(ids[s], experts);
  if (e < 0) {  // routed nowhere: this block's share of the slot's output row is 0
    if (phase == 1) return;
    for (int64_t r = threadIdx.x + static_cast<int64_t>(blockIdx.x) * kThreads; r < rows;
         r += static_cast<int64_t>(gridDim.x) * kThreads)
      y[r] = 0.f;
    return;
  }
  const WeightArgs w = m ? w1 : w0;  // a copy: a reference to either parameter puts both on the stack
  // The expert cache (expert_cache.h): a hit reads the slot; a fill reads where the expert lives
  // and writes the slot as it goes. Block-uniform, as ring_expert needs.
  const uint8_t* part = nullptr;
  int32_t wj = -1;
  auto cached = [&] {
    part = w.where != nullptr ? xcache::entry<const uint8_t>(w.ctab, w.n_layers, *w.layer)
                              : nullptr;
    wj = part != nullptr ? w.where[s] : -1;
  };
  if (phase >= 0) {
    cached();
    // a later slot of an expert this call fills: every slot of that expert has the same where
    int later = 0;
    if (wj <= -2)
      for (int64_t t = threadIdx.x; t < s; t += blockDim.x) later |= w.where[t] == wj;
    if ((__syncthreads_or(later) != 0) != (phase == 1)) return;
    if (phase == 1) wj = -wj - 2;  // filled by the first launch: read as a hit
  }
  const int64_t xi = (x_per_slot ? s : s / k) * cols;
  Rows<1> R = dense_rows<1>(x + xi, 0, 1, y, rows, cols);
  R.u = w.up ? w.up + xi : nullptr;
  LayerRef L;
  const auto hold = resolve_and_hold<1, XM>(w, R, smem_slots + kWarps * kSlotU4, &L);
  // (an unsupported format reaches matvec_fmt, which writes NaN rows)
  if (phase < 0) cached();  // (one token: after the activation row's load is under way)
  const uint8_t* home = L.base + static_cast<int64_t>(e) * rows * row_bytes(L.fmt, cols);
  const uint8_t* base = wj >= 0 ? part + wj * w.cslot : ring_expert(w.ring, *w.layer, e, home);
  use_bulk<1, XM>(R, bulk, smem_slots + kWarps * kSlotU4, L.host && base == home);
  const int64_t gwarp = static_cast<int64_t>(blockIdx.x) * kWarps + wib;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  if (wj <= -2) {
    R.mirror = reinterpret_cast<uintptr_t>(part + (-wj - 2) * w.cslot) -
               reinterpret_cast<uintptr_t>(base);
    matvec_fmt<1, XM, decltype(hold), true>(L.fmt, base, R, rows, cols,
                                            smem_slots + wib * kSlotU4, lane, gwarp, nwarps, hold);
    return;
  }
  matvec_fmt<1, XM>(L.fmt, base, R, rows, cols, smem_slots + wib * kSlotU4, lane, gwarp, nwarps,
                    hold);
}

template <int XM>
gpuError_t launch_slot(gpuStream_t s, int nmat, const WeightArgs& w0, const WeightArgs& w1,
                       const float* x, bool x_per_slot, const int32_t* ids, int64_t slots,
                       int64_t k, float* y0, float* y1, int64_t rows, int64_t cols,
                       int64_t experts, int64_t smem, int64_t waves, int phase, int64_t bulk) {
  // One wave of resident blocks shared by the (matrix, slot) pairs.
  const int64_t resident = resident_blocks(qmatmul_experts_slot_kernel<XM>, kThreads,
                                           static_cast<size_t>(smem));
  int64_t cap = waves * resident / (nmat * slots);
  if (cap < 1) cap = 1;
  const dim3 grid(blocks_for(rows, cap), nmat * slots), block(kThreads);
  qmatmul_experts_slot_kernel<XM><<<grid, block, smem, s>>>(w0, w1, x, x_per_slot, ids, slots, k,
                                                           y0, y1, rows, cols, experts, phase,
                                                           bulk);
  return gpuGetLastError();
}

// The per-slot kernel's static shared memory (ring_expert's pointer), left out of the dynamic
// limit it opts in to (a kernel cannot opt in to more than the device's limit less its static).
constexpr int64_t kSlotStatic = 64 + kPhaseSmem;

// The per-slot kernel, with the activation row held as for the general kernel.
gpuError_t launch_per_slot(gpuStream_t s, int nmat, const WeightArgs& w0,
                           const WeightArgs& w1, const float* x, bool x_per_slot,
                           const int32_t* ids, int64_t slots, int64_t k, float* y0, float* y1,
                           int64_t rows, int64_t cols, int64_t experts, bool ggml,
                           const Tuning& t, int phase) {
  const int64_t waves = t.waves;
  constexpr int64_t kSlots = static_cast<int64_t>(sizeof(uint4)) * kWarps * kSlotU4;
  static const int64_t allowed_f = allow_dyn_smem(qmatmul_experts_slot_kernel<1>, kSlotStatic);
  static const int64_t allowed_q = allow_dyn_smem(qmatmul_experts_slot_kernel<2>, kSlotStatic);
  static const int64_t allowed_0 = allow_dyn_smem(qmatmul_experts_slot_kernel<0>, kSlotStatic);
  if (ggml) {
    const int64_t row = ggml_held_row_bytes(cols);
    if (kSlots + row > allowed_q) return gpuErrorInvalidValue;  // activations too large
    int64_t stage = bulk_stage(t);
    if (kSlots + row + bulk_smem(stage) > allowed_q) stage = 0;
    return launch_slot<2>(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols,
                          experts, kSlots + row + bulk_smem(stage), waves, phase, stage);
  }
  const int64_t need = kSlots + xs_stride(cols) * 16;
  if (need <= allowed_f)
    return launch_slot<1>(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols,
                          experts, need, waves, phase, 0);
  if (kSlots > allowed_0) return gpuErrorInvalidValue;
  return launch_slot<0>(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols,
                        experts, kSlots, waves, phase, 0);
}

constexpr int64_t kStaticSmem =
    static_cast<int64_t>(sizeof(uint4)) * kWarps * kSlotU4 + 4 * kIdsCached + 64 + kPhaseSmem;

template <int BT, int XM>
gpuError_t launch(gpuStream_t s, int nmat, const WeightArgs& w0, const WeightArgs& w1,
                  const float* x, bool x_per_slot, const int32_t* ids, int64_t slots, int64_t k,
                  float* y0, float* y1, int64_t rows, int64_t cols, int64_t experts, int64_t smem) {
  // Slots whose expert another slot owns exit at once, so size the grid for the owners: assume
  // min(slots, experts) of them per matrix share one wave of resident blocks.
  const int64_t resident = resident_blocks(qmatmul_experts_kernel<BT, XM>, kThreads, static_cast<size_t>(smem));
  const int64_t owners = nmat * (slots < experts ? slots : (experts > 0 ? experts : 1));
  int64_t cap = 2 * resident / owners;
  if (cap < 1) cap = 1;
  const dim3 grid(blocks_for(rows, cap), nmat * slots), block(kThreads);
  qmatmul_experts_kernel<BT, XM><<<grid, block, smem, s>>>(w0, w1, x, x_per_slot, ids, slots, k, y0,
                                                           y1, rows, cols, experts);
  return gpuGetLastError();
}

// The activation rows are held in shared memory when they fit (at most 4 per group): as
// float32 rows, or quantized under ggml's arithmetic (which needs them held).
template <int BT>
gpuError_t launch_bt(gpuStream_t s, int nmat, const WeightArgs& w0, const WeightArgs& w1,
                     const float* x, bool x_per_slot, const int32_t* ids, int64_t slots, int64_t k,
                     float* y0, float* y1, int64_t rows, int64_t cols, int64_t experts, bool ggml) {
  static const int64_t allowed_f = allow_dyn_smem(qmatmul_experts_kernel<BT, 1>, kStaticSmem);
  static const int64_t allowed_q = allow_dyn_smem(qmatmul_experts_kernel<BT, 2>, kStaticSmem);
  if (ggml) {  // quantized rows, or float32 rows for a float format: room for either
    const int64_t row = ggml_held_row_bytes(cols);
    const int64_t need = BT * row;
    if (need > allowed_q) return gpuErrorInvalidValue;  // activations too large for shared memory
    return launch<BT, 2>(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols,
                         experts, need);
  }
  const int64_t need = BT * xs_stride(cols) * 16;
  if (need <= allowed_f)
    return launch<BT, 1>(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols,
                         experts, need);
  return launch<BT, 0>(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols,
                       experts, 0);
}

gpuError_t launch_any(gpuStream_t s, int nmat, const WeightArgs& w0, const WeightArgs& w1,
                      const float* x, bool x_per_slot, const int32_t* ids, int64_t slots, int64_t k,
                      float* y0, float* y1, int64_t rows, int64_t cols, int64_t experts, bool ggml,
                      const Tuning& t) {
  if (slots <= 0 || rows <= 0) return gpuSuccess;
  if ((w0.up != nullptr || w1.up != nullptr) && !ggml) return gpuErrorInvalidValue;
  // the expert cache's decisions are the per-slot kernel's (a decode step's few slots)
  if (w0.where != nullptr && slots > t.slot_max) return gpuErrorInvalidValue;
  // grid.y holds at most 65535 (matrix, slot) pairs: larger calls run in chunks of whole tokens
  // (each chunk is the same product restricted to its slots).
  const int64_t per = (65535 / nmat) / k * k;
  if (slots > per) {
    for (int64_t c0 = 0; c0 < slots; c0 += per) {
      const int64_t n = slots - c0 < per ? slots - c0 : per;
      const int64_t xo = (x_per_slot ? c0 : c0 / k) * cols;
      WeightArgs a0 = w0, a1 = w1;  // swiglu's up operands follow x
      if (a0.up) a0.up += xo;
      if (a1.up) a1.up += xo;
      const gpuError_t e = launch_any(s, nmat, a0, a1, x + xo, x_per_slot, ids + c0, n, k,
                                      y0 + c0 * rows, y1 + c0 * rows, rows, cols, experts, ggml, t);
      if (e != gpuSuccess) return e;
    }
    return gpuSuccess;
  }
  // Decode and short prompts: the per-slot kernel; with the expert cache and more than one token,
  // in two launches so that each expert the call fills crosses the bus once.
  if (slots <= t.slot_max) {
    if (w0.where == nullptr || slots <= k)
      return launch_per_slot(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols,
                             experts, ggml, t, -1);
    for (int phase = 0; phase < 2; ++phase) {
      const gpuError_t e = launch_per_slot(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1,
                                           rows, cols, experts, ggml, t, phase);
      if (e != gpuSuccess) return e;
    }
    return gpuSuccess;
  }
  if (slots <= 64 || ggml)
    return launch_bt<4>(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols, experts,
                        ggml);
  return launch<16, 0>(s, nmat, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols,
                       experts, 0);
}

}  // namespace

gpuError_t launch_qmatmul_experts(gpuStream_t s, const WeightArgs& w, const float* x, bool x_per_slot,
                                  const int32_t* ids, int64_t slots, int64_t k, float* y,
                                  int64_t rows, int64_t cols, int64_t experts, bool ggml,
                                  const Tuning& t) {
  return launch_any(s, 1, w, w, x, x_per_slot, ids, slots, k, y, y, rows, cols, experts, ggml, t);
}

gpuError_t launch_qmatmul_experts2(gpuStream_t s, const WeightArgs& w0, const WeightArgs& w1,
                                   const float* x, bool x_per_slot, const int32_t* ids,
                                   int64_t slots, int64_t k, float* y0, float* y1, int64_t rows,
                                   int64_t cols, int64_t experts, bool ggml, const Tuning& t) {
  return launch_any(s, 2, w0, w1, x, x_per_slot, ids, slots, k, y0, y1, rows, cols, experts, ggml,
                    t);
}

}  // namespace jaxvt::gpu
