// The fused attention decode step on a GPU (CUDA, and HIP through vendor.h); attn.h has the math,
// kernels_cpu_attn.cc the same phases on the CPU. Two launches on the FFI stream:
//
// 1. split_kernel, one block of kThreads (8 warps) per (split, kv head, row): grid (splits, K, b).
//    Warp w prepares query heads w, w + 8, ... of the kv head's G (RMSNorm, RoPE, the scale) into
//    shared memory; the block whose chunk holds the row's position (split 0 beyond kv_len) also
//    prepares the new key (warp 0) and copies the new value (warp 1) into layer `layer` of the
//    cache stacks, then every thread of the block passes a barrier, which makes those writes
//    visible to the block before it reads its chunk. Scores: warp w takes positions p0 + w,
//    p0 + w + 8, ...; each lane holds D / 32 elements of the key row (consecutive lanes read
//    consecutive addresses) and sums its products with each query head in element order, then a
//    butterfly of shuffles adds the lanes (every lane ends with the same bits). Softmax partials:
//    warp w takes heads w, w + 8, ...: max and sum of exp over the chunk, lane-strided, then the
//    butterfly. Weighted values: thread t owns column t % Dv and heads t / Dv + i (256 / Dv),
//    i = 0, 1, ..., summing over the chunk's positions in order (consecutive threads read a value
//    row's consecutive addresses). Splits beyond the row's visible positions return at once.
// 2. combine_kernel, one block per (query head, row): attn.h's combine per column, in split
//    order, times sigmoid(gate).
// Every sum has an order fixed by D, Dv, G, the chunk and kThreads alone (no atomics), so the
// result does not depend on timing or on the grid. The chunk (jaxvt/ffi/attn.py) keeps a split
// short (16 positions up to a kv_len of 2048), so a decode at a few hundred positions spreads
// over tens of blocks; longer contexts take at most 128 splits (up to a kv_len of 32768) of up
// to 256 positions, a block or two per multiprocessor per kv head.
#include <cstdint>

#include "attn.h"
#include "vendor.h"

namespace jaxvt::gpu {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxDim = static_cast<int>(attn::kMaxDim);
constexpr int kMaxGroup = static_cast<int>(attn::kMaxGroup);
constexpr int kMaxChunk = static_cast<int>(attn::kMaxChunk);
constexpr int kPerLane = kMaxDim / 32;  // key elements a lane holds
static_assert(kThreads >= kMaxDim, "a thread per value column at least");

__device__ __forceinline__ float warp_sum(float s) {
  for (int o = 16; o > 0; o >>= 1) s += gpuShflXor(s, o);
  return s;
}

__device__ __forceinline__ float warp_max(float s) {
  for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, gpuShflXor(s, o));
  return s;
}

// One head of D values by one warp: out = rope(x normed with `norm` when qk_norm) * scale. buf:
// the warp's shared scratch of D floats; out may be shared or global memory (not buf).
__device__ void prepare_head(const attn::Dims& d, const attn::Args& a, const float* x,
                             const float* norm, float pos, float scale, float* buf, float* out,
                             int lane) {
  const int D = static_cast<int>(d.D);
  float ss = 0.0f;
  for (int i = lane; i < D; i += 32) {
    const float xi = x[i];
    buf[i] = xi;
    ss += xi * xi;
  }
  if (d.qk_norm) {
    const float rs = attn::rms_factor(d, warp_sum(ss));
    for (int i = lane; i < D; i += 32) buf[i] = buf[i] * rs * norm[i];
  }
  gpuSyncWarp();
  for (int i = lane; i < D; i += 32) out[i] = attn::rope_at(d, a.inv_freq, buf, i, pos) * scale;
  gpuSyncWarp();
}

