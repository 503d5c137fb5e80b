// The matvec core shared by jaxvt's device kernels (kernels_gpu.cu, kernels_gpu_experts.cu; CUDA,
// and HIP via hipcc -x hip): fused dequantize-and-dot over GGUF blocks that read each weight byte
// once per call, from HBM or in place from pinned host memory. Included inside each file's
// anonymous namespace.
//
// Streaming design (one logical warp of 32 lanes owns whole output rows; details at matvec()):
//   * A warp streams runs of consecutive rows (a layer's rows are contiguous, so a run is one
//     contiguous byte range) through its own shared-memory slot, in windows of up to 2 KiB whose
//     ends fall on 128-byte boundaries, with coalesced 16-byte loads (lane i loads uint4 i, i+32,
//     ...; four loads per lane issued back to back). Each weight byte crosses the bus once, in
//     whole cache lines inside a run; shared memory then serves the unaligned, per-block reads of
//     the dequantizer, and a k-block cut by a window's end is carried over to the next window.
//   * Lanes dequantize 32-element units (formats.h) and dot them with up to BT activation rows
//     (BT in {1, 4, 16}); a row's unit g is always lane g % 32's, and the warp reduces with
//     shuffles in a fixed order, so results do not depend on timing, windows, addresses, grid
//     size or tier: a host-tier layer gives the bits its device-tier copy gives. (Under ggml's
//     arithmetic at BT 1, two whole rows of at most 16 units in one window go to the two half
//     warps, each summed in the full warp's order: accumulate_q8_pair, write_pair.)
//   * Many warps per SM (8 per block, grid sized from the SM count) keep enough loads in flight to
//     cover PCIe latency; runs go round-robin over the warps, so the grid's size never depends on
//     the format.
//   * Under ggml's arithmetic the window's blocks are read with shared-state loads (ld.shared, not
//     generic ones), as aligned 32-bit words funnel-shifted into place (the k-blocks of Q4_0 / Q8_0
//     / Q6_K sit at 2-byte alignment) or as 128-bit words where a Q4_K / Q5_K matrix is 16-byte
//     aligned (matvec_q8.cuh). Measured on the H200 (docs/BENCHMARKS.md): the
//     kernels are bound by their instructions per byte; more windows in flight per warp
//     (kMvDepth 2), two units a lane unrolled (kMvUnroll 2) or three blocks an SM (kMvBlocks 3)
//     were each slower.
// Under ggml's arithmetic on CUDA sm_90+, a device-tier matrix instead crosses in whole rows
// through the bulk-copy engine (matvec_bulk.cuh); a row's units, lanes and reductions are those of
// the windows, so every path and tier gives the same bits. Two arithmetics (XM below): float32 (dequantize, float32 dot) and ggml's (activations
// quantized in shared memory to the format's vec-dot type, integer dots per 32-element unit).
// Accumulation is float32 throughout. Batches above 16 rows re-stream the weights once per group
// of 16 rows (grid.y); large-batch prefill should stage weights with qdequant instead.
#ifndef JAXVT_FFI_CSRC_MATVEC_CUH_
#define JAXVT_FFI_CSRC_MATVEC_CUH_

constexpr int kThreads = 256;
// Phase stamps for measurement (CUDA, -DJAXVT_MV_PHASES=1; python -m benchmarks.phases): thread 0
// of a block records clock64() as it reaches each phase of a bulk-copy matvec (matvec_bulk.cuh),
// and a few blocks of each one-row qmatmul launch print them (kernels_gpu.cu). kPhaseSmem: the
// static shared memory they take (none when off: then they are no code).
#ifndef JAXVT_MV_PHASES
#define JAXVT_MV_PHASES 0
#endif
constexpr int64_t kPhaseSmem = JAXVT_MV_PHASES ? 64 : 0;
#if JAXVT_MV_PHASES
__shared__ long long mv_phase[8];
#define MV_PHASE(i) \
  do { \
    if (threadIdx.x == 0) mv_phase[i] = clock64(); \
  } while (0)
