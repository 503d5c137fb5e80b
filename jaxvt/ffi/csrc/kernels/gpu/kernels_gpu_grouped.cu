// The grouped routed-experts product (qmatmul_grouped; CUDA, and HIP via hipcc -x hip): token slots
// sorted by expert (on the device, by the caller), then one launch over every expert of the layer.
//
//   y[order[p], r] = sum_k bf16(W_e[r, k]) * x[order[p] / x_div, k],  p in [offsets[e], offsets[e+1])
//
// x arrives as bf16; products are exact in float32 (two 8-bit significands) and accumulate in
// float32. A block computes one tile: up to kBM sorted slots of one expert times kBN rows of that
// expert's matrix. It streams those rows' GGUF bytes k-step by k-step (coalesced 16-byte loads into
// shared memory, from HBM or in place from pinned host memory, exactly as the layer's tier says),
// dequantizes them to bf16 in shared memory and multiplies on tensor cores (nvcuda::wmma bf16
// 16x16x16, float accumulation, sm_80+). So each routed expert's bytes are read once per tile of
// kBM slots, and experts no slot is routed to are never touched. The HIP build (and CUDA below
// sm_80) runs the same tile loop with a plain float32 FMA product instead of wmma.
//
// Tiles are found on the device: expert e has ceil(count_e / kBM) tiles; block y = i takes the
// i-th tile in expert order (a block-wide prefix sum over the per-expert tile counts), so the
// grid's size depends only on static shapes (slots, experts). Positions >= offsets[E] are routed
// nowhere: the grid's last column of blocks writes their output rows as 0.
#include <cstdint>

#include "common/formats.h"
#include "kernels/gpu/bf16.cuh"
#include "kernels/gpu/kernels_gpu.h"

#if defined(JAXVT_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#include <cuda_bf16.h>
#include <mma.h>
#define JV_WMMA 1
#endif