__global__ void __launch_bounds__(kThreads) split_kernel(attn::Dims d, attn::Args a) {
  __shared__ float qs[kMaxGroup * kMaxDim];    // [G][D]: prepared query heads
  __shared__ float sc[kMaxGroup * kMaxChunk];  // [G][chunk]: scores, then exp(score - m)
  __shared__ float buf[kWarps][kMaxDim];       // each warp's scratch
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t j = blockIdx.x, kh = blockIdx.y, r = blockIdx.z;
  const int D = static_cast<int>(d.D), Dv = static_cast<int>(d.Dv), G = static_cast<int>(d.G);
  const int chunk = static_cast<int>(d.chunk);
  const int64_t pos = a.positions[r];
  const int64_t p0 = j * d.chunk, nv = attn::visible(d, pos);
  const int64_t p1 = p0 + d.chunk < nv ? p0 + d.chunk : nv;
  const bool write = attn::writes(d, pos, j);
  if (p0 >= p1 && !write) return;  // the whole block: nothing to read or write
  const int64_t l = attn::clamp_index(a.layer[0], d.A), n = attn::clamp_index(a.layer[0], d.An);
  const float fpos = static_cast<float>(pos);

  for (int g = warp; g < G; g += kWarps)
    prepare_head(d, a, a.q + attn::q_head(d, r, kh * G + g), a.q_norm + n * D, fpos, d.scale,
                 buf[warp], qs + g * D, lane);
  if (write && warp == 0)
    prepare_head(d, a, a.k + (r * d.K + kh) * D, a.k_norm + n * D, fpos, 1.0f, buf[warp],
                 a.k_cache + attn::cache_row(d, l, r, pos, kh, D), lane);
  if (write && warp == 1) {
    const float* v = a.v + (r * d.K + kh) * Dv;
    float* vc = a.v_cache + attn::cache_row(d, l, r, pos, kh, Dv);
    for (int c = lane; c < Dv; c += 32) vc[c] = v[c];
  }
  __syncthreads();  // the query heads in shared memory; the new key / value in the cache
  if (p0 >= p1) return;
  const int np = static_cast<int>(p1 - p0);

  for (int p = warp; p < np; p += kWarps) {
    const float* kr = a.k_cache + attn::cache_row(d, l, r, p0 + p, kh, D);
    float kv[kPerLane];
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int i = lane + 32 * c;
      kv[c] = i < D ? kr[i] : 0.0f;
    }
    for (int g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      float s = 0.0f;
#pragma unroll
      for (int c = 0; c < kPerLane; ++c) {
        const int i = lane + 32 * c;
        if (i < D) s += qg[i] * kv[c];
      }
      s = warp_sum(s);
      if (lane == 0) sc[g * chunk + p] = s;
    }
  }
  __syncthreads();

  for (int g = warp; g < G; g += kWarps) {
    float* sg = sc + g * chunk;
    float m = -INFINITY;
    for (int p = lane; p < np; p += 32) m = fmaxf(m, sg[p]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int p = lane; p < np; p += 32) {
      const float e = expf(sg[p] - m);
      sg[p] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      float* out = a.part + attn::part_of(d, r, kh, j, g);
      out[Dv] = m;
      out[Dv + 1] = sum;
    }
  }
  __syncthreads();

  const int slots = kThreads / Dv, c = tid % Dv, g0 = tid / Dv;
  if (g0 >= slots) return;  // threads past slots * Dv
  float acc[kMaxGroup];
#pragma unroll
  for (int i = 0; i < kMaxGroup; ++i) acc[i] = 0.0f;
  const float* vr = a.v_cache + attn::cache_row(d, l, r, p0, kh, Dv) + c;
  const int64_t stride = d.K * d.Dv;  // between consecutive positions of one kv head
  for (int p = 0; p < np; ++p) {
    const float vv = vr[p * stride];
#pragma unroll
    for (int i = 0; i < kMaxGroup; ++i) {
      const int g = g0 + i * slots;
      if (g < G) acc[i] += sc[g * chunk + p] * vv;
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxGroup; ++i) {
    const int g = g0 + i * slots;
    if (g < G) a.part[attn::part_of(d, r, kh, j, g) + c] = acc[i];
  }
}

__global__ void __launch_bounds__(kMaxDim) combine_kernel(attn::Dims d, attn::Args a) {
  const int64_t h = blockIdx.x, r = blockIdx.y;
  const int c = threadIdx.x;
  if (c >= d.Dv) return;
  const int64_t nv = attn::visible(d, a.positions[r]);
  a.o[(r * d.H + h) * d.Dv + c] = attn::combine(d, a, r, h, c, nv);
}

}  // namespace

gpuError_t launch_attn_step(gpuStream_t s, const attn::Dims& d, const attn::Args& a) {
  if (d.b == 0 || d.H == 0) return gpuSuccess;
  if (d.b > 65535 || d.K > 65535 || d.H > 65535 || d.splits > 0x7fffffff)
    return gpuErrorInvalidValue;
  split_kernel<<<dim3(static_cast<unsigned>(d.splits), static_cast<unsigned>(d.K),
                      static_cast<unsigned>(d.b)),
                 kThreads, 0, s>>>(d, a);
  if (gpuError_t e = gpuGetLastError()) return e;
  const unsigned threads = static_cast<unsigned>((d.Dv + 31) / 32 * 32);
  combine_kernel<<<dim3(static_cast<unsigned>(d.H), static_cast<unsigned>(d.b)), threads, 0, s>>>(
      d, a);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