// The phase stamps' clock at a kernel's entry (stamp 0, the others cleared) and the global timer.
__device__ __forceinline__ uint64_t phase_start() {
  MV_PHASE(0);
  if (threadIdx.x == 0)
    for (int i = 1; i < 8; ++i) mv_phase[i] = 0;
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// After the block's matvec: its end (stamp 6) and a barrier (7); blocks 0, 1, 40, the middle one
// and the last print one line (python -m benchmarks.phases reads them): cycles after entry.
__device__ __forceinline__ void phase_print(int64_t rows, int64_t cols, uint64_t t0) {
  MV_PHASE(6);
  __syncthreads();
  MV_PHASE(7);
  uint64_t t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const unsigned b = blockIdx.x, n = gridDim.x;
  if (threadIdx.x == 0 && (b < 2 || b == 40 || b == n / 2 || b + 1 == n)) {
    long long c[7];
    for (int i = 1; i < 8; ++i) c[i - 1] = mv_phase[i] ? mv_phase[i] - mv_phase[0] : -1;
    printf("TR rows %lld cols %lld blk %u/%u sm %u g0 %llu gdur %llu c: res %lld tma %lld pro %lld "
           "wait0 %lld comp0 %lld end %lld sync %lld\n", static_cast<long long>(rows),
           static_cast<long long>(cols), b, n, sm, static_cast<unsigned long long>(t0),
           static_cast<unsigned long long>(t1 - t0), c[0], c[1], c[2], c[3], c[4], c[5], c[6]);
  }
}
#else
#define MV_PHASE(i) \
  do { \
  } while (0)
#endif
// Blocks per SM the single-row matvec kernels are compiled for (their register budget; the grid
// is one wave of resident blocks, so more blocks are more loads in flight). A build knob for
// measurement (-DJAXVT_MV_BLOCKS=N); the rows' arithmetic does not depend on it.
#ifndef JAXVT_MV_BLOCKS
#define JAXVT_MV_BLOCKS 2
#endif
constexpr int kMvBlocks = JAXVT_MV_BLOCKS;
// How many of a lane's units accumulate_q8 unrolls (their loads interleaved); same order of adds.
#ifndef JAXVT_MV_UNROLL
#define JAXVT_MV_UNROLL 1
#endif
constexpr int kMvUnroll = JAXVT_MV_UNROLL;
// Windows a warp of matvec keeps in flight (1 or 2); the rows' arithmetic does not depend on it.
#ifndef JAXVT_MV_DEPTH
#define JAXVT_MV_DEPTH 1
#endif
constexpr int kMvDepth = JAXVT_MV_DEPTH;
constexpr int kWarps = kThreads / 32;
constexpr int kLaneU4 = 4;                    // uint4 loads per lane per chunk
constexpr int kChunkU4 = 32 * kLaneU4;        // 128 uint4 = 2 KiB per warp
constexpr int kCap = kChunkU4 * 16 - 32;      // usable bytes (room for alignment slop)
constexpr int kWin = kChunkU4 * 16;           // matvec's window: 2 KiB, a multiple of 128 bytes
constexpr int kPreU4 = 14;                    // room for a carried partial k-block (< 224 bytes)
constexpr int kSlotU4 = kPreU4 + kChunkU4 + 1;  // one warp's shared memory in matvec

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += gpuShflXor(v, o);
  return v;
}

// A warp's next chunk, loaded into registers (four 16-byte loads per lane in flight) while the
// warp computes on the previous one, then committed to its shared-memory slot.
struct Pending {
  uint4 v[kLaneU4];
  int n;    // uint4 loaded
  int off;  // where the wanted first byte sits in the first uint4
};

// Issues the loads of [src, src+len) (len <= kCap), from the 16-byte boundary below src.
__device__ __forceinline__ void issue(Pending& p, const uint8_t* src, int64_t len, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(src);
  const uint4* g = reinterpret_cast<const uint4*>(a & ~uintptr_t{15});
  p.off = static_cast<int>(a & 15);
  p.n = static_cast<int>((p.off + len + 15) >> 4);
#pragma unroll
  for (int j = 0; j < kLaneU4; ++j)
    if (lane + 32 * j < p.n) p.v[j] = g[lane + 32 * j];
}

// Stores a pending chunk into the slot; returns where its first wanted byte landed.
__device__ __forceinline__ const uint8_t* commit(uint4* slot, const Pending& p, int lane) {
#pragma unroll
  for (int j = 0; j < kLaneU4; ++j)
    if (lane + 32 * j < p.n) slot[lane + 32 * j] = p.v[j];
  gpuSyncWarp();
  return reinterpret_cast<const uint8_t*>(slot) + p.off;
}