namespace jaxvt::gpu {
namespace {

constexpr int kBM = 32;            // sorted slots per tile
constexpr int kBN = 64;            // weight rows per tile
constexpr int kThr = 128;          // threads per block (4 warps)
constexpr int kSub = 128;          // k elements per shared-memory sub-step (4 units)
constexpr int kLdAB = kSub + 8;    // bf16 row pitch of the A / B tiles (a multiple of 8)
constexpr int kLdC = kBN + 4;      // float row pitch of the output tile (a multiple of 4)
constexpr int kRawU4 = 19;         // uint4 per weight row per k-step: <= 272 bytes + alignment
static_assert(kThr == 2 * kBN && kBM * kSub / 8 == 4 * kThr, "the tile loops assume these");

// Per format: the k-step (elements whose bytes are staged per row at once) and its sizes.
template <int F>
struct Step {
  static constexpr int kKbe = (F == kQ4_K || F == kQ5_K || F == kQ6_K) ? 256 : 32;
  static constexpr int kKbb = F == kF32 ? 128 : F == kF16 ? 64 : F == kBF16 ? 64 : F == kQ4_0 ? 18
                            : F == kQ4_1 ? 20 : F == kQ8_0 ? 34 : F == kQ4_K ? 144 : F == kQ5_K ? 176
                            : 210;
  static constexpr int kUpk = kKbe / 32;  // units per k-block
  static constexpr int kElems = F == kF32 ? 64 : (F == kF16 || F == kBF16) ? 128 : 256;
  static constexpr int kBlocks = kElems / kKbe;
  static_assert(kBlocks * kKbb + 30 <= kRawU4 * 16, "a k-step's row bytes fit the raw stage");
};

struct alignas(32) Smem {
  uint16_t a[kBM][kLdAB];   // activations (bf16 bits), slots x k
  uint16_t b[kBN][kLdAB];   // weights (bf16 bits), rows x k: B in column-major order
  union {
    uint4 raw[kBN][kRawU4];  // the k-step's GGUF bytes, one run per weight row
    float c[kBM][kLdC];      // the finished tile, before it is written out
  } u;
  int32_t slot[kBM];        // output row of each tile slot
  int32_t xrow[kBM];        // x row of each tile slot
  int32_t scan[kThr];
  int32_t tile[3];          // expert, first sorted position, slots (expert -1: no tile)
};

__device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ int32_t count_of(const int32_t* offsets, int64_t e, int64_t slots) {
  int64_t lo = offsets[e], hi = offsets[e + 1];
  lo = lo < 0 ? 0 : (lo > slots ? slots : lo);
  hi = hi < lo ? lo : (hi > slots ? slots : hi);
  return static_cast<int32_t>(hi - lo);
}

// Block-wide: which (expert, first position, slots) tile number `i` is; expert -1 when there are
// fewer tiles. Thread t owns experts [t*per, (t+1)*per); an inclusive prefix sum over the threads'
// tile counts finds the owner of tile i.
__device__ void find_tile(const int32_t* offsets, int64_t experts, int64_t slots, int64_t i,
                          Smem& s) {
  const int t = threadIdx.x;
  const int64_t per = ceil_div(experts, kThr);
  const int64_t e0 = t * per < experts ? t * per : experts;
  const int64_t e1 = e0 + per < experts ? e0 + per : experts;
  int32_t mine = 0;
  for (int64_t e = e0; e < e1; ++e)
    mine += static_cast<int32_t>(ceil_div(count_of(offsets, e, slots), kBM));
  s.scan[t] = mine;
  if (t == 0) s.tile[0] = -1;
  __syncthreads();
  for (int d = 1; d < kThr; d <<= 1) {
    const int32_t v = t >= d ? s.scan[t - d] : 0;
    __syncthreads();
    s.scan[t] += v;
    __syncthreads();
  }
  int64_t start = s.scan[t] - mine;
  if (i >= start && i < start + mine) {
    for (int64_t e = e0; e < e1; ++e) {
      const int32_t n = count_of(offsets, e, slots);
      const int64_t nt = ceil_div(n, kBM);
      if (i < start + nt) {
        const int64_t j = i - start;
        int64_t p0 = offsets[e];
        p0 = p0 < 0 ? 0 : p0;
        s.tile[0] = static_cast<int32_t>(e);
        s.tile[1] = static_cast<int32_t>(p0 + j * kBM);
        s.tile[2] = static_cast<int32_t>(n - j * kBM < kBM ? n - j * kBM : kBM);
        break;
      }
      start += nt;
    }
  }
  __syncthreads();
}

// acc (this thread's share of the kBM x kBN tile) += A[:, 0:kSub] . B[:, 0:kSub]^T.
#if defined(JV_WMMA)
using FragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16,
                                     nvcuda::wmma::row_major>;
using FragB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16,
                                     nvcuda::wmma::col_major>;
using FragC = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;
struct Acc {
  FragC f[2];  // warp w: slots [16 (w & 1), +16) x rows [32 (w >> 1) + 16 j, +16), j = 0, 1
  __device__ void zero() {
    nvcuda::wmma::fill_fragment(f[0], 0.f);
    nvcuda::wmma::fill_fragment(f[1], 0.f);
  }
  __device__ void mma(const Smem& s) {
    const int w = threadIdx.x >> 5, mi = w & 1, nj = w >> 1;
    FragA fa;
    FragB fb;
#pragma unroll
    for (int kk = 0; kk < kSub; kk += 16) {
      nvcuda::wmma::load_matrix_sync(
          fa, reinterpret_cast<const __nv_bfloat16*>(&s.a[16 * mi][kk]), kLdAB);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        nvcuda::wmma::load_matrix_sync(
            fb, reinterpret_cast<const __nv_bfloat16*>(&s.b[32 * nj + 16 * j][kk]), kLdAB);
        nvcuda::wmma::mma_sync(f[j], fa, fb, f[j]);
      }
    }
  }
  __device__ void store(Smem& s) {
    const int w = threadIdx.x >> 5, mi = w & 1, nj = w >> 1;
#pragma unroll
    for (int j = 0; j < 2; ++j)
      nvcuda::wmma::store_matrix_sync(&s.u.c[16 * mi][32 * nj + 16 * j], f[j], kLdC,
                                      nvcuda::wmma::mem_row_major);
  }
};
#else
struct Acc {
  // Thread t: slot t / 4, rows (t % 4) + 4 j, j < 16; float32 FMAs in k order.
  float f[kBN / 4];
  __device__ void zero() {
#pragma unroll
    for (int j = 0; j < kBN / 4; ++j) f[j] = 0.f;
  }
  __device__ void mma(const Smem& s) {
    const int m = threadIdx.x >> 2, n0 = threadIdx.x & 3;
    for (int kk = 0; kk < kSub; ++kk) {
      const float a = bf16_to_float(s.a[m][kk]);
#pragma unroll
      for (int j = 0; j < kBN / 4; ++j) f[j] = fmaf(a, bf16_to_float(s.b[n0 + 4 * j][kk]), f[j]);
    }
  }
  __device__ void store(Smem& s) {
    const int m = threadIdx.x >> 2, n0 = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < kBN / 4; ++j) s.u.c[m][n0 + 4 * j] = f[j];
  }
};
#endif

