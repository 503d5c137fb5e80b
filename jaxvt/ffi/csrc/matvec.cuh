// The matvec core shared by jaxvt's device kernels (kernels_gpu.cu, kernels_gpu_experts.cu; CUDA,
// and HIP via hipcc -x hip): fused dequantize-and-dot over GGUF blocks that read each weight byte
// once per call, from HBM or in place from pinned host memory. Included inside each file's
// anonymous namespace.
//
// Streaming design (one logical warp of 32 lanes owns whole output rows):
//   * A warp takes a task of consecutive rows (as many as fit in a 2 KiB chunk) or, when one row
//     is larger, one row in chunks of whole k-blocks. Rows of a layer are contiguous, so a task's
//     bytes are one contiguous range.
//   * The warp copies the range into its own shared-memory slot with coalesced 16-byte loads
//     (lane i loads uint4 i, i+32, ...; four loads per lane issued back to back), starting at the
//     16-byte boundary below the range so any block alignment works. Each weight byte crosses the
//     bus once; shared memory then serves the unaligned, per-block reads of the dequantizer.
//   * Lanes dequantize 32-element units (formats.h) and dot them with up to BT activation rows
//     (BT in {1, 4, 16}); the warp reduces with shuffles in a fixed order, so results do not depend
//     on timing, grid size or tier: a host-tier layer gives the bits its device-tier copy gives.
//   * Many warps per SM (8 per block, grid sized from the SM count) keep enough loads in flight to
//     cover PCIe latency; the grid is a grid-stride loop, so its size never depends on the format.
// Both tiers take the same path (reading device-tier layers directly from HBM, without the
// staging, measured no faster on the H200: docs/BENCHMARKS.md), so both give the same bits.
// Accumulation is float32 throughout. Batches above 16 rows re-stream the weights once per group
// of 16 rows (grid.y); large-batch prefill should stage weights with qdequant instead.
#ifndef JAXVT_FFI_CSRC_MATVEC_CUH_
#define JAXVT_FFI_CSRC_MATVEC_CUH_

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLaneU4 = 4;                    // uint4 loads per lane per chunk
constexpr int kChunkU4 = 32 * kLaneU4;        // 128 uint4 = 2 KiB per warp
constexpr int kCap = kChunkU4 * 16 - 32;      // usable bytes (room for alignment slop)

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
  __device__ __forceinline__ const float* xrow(int b) const {
    const int64_t r = dense ? b0 + b : (x_per_slot ? slot[b] : slot[b] / k);
    return x + r * cols;
  }
  __device__ __forceinline__ float* yrow(int b) const { return y + (dense ? b0 + b : slot[b]) * rows; }
};

// acc[b] += dot(units [0, nunits) starting at p (k-block aligned), x_b[k0 + 32u ...]): lane l takes
// units l, l + 32, ... in order (the float32 order every tier and grid size shares).
template <int F, int BT>
__device__ __forceinline__ void accumulate(const uint8_t* p, int nunits, int64_t k0,
                                           const Rows<BT>& R, float (&acc)[BT], int lane) {
  using T = Traits<F>;
  for (int u = lane; u < nunits; u += 32) {
    float w[32];
    unit_weights<F>(p + (u / T::kUpk) * T::kKbb, u % T::kUpk, w);
    const int64_t k = k0 + 32 * static_cast<int64_t>(u);
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      if (b < R.nb) {
        const float4* xv = reinterpret_cast<const float4*>(R.xrow(b) + k);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 v = xv[i];
          s += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
        }
        acc[b] += s;
      }
    }
  }
}

template <int BT>
__device__ __forceinline__ void write_rows(float (&acc)[BT], const Rows<BT>& R, int64_t r, int lane) {
#pragma unroll
  for (int b = 0; b < BT; ++b) {
    const float v = warp_sum(acc[b]);
    if (lane == 0 && b < R.nb) R.yrow(b)[r] = v;
    acc[b] = 0.f;
  }
}