// Writes a committed chunk to dst as well (the expert cache's fill: the bytes the warp just
// read, to the same offsets of the cache slot; p.off is 0, windows start on 16-byte boundaries).
__device__ __forceinline__ void mirror_store(uint4* dst, const Pending& p, int lane) {
#pragma unroll
  for (int j = 0; j < kLaneU4; ++j)
    if (lane + 32 * j < p.n) dst[lane + 32 * j] = p.v[j];
}

// Copies [src, src+len) into the slot at once (no overlap with computation).
__device__ __forceinline__ const uint8_t* load_chunk(uint4* slot, const uint8_t* src, int64_t len,
                                                     int lane) {
  Pending p;
  issue(p, src, len, lane);
  return commit(slot, p, lane);
}

template <int F>
struct Traits {
  static constexpr int kKbe = (F == kQ4_K || F == kQ5_K || F == kQ6_K) ? 256 : 32;
  static constexpr int kKbb = F == kF32 ? 128 : F == kF16 ? 64 : F == kBF16 ? 64 : F == kQ4_0 ? 18
                            : F == kQ4_1 ? 20 : F == kQ8_0 ? 34 : F == kQ4_K ? 144 : F == kQ5_K ? 176
                            : 210;
  static constexpr int kUpk = kKbe / 32;
};

// Which activation / output rows a warp works on: dense rows b0 + b, or routed slots.
// xs: when not null, the block's activation rows held in shared memory (hold_x_load /
// hold_x_store below), read
// there instead of from global memory; both give the same values, so the same bits.
template <int BT>
struct Rows {
  const float* x;
  float* y;
  int64_t cols, rows;
  int nb;            // rows in use (<= BT)
  int64_t b0;        // dense: first batch row
  int64_t k;         // experts: slots per token (x row of a slot = slot / k unless x_per_slot)
  int x_per_slot;    // experts: x holds one row per slot
  int dense;
  const int32_t* slot;  // experts: the slots served (shared memory, BT entries)
  const float4* xs;     // held rows (or null), xs_stride float4 per row
  int64_t xs_stride;
  const uint8_t* xq;    // ggml arithmetic: quantized held rows (hold_xq), xq_stride bytes each
  int64_t xq_stride, xq_upad;
  // swiglu's up operand (rows laid out as x's), or null: where set, the product's input is
  // swiglu(x, u) = (x / (1 + exp(0 - x))) * u, formed as the rows are held (XM 1 and 2 only)
  const float* u = nullptr;
  uintptr_t mirror;     // matvec<..., MR>: the fill's destination minus the weights' address
  // matvec_bulk (matvec_bulk.cuh): stage bytes (0: matvec()'s windows) and the block's two stages
  int64_t bulk = 0;
  uint8_t* bulk_smem = nullptr;
  __device__ __forceinline__ int64_t xrow_index(int b) const {
    return dense ? b0 + b : (x_per_slot ? slot[b] : slot[b] / k);
  }
  __device__ __forceinline__ const float* xrow(int b) const { return x + xrow_index(b) * cols; }
  __device__ __forceinline__ const float* urow(int b) const { return u + xrow_index(b) * cols; }
  __device__ __forceinline__ float* yrow(int b) const { return y + (dense ? b0 + b : slot[b]) * rows; }
};

// Activations held in shared memory. Lane g % 32 is the only reader of unit g (32 elements) of a row, and reads
// it as 8 float4; reading it from global memory puts the 32 lanes of a warp on 32 different cache
// lines per load. Held in shared memory, float4 c (0..7) of unit g sits at ((g / 32) * 8 + c) * 32 + g % 32,
// so a warp's load is 32 consecutive float4 (no bank conflict) and every warp of the block
// shares one copy.
__host__ __device__ __forceinline__ int64_t xs_stride(int64_t cols) {
  return ((cols / 32 + 31) / 32) * 256;
}