// The tile's product: `base` is the expert's matrix (rows x cols, format F), n0 its first row here.
template <int F>
__device__ void tile_product(const uint8_t* base, const uint16_t* x, int64_t rows, int64_t cols,
                             int64_t n0, int nslots, Smem& s) {
  using S = Step<F>;
  const int t = threadIdx.x;
  const int64_t rb = cols / S::kKbe * S::kKbb;
  const int nr = static_cast<int>(rows - n0 < kBN ? rows - n0 : kBN);
  Acc acc;
  acc.zero();
  for (int64_t k0 = 0; k0 < cols; k0 += S::kElems) {
    const int64_t left = (cols - k0) / S::kKbe;
    const int nb = static_cast<int>(left < S::kBlocks ? left : S::kBlocks);
    const int seg = nb * S::kKbb;
    const int64_t kb0 = k0 / S::kKbe;
    __syncthreads();  // every reader of the previous k-step's raw bytes is done
    // Stage the k-step's bytes of each weight row: [start, start + seg) from the 16-byte
    // boundary below start, in whole uint4 (never past the 16-byte boundary above the end).
    for (int i = t; i < kBN * kRawU4; i += kThr) {
      const int r = i / kRawU4, j = i % kRawU4;
      if (r >= nr) continue;
      const uintptr_t a = reinterpret_cast<uintptr_t>(base + (n0 + r) * rb + kb0 * S::kKbb);
      const uintptr_t lo = a & ~uintptr_t{15}, hi = (a + seg + 15) & ~uintptr_t{15};
      if (j < static_cast<int>((hi - lo) >> 4))
        s.u.raw[r][j] = reinterpret_cast<const uint4*>(lo)[j];
    }
    __syncthreads();
    const int units = nb * S::kUpk;
    for (int u0 = 0; u0 < units; u0 += kSub / 32) {
      // B: thread t dequantizes units u0 + 2 (t & 1) + {0, 1} of weight row t / 2.
      {
        const int r = t >> 1;
        const uint8_t* p = nullptr;
        if (r < nr) {
          const uintptr_t a = reinterpret_cast<uintptr_t>(base + (n0 + r) * rb + kb0 * S::kKbb);
          p = reinterpret_cast<const uint8_t*>(&s.u.raw[r][0]) + (a & 15);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int uu = 2 * (t & 1) + h, u = u0 + uu;
          float wv[32];
          if (p != nullptr && u < units) {
            unit_weights<F>(p + (u / S::kUpk) * S::kKbb, u % S::kUpk, wv);
          } else {
#pragma unroll
            for (int q = 0; q < 32; ++q) wv[q] = 0.f;
          }
          store_bf16x32(&s.b[r][32 * uu], wv);
        }
      }
      // A: slot m's x elements [k0 + 32 u0, + kSub): 16 uint4 per slot, 4 per thread.
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = t + q * kThr, m = i >> 4, j = i & 15;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m < nslots && u0 * 32 + 8 * j < units * 32)
          v = *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(s.xrow[m]) * cols + k0 +
                                              32 * u0 + 8 * j);
        *reinterpret_cast<uint4*>(&s.a[m][8 * j]) = v;
      }
      __syncthreads();
      acc.mma(s);
      __syncthreads();
    }
  }
  __syncthreads();  // the raw stage is done before the union is reused for the output tile
  acc.store(s);
  __syncthreads();
}