// The warps of the grid's x dimension compute rows [0, rows) of the matrix at base. Each warp
// walks a sequence of pieces (several whole rows, or one chunk of one long row), loading piece
// p+1 into registers before it computes piece p.
template <int F, int BT>
__device__ void matvec(const uint8_t* base, const Rows<BT>& R, int64_t rows, int64_t cols,
                       uint4* slot, int lane, int64_t gwarp, int64_t nwarps) {
  using T = Traits<F>;
  const int64_t nkb = cols / T::kKbe, rb = nkb * T::kKbb;
  const bool whole = rb <= kCap;
  // Rows per piece: as many as fit, but no more than spreads the rows over every warp (small
  // matrices then have all their bytes in flight at once).
  int64_t rpt = whole ? kCap / rb : 1;
  const int64_t spread = rows / nwarps;
  if (rpt > spread) rpt = spread > 1 ? spread : 1;
  // Long rows: the fewest pieces that fit, of equal size (no short tail piece).
  const int64_t nch = whole ? 1 : (nkb + kCap / T::kKbb - 1) / (kCap / T::kKbb);
  const int64_t kch = (nkb + nch - 1) / nch;             // k-blocks per piece
  const int64_t ngroups = (rows + rpt - 1) / rpt;
  if (gwarp >= ngroups) return;
  const int64_t npieces = ((ngroups - 1 - gwarp) / nwarps + 1) * nch;
  // Piece p of this warp: row group gwarp + (p / nch) * nwarps, k-chunk p % nch.
  auto where = [&](int64_t p, int64_t* r0, int64_t* nr, int64_t* kb0, int64_t* nk) {
    *r0 = (gwarp + (p / nch) * nwarps) * rpt;
    *nr = rows - *r0 < rpt ? rows - *r0 : rpt;
    *kb0 = (p % nch) * kch;
    *nk = nkb - *kb0 < kch ? nkb - *kb0 : kch;
  };
  float acc[BT];
#pragma unroll
  for (int b = 0; b < BT; ++b) acc[b] = 0.f;
  Pending pend;
  {
    int64_t r0, nr, kb0, nk;
    where(0, &r0, &nr, &kb0, &nk);
    issue(pend, base + r0 * rb + kb0 * T::kKbb, whole ? nr * rb : nk * T::kKbb, lane);
  }
  for (int64_t p = 0; p < npieces; ++p) {
    int64_t r0, nr, kb0, nk;
    where(p, &r0, &nr, &kb0, &nk);
    const uint8_t* ptr = commit(slot, pend, lane);
    if (p + 1 < npieces) {
      int64_t r1, nr1, kb1, nk1;
      where(p + 1, &r1, &nr1, &kb1, &nk1);
      issue(pend, base + r1 * rb + kb1 * T::kKbb, whole ? nr1 * rb : nk1 * T::kKbb, lane);
    }
    if (whole) {
      for (int64_t i = 0; i < nr; ++i) {
        accumulate<F, BT>(ptr + i * rb, static_cast<int>(nkb * T::kUpk), 0, R, acc, lane);
        write_rows<BT>(acc, R, r0 + i, lane);
      }
    } else {
      accumulate<F, BT>(ptr, static_cast<int>(nk * T::kUpk), kb0 * T::kKbe, R, acc, lane);
      if (kb0 + nk == nkb) write_rows<BT>(acc, R, r0, lane);
    }
    gpuSyncWarp();  // every lane is done with the slot before the next commit overwrites it
  }
}

template <int BT>
__device__ void matvec_fmt(int fmt, const uint8_t* base, const Rows<BT>& R, int64_t rows,
                           int64_t cols, uint4* slot, int lane, int64_t gwarp, int64_t nwarps) {
#define JV_CASE(F) \
  case F: matvec<F, BT>(base, R, rows, cols, slot, lane, gwarp, nwarps); return;
  switch (fmt) {
    JV_CASE(kF32) JV_CASE(kF16) JV_CASE(kBF16) JV_CASE(kQ4_0) JV_CASE(kQ4_1) JV_CASE(kQ8_0)
    JV_CASE(kQ4_K) JV_CASE(kQ5_K) JV_CASE(kQ6_K)
    default: break;
  }
#undef JV_CASE
  // Unsupported format (the Python side validates formats, so only corrupt data gets here).
  for (int64_t r = gwarp * 32 + lane; r < rows; r += nwarps * 32)
    for (int b = 0; b < R.nb; ++b) R.yrow(b)[r] = __int_as_float(0x7fc00000);
}

__device__ __forceinline__ LayerRef layer_ref(const WeightArgs& w) {
  return resolve_layer(w.data, w.stride, w.table, w.fmts, w.n_layers, *w.layer);
}

__device__ __forceinline__ int clamp_id(int32_t v, int64_t n) {
  return v < 0 ? 0 : (v >= n ? static_cast<int>(n - 1) : v);
}

// Blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) resident at once
// on the device: a grid of this size runs in one wave, each warp looping over its share of the
// pieces (no partial last wave).
template <typename K>
int64_t resident_blocks(K kernel, int threads = kThreads, size_t smem = 0) {
  int per_sm = 0;
  if (gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != gpuSuccess ||
      per_sm < 1) {
    (void)gpuGetLastError();
    per_sm = 1;
  }
  return static_cast<int64_t>(per_sm) * sm_count();
}

inline int64_t blocks_for(int64_t warps_wanted, int64_t cap_blocks, int warps_per_block = kWarps) {
  int64_t b = (warps_wanted + warps_per_block - 1) / warps_per_block;
  if (b > cap_blocks) b = cap_blocks;
  return b < 1 ? 1 : b;
}

#endif  // JAXVT_FFI_CSRC_MATVEC_CUH_