// Copies activation rows 0..nb-1 of R into xs, in two parts so a kernel can do other loads (its
// layer's address) while the first part's loads are in flight: hold_x_load issues the first
// kXBatch float4 of each thread, hold_x_store stores them, copies the rest kXBatch at a time
// (each batch's loads issued before its stores) and ends with a barrier. All threads of the block
// take part.
constexpr int kXBatch = 4;
struct XLoad {
  float4 v[kXBatch];
};

// silu(g) * u in numerics.swiglu's expression (the one the model's swiglu step computes).
__device__ __forceinline__ float swiglu1(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(__fsub_rn(0.0f, g)))), u);
}
__device__ __forceinline__ float4 swiglu4(float4 g, float4 u) {
  return make_float4(swiglu1(g.x, u.x), swiglu1(g.y, u.y), swiglu1(g.z, u.z), swiglu1(g.w, u.w));
}

// float4 i of the held rows (row i / n4): x's, or swiglu(x, u) where R.u is set.
template <int BT>
__device__ __forceinline__ float4 x_val4(const Rows<BT>& R, int64_t i, int64_t n4) {
  const int b = static_cast<int>(i / n4);
  const float4 v = reinterpret_cast<const float4*>(R.xrow(b))[i % n4];
  if (R.u == nullptr) return v;
  return swiglu4(v, reinterpret_cast<const float4*>(R.urow(b))[i % n4]);
}

__device__ __forceinline__ int64_t xs_index(int64_t i, int64_t n4, int64_t st) {
  const int64_t b = i / n4, t = i % n4, g = t >> 3, c = t & 7;
  return b * st + ((g >> 5) * 8 + c) * 32 + (g & 31);
}

template <int BT>
__device__ __forceinline__ XLoad hold_x_load(const Rows<BT>& R, int nb) {
  XLoad l;
  const int64_t n4 = R.cols / 4, total = nb * n4;
#pragma unroll
  for (int j = 0; j < kXBatch; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (i < total) l.v[j] = x_val4(R, i, n4);
  }
  return l;
}

template <int BT>
__device__ __forceinline__ void hold_x_store(float4* xs, const XLoad& first, const Rows<BT>& R,
                                              int nb) {
  const int64_t n4 = R.cols / 4, total = nb * n4, st = xs_stride(R.cols);
  const int64_t step = static_cast<int64_t>(kXBatch) * blockDim.x;
#pragma unroll
  for (int j = 0; j < kXBatch; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (i < total) xs[xs_index(i, n4, st)] = first.v[j];
  }
  for (int64_t base = step; base < total; base += step) {
    float4 v[kXBatch];
#pragma unroll
    for (int j = 0; j < kXBatch; ++j) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < total) v[j] = x_val4(R, i, n4);
    }
#pragma unroll
    for (int j = 0; j < kXBatch; ++j) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < total) xs[xs_index(i, n4, st)] = v[j];
    }
  }
  __syncthreads();
}

#include "kernels/gpu/matvec_q8.cuh"  // ggml's arithmetic: hold_xq, load_unit_q8, accumulate_q8


template <int BT>
__device__ __forceinline__ void write_rows(float (&acc)[BT], const Rows<BT>& R, int64_t r, int lane) {
#pragma unroll
  for (int b = 0; b < BT; ++b) {
    const float v = warp_sum(acc[b]);
    if (lane == 0 && b < R.nb) R.yrow(b)[r] = v;
    acc[b] = 0.f;
  }
}

// Rows r and r + 1 of accumulate_q8_pair: each half warp's sum in warp_sum's order. warp_sum's
// first step adds the idle upper lanes' +0 to every partial sum (so a -0 becomes +0); the + 0.f
// below is that step.
__device__ __forceinline__ void write_pair(float (&acc)[1], const Rows<1>& R, int64_t r, int lane) {
  float v = acc[0] + 0.f;
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += gpuShflXor(v, o);
  if ((lane & 15) == 0) R.yrow(0)[r + (lane >> 4)] = v;
  acc[0] = 0.f;
}

#include "kernels/gpu/matvec_bulk.cuh"  // matvec_bulk: whole rows through the bulk-copy engine