__global__ void __launch_bounds__(kThr) qmatmul_grouped_kernel(
    WeightArgs w, const uint16_t* x, int64_t x_div, const int32_t* order, const int32_t* offsets,
    int64_t slots, float* y, int64_t rows, int64_t cols, int64_t experts) {
  __shared__ Smem s;
  const int t = threadIdx.x;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const int nr = static_cast<int>(rows - n0 < kBN ? rows - n0 : kBN);
  auto out_row = [&](int64_t p) {
    const int32_t v = order[p];
    return v < 0 ? int64_t{0} : (v >= slots ? slots - 1 : static_cast<int64_t>(v));
  };
  if (blockIdx.x == gridDim.x - 1) {  // positions routed nowhere: zero rows
    int64_t p0 = offsets[experts];
    p0 = p0 < 0 ? 0 : (p0 > slots ? slots : p0);
    for (int64_t i = t; i < (slots - p0) * kBN; i += kThr) {
      const int64_t p = p0 + i / kBN;
      const int n = static_cast<int>(i % kBN);
      if (n < nr) y[out_row(p) * rows + n0 + n] = 0.f;
    }
    return;
  }
  find_tile(offsets, experts, slots, blockIdx.x, s);
  const int e = s.tile[0];
  if (e < 0) return;  // uniform over the block
  const int64_t p0 = s.tile[1];
  const int nslots = s.tile[2];
  if (t < kBM) {
    const int64_t sl = t < nslots ? out_row(p0 + t) : 0;
    s.slot[t] = static_cast<int32_t>(sl);
    s.xrow[t] = static_cast<int32_t>(sl / x_div);
  }
  const LayerRef L = resolve_layer(w.data, w.stride, w.table, w.fmts, w.n_layers, *w.layer);
  __syncthreads();
  bool ok = true;
  const uint8_t* base = L.base + static_cast<int64_t>(e) * rows * row_bytes(L.fmt, cols);
  switch (L.fmt) {
#define JV_CASE(F) \
  case F: tile_product<F>(base, x, rows, cols, n0, nslots, s); break;
    JV_CASE(kF32) JV_CASE(kF16) JV_CASE(kBF16) JV_CASE(kQ4_0) JV_CASE(kQ4_1) JV_CASE(kQ8_0)
    JV_CASE(kQ4_K) JV_CASE(kQ5_K) JV_CASE(kQ6_K)
#undef JV_CASE
    default: ok = false;  // unsupported format (only corrupt data gets here): NaN rows
  }
  for (int i = t; i < kBM * kBN; i += kThr) {
    const int m = i / kBN, n = i % kBN;
    if (m < nslots && n < nr)
      y[static_cast<int64_t>(s.slot[m]) * rows + n0 + n] =
          ok ? s.u.c[m][n] : __int_as_float(0x7fc00000);
  }
}

}  // namespace

gpuError_t launch_qmatmul_grouped(gpuStream_t s, const WeightArgs& w, const uint16_t* x,
                                  int64_t x_div, const int32_t* order, const int32_t* offsets,
                                  int64_t slots, float* y, int64_t rows, int64_t cols,
                                  int64_t experts) {
  if (slots <= 0 || rows <= 0) return gpuSuccess;
  const int64_t groups = experts > 0 ? experts : 1;
  // grid.x: tiles (every expert's last tile may be partial: at most ceil(slots / kBM) +
  // min(groups, slots) of them), plus one for the positions routed nowhere; grid.y: kBN-row tiles
  // of the matrix. Blocks run x first, so the slot tiles of one expert (or of a dense matrix) read
  // the same weight rows at about the same time, the later ones mostly from L2.
  const int64_t tiles = (slots + kBM - 1) / kBM + (groups < slots ? groups : slots);
  const int64_t ntiles = (rows + kBN - 1) / kBN;
  if (ntiles > 65535) return gpuErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(tiles + 1), static_cast<unsigned>(ntiles));
  qmatmul_grouped_kernel<<<grid, kThr, 0, s>>>(w, x, x_div < 1 ? 1 : x_div, order, offsets, slots,
                                               y, rows, cols, groups);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
