// Device kernels of jaxvt (CUDA, and HIP via hipcc -x hip): the dense matvec (qmatmul), embedding
// rows (qembed), bf16 staging (qdequant) and the streaming-read probe. The matvec core is in
// matvec.cuh, shared with kernels_gpu_experts.cu (routed experts), in float32 or in ggml's integer
// products (docs/NUMERICS.md, "q8").
#include <cstdint>
#include <cstdio>  // printf: the phase stamps of a -DJAXVT_MV_PHASES=1 build (matvec.cuh)
#include <type_traits>

#include "common/formats.h"
#include "kernels/gpu/bf16.cuh"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

#include "kernels/gpu/matvec.cuh"

// grid.y: batch group g covers rows [g*BT, g*BT + BT) of x / y. Each warp of the block (blockDim.x
// / 32 of them: fewer for small matrices, so the rows spread over every SM) has its own slot of
// the dynamic shared memory; the block's held activation rows (XM) follow the slots.
template <int BT>
__device__ __forceinline__ Rows<BT> batch_group(const float* x, int64_t batch, float* y,
                                                int64_t rows, int64_t cols) {
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * BT;
  return dense_rows<BT>(x, b0, static_cast<int>(batch - b0 < BT ? batch - b0 : BT), y, rows, cols);
}

template <int BT, int XM>
__global__ void __launch_bounds__(kThreads, BT == 16 ? 1 : (BT == 1 ? kMvBlocks : 2)) qmatmul_kernel(WeightArgs w, const float* x, int64_t batch,
                                                           float* y, int64_t rows, int64_t cols,
                                                           int64_t bulk) {
  extern __shared__ uint4 smem_slots[];
#if JAXVT_MV_PHASES
  const uint64_t t0 = phase_start();
#endif
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  Rows<BT> R = batch_group<BT>(x, batch, y, rows, cols);
  R.u = w.up;
  LayerRef L;
  const auto hold = resolve_and_hold<BT, XM>(w, R, smem_slots + wpb * kSlotU4, &L);
#if JAXVT_MV_PHASES
  if (threadIdx.x == 0) mv_phase[1] = clock64() + (L.base == nullptr ? 1 : 0);  // after the read
#endif
  use_bulk<BT, XM>(R, bulk, smem_slots + wpb * kSlotU4, L.host);
  matvec_fmt<BT, XM>(L.fmt, L.base, R, rows, cols, smem_slots + wib * kSlotU4, lane,
                     static_cast<int64_t>(blockIdx.x) * wpb + wib, static_cast<int64_t>(gridDim.x) * wpb,
                     hold);
#if JAXVT_MV_PHASES
  if (BT == 1) phase_print(rows, cols, t0);
#endif
}

// Several matrices with the same input x (and the same layer index) in one launch: the blocks of
// matrix i are [block0[i], block0[i+1]); each computes exactly what qmatmul_kernel computes for
// that matrix alone (the rows' arithmetic does not depend on the grid), so the outputs are the
// same bits as separate launches.
struct MultiArgs {
  WeightArgs w[kMaxMulti];
  float* y[kMaxMulti];
  int64_t rows[kMaxMulti];
  int64_t block0[kMaxMulti + 1];
  int n;
};

template <int BT, int XM>
__global__ void __launch_bounds__(kThreads, BT == 16 ? 1 : (BT == 1 ? kMvBlocks : 2)) qmatmul_multi_kernel(
    MultiArgs m, const float* x, int64_t batch, int64_t cols, int64_t bulk) {
  extern __shared__ uint4 smem_slots[];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  int i = 0;
  while (i + 1 < m.n && static_cast<int64_t>(blockIdx.x) >= m.block0[i + 1]) ++i;
  Rows<BT> R = batch_group<BT>(x, batch, m.y[i], m.rows[i], cols);
  LayerRef L;
  const auto hold = resolve_and_hold<BT, XM>(m.w[i], R, smem_slots + wpb * kSlotU4, &L);
  use_bulk<BT, XM>(R, bulk, smem_slots + wpb * kSlotU4, L.host);
  const int64_t b = static_cast<int64_t>(blockIdx.x) - m.block0[i];
  matvec_fmt<BT, XM>(L.fmt, L.base, R, m.rows[i], cols, smem_slots + wib * kSlotU4, lane, b * wpb + wib,
                     (m.block0[i + 1] - m.block0[i]) * wpb, hold);
}