// acc[b] += dot(w, x_b[32g ... 32g + 31]) for the unit g whose weights w holds: the one float32
// expression every float path of the matvec core uses, so they give the same bits.
template <int F, int BT, bool XS, bool RX>
__device__ __forceinline__ void dot_unit(const float (&w)[32], int64_t g, const Rows<BT>& R,
                                         float (&acc)[BT]) {
#pragma unroll
  for (int b = 0; b < BT; ++b) {
    if (b < R.nb) {
      const float4* xv = XS ? R.xs + b * R.xs_stride + (g >> 5) * 256 + (g & 31)
                            : reinterpret_cast<const float4*>(R.xrow(b) + 32 * g);
      constexpr int step = XS ? 32 : 1;
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float4 v = xv[i * step];
        if (RX) {  // ggml: activations of an F16 / BF16 product are rounded to the weights' type
          v = F == kF16 ? make_float4(round_half(v.x), round_half(v.y), round_half(v.z), round_half(v.w))
                        : make_float4(round_bf16(v.x), round_bf16(v.y), round_bf16(v.z), round_bf16(v.w));
        }
        s += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
      }
      acc[b] += s;
    }
  }
}

// acc[b] += dot(units [0, nunits) starting at p (k-block aligned), x_b[k0 + 32u ...]); XS: x_b is
// read from the held rows R.xs, else from global memory (the same values, so the same bits);
// RX: x_b is first rounded to F16 / BF16 (ggml's arithmetic for such weights). The row's
// unit g goes to lane g % 32, and each lane takes its units in increasing order, so a row's float32
// order does not depend on how the row was cut into windows (nor on the tier, the address or the
// grid).
template <int F, int BT, bool XS, bool RX>
__device__ __forceinline__ void accumulate(const uint8_t* p, int nunits, int64_t k0,
                                           const Rows<BT>& R, float (&acc)[BT], int lane) {
  using T = Traits<F>;
  for (int u = (lane - static_cast<int>((k0 >> 5) & 31)) & 31; u < nunits; u += 32) {
    float w[32];
    unit_weights<F>(p + (u / T::kUpk) * T::kKbb, u % T::kUpk, w);
    dot_unit<F, BT, XS, RX>(w, (k0 >> 5) + u, R, acc);
  }
}

// Float32 weights with rows longer than a window (a MoE router: 256 rows of 8 KiB): each lane
// reads its own units (lane g % 32 owns unit g, as in the windowed path) straight from memory,
// two units (256 bytes) in flight at a time, instead of streaming each row through the warp's
// shared-memory slot in four windows one after another. The same units in the same order through
// dot_unit: the bits of the windowed path.
template <int BT, bool XS>
__device__ __forceinline__ void matvec_f32_rows(const uint8_t* base, const Rows<BT>& R, int64_t rows,
                                                int64_t cols, int lane, int64_t gwarp, int64_t nwarps) {
  const int64_t nunits = cols / 32, rb = cols * 4;  // rb: a multiple of 128 bytes
  const bool aligned = (reinterpret_cast<uintptr_t>(base) & 15) == 0;
  auto load = [&](const uint8_t* kb, float (&w)[32]) {
    if (aligned) {
      const float4* q = reinterpret_cast<const float4*>(kb);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 v = q[i];
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
      }
    } else {
      unit_weights<kF32>(kb, 0, w);
    }
  };
  float acc[BT];
#pragma unroll
  for (int b = 0; b < BT; ++b) acc[b] = 0.f;
  for (int64_t r = gwarp; r < rows; r += nwarps) {
    const uint8_t* row = base + r * rb;
    for (int64_t u = lane; u < nunits; u += 64) {
      float w0[32], w1[32];
      const bool two = u + 32 < nunits;
      load(row + 128 * u, w0);
      if (two) load(row + 128 * (u + 32), w1);
      dot_unit<kF32, BT, XS, false>(w0, u, R, acc);
      if (two) dot_unit<kF32, BT, XS, false>(w1, u + 32, R, acc);
    }
    write_rows<BT>(acc, R, r, lane);
  }
}

__device__ __forceinline__ uintptr_t floor16(uintptr_t a) { return a & ~uintptr_t{15}; }
__device__ __forceinline__ uintptr_t ceil16(uintptr_t a) { return (a + 15) & ~uintptr_t{15}; }

// The warps of the grid's x dimension compute rows [0, rows) of the matrix at base.
//   * Runs: a warp streams a run of consecutive rows in order (as many short rows as fill about
//     one window, or one long row). Runs go round-robin over the grid's warps, so the grid sweeps
//     the matrix front to back.
//   * Windows: a run is read in windows of up to 2 KiB, of about equal size, whose ends fall on
//     128-byte boundaries (the first one starts at the 16-byte boundary below the run, the last
//     ends at the 16-byte boundary above it), so inside a run no cache line
//     is requested twice or in part; a k-block cut by a window's end is carried to the front room
//     of the warp's slot, before the next window's bytes. Only the line a run shares with the
//     next is read by two warps.
//   * The next window (of this run or of the warp's next run) is loaded into registers before
//     the warp computes on the current one.
// XM, how a kernel reads activations: 0 float32 from global memory, 1 float32 held in shared
// memory (hold_x_load / hold_x_store), 2 ggml's arithmetic over quantized held rows (hold_xq; quantized formats),
// 3 ggml's arithmetic for float formats (float32 held rows, rounded for F16 / BF16).
// pro(R), the prologue, is called once by every thread of the block (it may hold the block's
// activation rows, with a barrier): after the warp's first window is requested, so that window's
// bytes are on their way while the activations are read and quantized.
// A16 (Q4_K / Q5_K under ggml's arithmetic): base is 16-byte aligned, so is every k-block, in
// memory and in the window (lds_32b).
// MR: every byte read is also written to base + R.mirror + its offset (the expert cache's fill;
// base and the destination 16-byte aligned, the matrix a multiple of 16 bytes).
template <int F, int BT, int XM, class Pro, bool A16 = false, bool MR = false>
__device__ __forceinline__ void matvec(const uint8_t* base, Rows<BT>& R, int64_t rows, int64_t cols,
                       uint4* slot, int lane, int64_t gwarp, int64_t nwarps, const Pro& pro) {
  using T = Traits<F>;
#if JAXVT_BULK_DEVICE
  // Block-uniform: the stage size is the launch's, the shape and the format the matrix's.
  if constexpr (XM == 2 && !MR) {
    if (bulk_fits(R.bulk, cols / T::kKbe * T::kKbb)) {
      const uint32_t wpb = blockDim.x >> 5;  // (32-bit: a 64-bit division is a called routine)
      matvec_bulk<F, BT, A16>(base, R, rows, cols, static_cast<uint32_t>(gwarp) / wpb,
                              static_cast<uint32_t>(nwarps) / wpb, pro);
      return;
    }
  }
#endif
  if constexpr (F == kF32) {
    if (cols * 4 > kWin) {
      if constexpr (MR) {  // these rows are not windowed: the warp copies its rows first
        const int64_t n16 = cols / 4;
        for (int64_t r = gwarp; r < rows; r += nwarps) {
          const uint4* src = reinterpret_cast<const uint4*>(base) + r * n16;
          uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<uintptr_t>(src) + R.mirror);
          for (int64_t i = lane; i < n16; i += 32) dst[i] = src[i];
        }
      }
      pro(R);
      matvec_f32_rows<BT, XM == 1 || XM == 3>(base, R, rows, cols, lane, gwarp, nwarps);
      return;
    }
  }
  const int64_t nkb = cols / T::kKbe, rb = nkb * T::kKbb;
  int64_t rpr = rb >= kWin ? 1 : kWin / rb;  // rows per run
  const int64_t spread = rows / nwarps;      // small matrices: every warp gets a run
  if (rpr > spread) rpr = spread > 1 ? spread : 1;
  const int64_t nruns = (rows + rpr - 1) / rpr;
  if (gwarp >= nruns) {
    pro(R);
    return;
  }
  uint8_t* const buf = reinterpret_cast<uint8_t*>(slot + kPreU4);
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(base);
  auto run_start = [&](int64_t q) { return b0 + static_cast<uintptr_t>(q * rpr * rb); };
  auto run_end = [&](int64_t q) {
    const int64_t r1 = (q + 1) * rpr;
    return b0 + static_cast<uintptr_t>((r1 < rows ? r1 : rows) * rb);
  };
  // A run of B bytes is cut into n = ceil(B / kStep) windows of about B / n bytes each, at
  // 128-byte boundaries (so each holds at most kStep + 143 <= kWin bytes): no short last window
  // whose load would sit alone in flight while the warp computes on a full one.
  constexpr int64_t kStep = kWin - 144;
  auto cut = [&](int64_t q, int64_t i, int64_t n) {  // start of window i of run q (i == n: end)
    const uintptr_t s = run_start(q), e = run_end(q);
    if (i == 0) return floor16(s);
    if (i == n) return ceil16(e);
    const uintptr_t len = e - s;  // 32-bit division where it cannot overflow (a 64-bit one is ~70 instructions)
    const uintptr_t part = len < (uintptr_t{1} << 26)
        ? static_cast<uintptr_t>(static_cast<uint32_t>(len) * static_cast<uint32_t>(i) / static_cast<uint32_t>(n))
        : len * static_cast<uintptr_t>(i) / static_cast<uintptr_t>(n);
    return (s + part) & ~uintptr_t{127};
  };
  auto windows = [&](int64_t q) {
    return static_cast<int64_t>((run_end(q) - run_start(q) + kStep - 1) / kStep);
  };
  float acc[BT];