// One warp per looked-up row; lanes dequantize units straight from memory (rows are small).
template <int F>
__device__ void embed_rows(const uint8_t* base, const int32_t* ids, int64_t n, float* out,
                           int64_t rows, int64_t cols, int lane, int64_t gwarp, int64_t nwarps) {
  using T = Traits<F>;
  const int64_t rb = cols / T::kKbe * T::kKbb, nunits = cols / 32;
  for (int64_t i = gwarp; i < n; i += nwarps) {
    const uint8_t* row = base + clamp_id(ids[i], rows) * rb;
    for (int64_t u = lane; u < nunits; u += 32) {
      float wv[32];
      unit_weights<F>(row + (u / T::kUpk) * T::kKbb, static_cast<int>(u % T::kUpk), wv);
      float4* o = reinterpret_cast<float4*>(out + i * cols + 32 * u);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = make_float4(wv[4 * j], wv[4 * j + 1], wv[4 * j + 2], wv[4 * j + 3]);
    }
  }
}

__global__ void __launch_bounds__(kThreads) qembed_kernel(WeightArgs w, const int32_t* ids, int64_t n,
                                                          float* out, int64_t rows, int64_t cols) {
  const int lane = threadIdx.x & 31;
  const int64_t gwarp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  const LayerRef L = layer_ref(w);
#define JV_CASE(F) case F: embed_rows<F>(L.base, ids, n, out, rows, cols, lane, gwarp, nwarps); return;
  switch (L.fmt) {
    JV_CASE(kF32) JV_CASE(kF16) JV_CASE(kBF16) JV_CASE(kQ4_0) JV_CASE(kQ4_1) JV_CASE(kQ8_0)
    JV_CASE(kQ4_K) JV_CASE(kQ5_K) JV_CASE(kQ6_K)
    default: break;
  }
#undef JV_CASE
  for (int64_t i = gwarp * 32 + lane; i < n * cols; i += nwarps * 32) out[i] = __int_as_float(0x7fc00000);
}

// Streams the layer through shared memory like matvec and writes bf16 rows.
template <int F>
__device__ void dequant_stream(const uint8_t* base, uint16_t* out, int64_t rows, int64_t cols,
                               uint4* slot, int lane, int64_t gwarp, int64_t nwarps) {
  using T = Traits<F>;
  const int64_t nkb = cols / T::kKbe, rb = nkb * T::kKbb;
  const int64_t kch = rb <= kCap ? nkb : kCap / T::kKbb;
  const int64_t rpt = rb <= kCap ? kCap / rb : 1;
  const int64_t chunks_per_row = (nkb + kch - 1) / kch;
  const int64_t ntasks = (rows + rpt - 1) / rpt * chunks_per_row;
  for (int64_t t = gwarp; t < ntasks; t += nwarps) {
    const int64_t r0 = t / chunks_per_row * rpt, kb0 = t % chunks_per_row * kch;
    const int64_t nr = rows - r0 < rpt ? rows - r0 : rpt;
    const int64_t nk = nkb - kb0 < kch ? nkb - kb0 : kch;
    const uint8_t* p = load_chunk(slot, base + r0 * rb + kb0 * T::kKbb, nr == 1 ? nk * T::kKbb : nr * rb, lane);
    const int64_t units = nr * nk * T::kUpk;
    for (int64_t u = lane; u < units; u += 32) {
      const int64_t i = u / (nk * T::kUpk), v = u % (nk * T::kUpk);
      float wv[32];
      unit_weights<F>(p + i * rb + (v / T::kUpk) * T::kKbb, static_cast<int>(v % T::kUpk), wv);
      store_bf16x32(out + (r0 + i) * cols + kb0 * T::kKbe + 32 * v, wv);
    }
    gpuSyncWarp();
  }
}

__global__ void __launch_bounds__(kThreads) qdequant_kernel(WeightArgs w, uint16_t* out, int64_t rows,
                                                            int64_t cols) {
  __shared__ uint4 smem[kWarps][kChunkU4 + 1];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int64_t gwarp = static_cast<int64_t>(blockIdx.x) * kWarps + wib;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  const LayerRef L = layer_ref(w);
#define JV_CASE(F) case F: dequant_stream<F>(L.base, out, rows, cols, smem[wib], lane, gwarp, nwarps); return;
  switch (L.fmt) {
    JV_CASE(kF32) JV_CASE(kF16) JV_CASE(kBF16) JV_CASE(kQ4_0) JV_CASE(kQ4_1) JV_CASE(kQ8_0)
    JV_CASE(kQ4_K) JV_CASE(kQ5_K) JV_CASE(kQ6_K)
    default: break;
  }
#undef JV_CASE
  for (int64_t i = gwarp * 32 + lane; i < rows * cols; i += nwarps * 32) out[i] = 0x7fc0;
}