#pragma unroll
  for (int b = 0; b < BT; ++b) acc[b] = 0.f;
  // The warp's windows in order: the windows of run q (wi of nw), then those of run q + nwarps.
  struct Win {
    uintptr_t wa, we, rend;  // the window's bytes and its run's end
    int64_t q;               // its run
    bool new_run;            // the first window of its run
  };
  int64_t q = gwarp, wi = 0, nw = windows(q);  // the last window issued
  auto next = [&](Win& w) -> bool {  // the window after the last one issued
    if (wi + 1 < nw) {
      ++wi;
      w = Win{cut(q, wi, nw), cut(q, wi + 1, nw), run_end(q), q, false};
      return true;
    }
    if (q + nwarps >= nruns) return false;
    q += nwarps;
    wi = 0;
    nw = windows(q);
    w = Win{cut(q, 0, nw), cut(q, 1, nw), run_end(q), q, true};
    return true;
  };
  auto issue_win = [&](Pending& p, const Win& w) {
    issue(p, reinterpret_cast<const uint8_t*>(w.wa), static_cast<int64_t>(w.we - w.wa), lane);
  };
  // kMvDepth windows in flight (each in its own registers): the window after the next is
  // requested as soon as the current one is in shared memory.
  Pending pa, pb;
  Win wa_ = Win{cut(q, 0, nw), cut(q, 1, nw), run_end(q), q, true}, wb_ = wa_;
  issue_win(pa, wa_);
  int inflight = 1;
  if constexpr (kMvDepth > 1) {
    if (next(wb_)) {
      issue_win(pb, wb_);
      ++inflight;
    }
  }
  pro(R);
  uintptr_t cpos = 0;     // next unconsumed k-block of the run
  uintptr_t prev_wa = 0;  // where the bytes now in `buf` start
  int64_t r = 0, kb = 0;  // its row and k-block
  // Commits the window held in p (w), requests the next one into p, computes.
  auto step = [&](Pending& p, Win& w) -> bool {
    const Win cur = w;
    if (cur.new_run) {  // nothing to carry
      cpos = run_start(cur.q);
      r = cur.q * rpr;
      kb = 0;
    } else {
      // Carry the partial k-block [cpos, wa) of the previous window to just before `buf`.
      const int carry = static_cast<int>(cur.wa > cpos ? cur.wa - cpos : 0);
      if (carry) {
        const uint8_t* src = buf + (cpos - prev_wa);
        uint8_t* dst = buf - carry;
        for (int i = lane; i < carry; i += 32) dst[i] = src[i];
        gpuSyncWarp();
      }
    }
    commit(reinterpret_cast<uint4*>(buf), p, lane);
    if constexpr (MR) mirror_store(reinterpret_cast<uint4*>(cur.wa + R.mirror), p, lane);
    if (next(w)) issue_win(p, w);
    else --inflight;
    // Whole k-blocks of the current window, row by row.
    const uintptr_t lim = cur.we < cur.rend ? cur.we : cur.rend;
    int64_t avail = static_cast<int64_t>((lim - cpos) / T::kKbb);
    const uint8_t* ptr = buf + static_cast<int64_t>(cpos - cur.wa);  // may be in the front room
    while (avail > 0) {
      if constexpr (XM == 2 && BT == 1) {  // rows of at most 16 units: two at a time
        if (nkb * T::kUpk <= 16 && kb == 0 && avail >= 2 * nkb) {
          accumulate_q8_pair<F, A16>(ptr, static_cast<int>(nkb * T::kUpk), nkb * T::kKbb, R, acc, lane);
          write_pair(acc, R, r, lane);
          ptr += 2 * nkb * T::kKbb;
          cpos += static_cast<uintptr_t>(2 * nkb * T::kKbb);
          avail -= 2 * nkb;
          r += 2;
          continue;
        }
      }
      const int64_t n = nkb - kb < avail ? nkb - kb : avail;
      if constexpr (XM == 2)
        accumulate_q8<F, A16, BT>(ptr, static_cast<int>(n * T::kUpk), kb * T::kKbe, R, acc, lane);
      else
        accumulate<F, BT, XM == 1 || XM == 3, XM == 3 && (F == kF16 || F == kBF16)>(
            ptr, static_cast<int>(n * T::kUpk), kb * T::kKbe, R, acc, lane);
      ptr += n * T::kKbb;
      cpos += static_cast<uintptr_t>(n * T::kKbb);
      avail -= n;
      kb += n;
      if (kb == nkb) {
        write_rows<BT>(acc, R, r, lane);
        ++r;
        kb = 0;
      }
    }
    gpuSyncWarp();  // every lane is done with the slot before the next carry and commit
    prev_wa = cur.wa;
    return inflight > 0;
  };
  if constexpr (kMvDepth > 1) {
    for (;;) {  // the windows alternate between pa and pb (no register moves of pending loads)
      if (!step(pa, wa_)) break;
      if (!step(pb, wb_)) break;
    }
  } else {
    while (step(pa, wa_)) {
    }
  }
}