__global__ void stream_read_kernel(const uint4* __restrict__ p, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// The streaming read through the Hopper bulk-copy engine: each block keeps kBufs chunks of
// kBulk bytes in flight (cp.async.bulk global -> shared, completion counted on an mbarrier) and
// folds each chunk once it lands. A probe: does the copy engine of the SM read host memory over
// the bus faster than SM loads do?
constexpr int kBulk = 8192, kBufs = 4;

__global__ void __launch_bounds__(128) stream_read_bulk_kernel(const uint8_t* p, int64_t nchunks,
                                                               unsigned* sink) {
#if JAXVT_BULK_DEVICE
  __shared__ alignas(128) uint4 buf[kBufs][kBulk / 16];
  __shared__ alignas(8) uint64_t bar[kBufs];
  if (threadIdx.x == 0) {
    for (int i = 0; i < kBufs; ++i) mbar_init(&bar[i]);
    mbar_init_fence();
  }
  __syncthreads();
  auto fetch = [&](int st, int64_t c) { bulk_g2s(buf[st], p + c * kBulk, kBulk, &bar[st]); };
  const int64_t mine = nchunks > blockIdx.x ? (nchunks - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  if (threadIdx.x == 0)
    for (int i = 0; i < kBufs && i < mine; ++i) fetch(i, blockIdx.x + i * static_cast<int64_t>(gridDim.x));
  unsigned acc = 0;
  for (int64_t j = 0; j < mine; ++j) {
    const int st = static_cast<int>(j % kBufs);
    mbar_wait(&bar[st], static_cast<uint32_t>((j / kBufs) & 1));
    for (int i = threadIdx.x; i < kBulk / 16; i += blockDim.x) {
      const uint4 v = buf[st][i];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncthreads();  // every thread is done with the buffer before it is refilled
    if (threadIdx.x == 0 && j + kBufs < mine)
      fetch(st, blockIdx.x + (j + kBufs) * static_cast<int64_t>(gridDim.x));
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
#else
  (void)p, (void)nchunks, (void)sink;
#endif
}

}  // namespace

bool bulk_engine() {
#if defined(JAXVT_GPU_CUDA)
  static bool cached[64] = {false}, known[64] = {false};
  int dev = 0;
  if (gpuGetDevice(&dev) != gpuSuccess || dev < 0 || dev >= 64) {
    (void)gpuGetLastError();
    return false;
  }
  if (!known[dev]) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      (void)gpuGetLastError();
      major = 0;
    }
    cached[dev] = major >= 9;
    known[dev] = true;
  }
  return cached[dev];
#else
  return false;
#endif
}

int sm_count() {
  static int cached[64] = {0};
  int dev = 0;
  if (gpuGetDevice(&dev) != gpuSuccess || dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    if (gpuDeviceGetAttribute(&n, gpuDevAttrMultiProcessorCount, dev) != gpuSuccess || n <= 0) n = 80;
    cached[dev] = n;
  }
  return cached[dev];
}

namespace {

constexpr int64_t kSlotBytes = kSlotU4 * sizeof(uint4);  // shared memory per warp

// How a qmatmul launch runs: rows per pass (BT), warps per block, dynamic shared memory, and how
// the activations are read (XM, matvec.cuh). ggml's arithmetic holds quantized rows, 4 at most
// per pass; float32 holds rows (at most 4) when they fit and reads them from global memory
// otherwise: the values are the same either way, so the bits are too.
struct Launch {
  int bt, wpb, xm;
  int64_t smem;
  int64_t bulk = 0;  // matvec_bulk's stage bytes (0: the per-warp windows)
  Tuning tuning;  // the grid's size (kernels_gpu.h)
};

Launch plan_launch(int64_t batch, int64_t rows, int64_t cols, bool allow_small, bool ggml,
                   const Tuning& t) {
  static const int64_t allowed = [] {
    const int64_t v[] = {allow_dyn_smem(qmatmul_kernel<1, 1>, kPhaseSmem), allow_dyn_smem(qmatmul_kernel<4, 1>, kPhaseSmem),
                         allow_dyn_smem(qmatmul_kernel<1, 2>, kPhaseSmem), allow_dyn_smem(qmatmul_kernel<4, 2>, kPhaseSmem),
                         allow_dyn_smem(qmatmul_multi_kernel<1, 1>, kPhaseSmem),
                         allow_dyn_smem(qmatmul_multi_kernel<4, 1>, kPhaseSmem),
                         allow_dyn_smem(qmatmul_multi_kernel<1, 2>, kPhaseSmem),
                         allow_dyn_smem(qmatmul_multi_kernel<4, 2>, kPhaseSmem)};
    int64_t m = v[0];
    for (int64_t a : v) m = a < m ? a : m;
    return m;
  }();
  Launch l;
  l.tuning = t;
  l.bt = batch == 1 ? 1 : (batch <= 4 || ggml ? 4 : 16);
  // At batch 1 a matrix with too few rows to give every SM a block of 8 warps runs blocks of 2
  // warps, so its rows reach every SM.
  const bool small = allow_small && batch == 1 && (rows + kWarps - 1) / kWarps < sm_count() &&
                     t.grid_cap <= 0;
  l.wpb = small ? 2 : kWarps;
  const int64_t slots = l.wpb * kSlotBytes;
  if (ggml) {  // quantized rows, or float32 rows for a float format: room for either
    const int64_t row = ggml_held_row_bytes(cols);
    if (slots + l.bt * row > allowed) l.bt = 1;
    l.xm = slots + l.bt * row <= allowed ? 2 : -1;  // -1: activations too large
    l.smem = slots + l.bt * row;
    const int64_t stage = bulk_stage(t);
    if (l.xm == 2 && stage > 0 && l.smem + bulk_smem(stage) <= allowed) {
      l.bulk = stage;
      l.smem += bulk_smem(stage);
    }
    return l;
  }
  const int64_t held = slots + l.bt * xs_stride(cols) * 16;
  l.xm = l.bt <= 4 && held <= allowed ? 1 : 0;
  l.smem = l.xm ? held : slots;
  return l;
}

template <int BT, int XM>
gpuError_t run_qmatmul(gpuStream_t s, const Launch& l, const WeightArgs& w, const float* x,
                       int64_t batch, float* y, int64_t rows, int64_t cols) {
  const int64_t groups = (batch + BT - 1) / BT;
  const Tuning& t = l.tuning;
  int64_t cap = t.grid_cap > 0 ? t.grid_cap
                               : t.waves * resident_blocks(qmatmul_kernel<BT, XM>, 32 * l.wpb, l.smem) / groups;
  qmatmul_kernel<BT, XM><<<dim3(blocks_for(rows, cap < 1 ? 1 : cap, l.wpb), groups), 32 * l.wpb,
                           l.smem, s>>>(w, x, batch, y, rows, cols, l.bulk);
  return gpuGetLastError();
}

// f(rows per pass, activation mode) as compile-time constants (std::integral_constant) for the
// launch's pair, among those instantiated; any other pair (activations too large for shared
// memory) is an invalid value.
template <typename F>
gpuError_t with_launch(const Launch& l, F f) {
  using I1 = std::integral_constant<int, 1>;
  using I4 = std::integral_constant<int, 4>;
  using I16 = std::integral_constant<int, 16>;
  using X0 = std::integral_constant<int, 0>;
  using X1 = std::integral_constant<int, 1>;
  using X2 = std::integral_constant<int, 2>;
  switch (l.bt * 4 + l.xm) {
    case 1 * 4 + 0: return f(I1{}, X0{});
    case 1 * 4 + 1: return f(I1{}, X1{});
    case 1 * 4 + 2: return f(I1{}, X2{});
    case 4 * 4 + 0: return f(I4{}, X0{});
    case 4 * 4 + 1: return f(I4{}, X1{});
    case 4 * 4 + 2: return f(I4{}, X2{});
    case 16 * 4 + 0: return f(I16{}, X0{});
    default: return gpuErrorInvalidValue;
  }
}

template <int BT, int XM>
gpuError_t run_multi(gpuStream_t s, const Launch& l, MultiArgs& m, const int64_t* rows,
                     int64_t total, const float* x, int64_t batch, int64_t cols) {
  const int64_t groups = (batch + BT - 1) / BT;
  int64_t cap = l.tuning.waves * resident_blocks(qmatmul_multi_kernel<BT, XM>, kThreads, l.smem) / groups;
  if (cap < m.n) cap = m.n;
  // One wave of blocks shared in proportion to the rows, at least one block per matrix and no
  // more than the wave (a partial second wave would leave most SMs idle at the end).
  int64_t left = cap;
  m.block0[0] = 0;
  for (int i = 0; i < m.n; ++i) {
    int64_t share = cap * rows[i] / total;
    if (share < 1) share = 1;
    const int64_t later = m.n - 1 - i;  // blocks the matrices after this one still need
    if (share > left - later) share = left - later > 1 ? left - later : 1;
    const int64_t nb = blocks_for(rows[i], share);
    left -= nb;
    m.block0[i + 1] = m.block0[i] + nb;
  }
  const dim3 grid(static_cast<unsigned>(m.block0[m.n]), static_cast<unsigned>(groups));
  qmatmul_multi_kernel<BT, XM><<<grid, kThreads, l.smem, s>>>(m, x, batch, cols, l.bulk);
  return gpuGetLastError();
}

}  // namespace

gpuError_t launch_qmatmul(gpuStream_t s, const WeightArgs& w, const float* x, int64_t batch, float* y,
                          int64_t rows, int64_t cols, bool ggml, const Tuning& t) {
  if (batch <= 0 || rows <= 0) return gpuSuccess;
  if (w.up != nullptr && !ggml) return gpuErrorInvalidValue;  // (only ggml's launches hold x)
  const Launch l = plan_launch(batch, rows, cols, true, ggml, t);
  return with_launch(l, [&](auto bt, auto xm) {
    return run_qmatmul<decltype(bt)::value, decltype(xm)::value>(s, l, w, x, batch, y, rows, cols);
  });
}

gpuError_t launch_qmatmul_multi(gpuStream_t s, int n, const WeightArgs* w, float* const* y,
                                const int64_t* rows, const float* x, int64_t batch, int64_t cols,
                                bool ggml, const Tuning& t) {
  if (n < 1 || n > kMaxMulti) return gpuErrorInvalidValue;
  if (batch <= 0) return gpuSuccess;
  int64_t total = 0;
  for (int i = 0; i < n; ++i) total += rows[i];
  if (total <= 0) return gpuSuccess;
  const Launch l = plan_launch(batch, total, cols, false, ggml, t);
  MultiArgs m;
  m.n = n;
  for (int i = 0; i < n; ++i) {
    m.w[i] = w[i];
    m.y[i] = y[i];
    m.rows[i] = rows[i];
  }
  return with_launch(l, [&](auto bt, auto xm) {
    return run_multi<decltype(bt)::value, decltype(xm)::value>(s, l, m, rows, total, x, batch, cols);
  });
}

gpuError_t launch_qembed(gpuStream_t s, const WeightArgs& w, const int32_t* ids, int64_t n, float* out,
                         int64_t rows, int64_t cols) {
  if (n <= 0) return gpuSuccess;
  qembed_kernel<<<blocks_for(n, 8LL * sm_count()), kThreads, 0, s>>>(w, ids, n, out, rows, cols);
  return gpuGetLastError();
}

gpuError_t launch_qdequant(gpuStream_t s, const WeightArgs& w, uint16_t* out, int64_t rows,
                           int64_t cols, int64_t experts) {
  const int64_t total = rows * (experts > 0 ? experts : 1);
  if (total <= 0) return gpuSuccess;
  qdequant_kernel<<<blocks_for(total, 8LL * sm_count()), kThreads, 0, s>>>(w, out, total, cols);
  return gpuGetLastError();
}

gpuError_t launch_stream_read(gpuStream_t s, const void* p, int64_t n16, unsigned* sink,
                              int64_t blocks, bool bulk) {
  if (bulk) {
#if defined(JAXVT_GPU_CUDA)
    if (!bulk_engine() || (n16 * 16) % kBulk) return cudaErrorNotSupported;
    if (blocks <= 0) blocks = 2LL * sm_count();
    stream_read_bulk_kernel<<<blocks, 128, 0, s>>>(static_cast<const uint8_t*>(p), n16 * 16 / kBulk, sink);
    return gpuGetLastError();
#else
    return hipErrorNotSupported;
#endif
  }
  if (blocks <= 0) blocks = 4LL * sm_count();
  stream_read_kernel<<<blocks, 512, 0, s>>>(static_cast<const uint4*>(p), n16, sink);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