// No prologue: the caller holds the activations itself.
struct NoPrologue {
  template <int BT>
  __device__ __forceinline__ void operator()(Rows<BT>&) const {}
};

template <int BT, int XM, class Pro = NoPrologue, bool MR = false>
__device__ __forceinline__ void matvec_fmt(int fmt, const uint8_t* base, Rows<BT>& R, int64_t rows,
                           int64_t cols, uint4* slot, int lane, int64_t gwarp, int64_t nwarps,
                           const Pro& pro = Pro()) {
  // ggml's arithmetic takes float formats' activations as held float32 rows (XM 3).
  constexpr int XF = XM == 2 ? 3 : XM;
  const bool a16 = (reinterpret_cast<uintptr_t>(base) & 15) == 0;
#define JV_CASE(F, X) \
  case F: matvec<F, BT, X, Pro, false, MR>(base, R, rows, cols, slot, lane, gwarp, nwarps, pro); return;
#define JV_CASE16(F)                                                                         \
  case F:                                                                                    \
    if constexpr (XM == 2) {                                                                 \
      if (a16) {                                                                             \
        matvec<F, BT, XM, Pro, true, MR>(base, R, rows, cols, slot, lane, gwarp, nwarps, pro); \
        return;                                                                              \
      }                                                                                      \
    }                                                                                        \
    matvec<F, BT, XM, Pro, false, MR>(base, R, rows, cols, slot, lane, gwarp, nwarps, pro);  \
    return;
  switch (fmt) {
    JV_CASE(kF32, XF) JV_CASE(kF16, XF) JV_CASE(kBF16, XF) JV_CASE(kQ4_0, XM) JV_CASE(kQ4_1, XM)
    JV_CASE(kQ8_0, XM) JV_CASE16(kQ4_K) JV_CASE16(kQ5_K) JV_CASE(kQ6_K, XM)
    default: break;
  }
#undef JV_CASE
#undef JV_CASE16
  // Unsupported format (the Python side validates formats, so only corrupt data gets here).
  for (int64_t r = gwarp * 32 + lane; r < rows; r += nwarps * 32)
    for (int b = 0; b < R.nb; ++b) R.yrow(b)[r] = __int_as_float(0x7fc00000);
}

#include "kernels/gpu/matvec_setup.cuh"  // layer_ref, dense_rows, HoldRows, use_bulk

#include "kernels/gpu/matvec_launch.cuh"  // resident_blocks, smem_optin, allow_dyn_smem, blocks_for

#endif  // JAXVT_FFI_CSRC_MATVEC_CUH_
