// The fused attention decode step on a GPU (CUDA, and HIP through vendor.h); attn.h has the math,
// kernels_cpu_attn.cc the same phases on the CPU. Two launches on the FFI stream:
//
// 1. split_kernel, one block of kThreads (8 warps) per (split, kv head, row): grid (splits, K, b).
//    Warp w prepares query heads w, w + 8, ... of the kv head's G (RMSNorm, RoPE, the scale) into
//    shared memory; the block whose chunk holds the row's position (split 0 beyond kv_len) also
//    prepares the new key (warp 0) and copies the new value (warp 1) into layer `layer` of the
//    cache stacks, then every thread of the block passes a barrier, which makes those writes
//    visible to the block before it reads its chunk. Scores: warp w takes positions 4w .. 4w + 3
//    of the chunk, then 4w + 32 ..., a group of 8 lanes per position; each lane holds D / 8
//    elements of the key row and sums its products with each query head in element order, then
//    a butterfly of 3 shuffles adds the group (every lane ends with the same bits). Softmax
//    partials: warp w takes heads w, w + 8, ...: max and sum of exp over the chunk, lane-strided,
//    then a butterfly over the warp. Weighted values: thread t owns column t % Dv and heads t / Dv + i (256 / Dv),
//    i = 0, 1, ..., summing over the chunk's positions in order (consecutive threads read a value
//    row's consecutive addresses). Splits beyond the row's visible positions return at once.
// 2. combine_kernel, one block of 8 warps per (query head, row, 32 value columns): warp w sums
//    the splits j = w (mod 8) (attn.h's combine_part), warp 0 adds the 8 parts in order and
//    multiplies by sigmoid(gate), the CPU's arithmetic.
// Every sum has an order fixed by D, Dv, G, the chunk and kThreads alone (no atomics), so the
// result does not depend on timing or on the grid. The chunk (jaxvt/ffi/attn.py) keeps a split
// short (16 positions up to a kv_len of 2048), so a decode at a few hundred positions spreads
// over tens of blocks; longer contexts take at most 128 splits (up to a kv_len of 32768) of up
// to 256 positions, a block or two per multiprocessor per kv head.
#include <cstdint>

#include "common/attn.h"
#include "common/vendor.h"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxDim = static_cast<int>(attn::kMaxDim);
constexpr int kMaxGroup = static_cast<int>(attn::kMaxGroup);
constexpr int kMaxChunk = static_cast<int>(attn::kMaxChunk);
constexpr int kPerLane = kMaxDim / 8;  // key elements a lane holds (a group of 8 per row)
static_assert(kThreads >= kMaxDim, "a thread per value column at least");
static_assert(attn::kWays == kWarps, "a combine part per warp");

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

  // Scores: each warp takes 4 positions at a time, a group of 8 lanes per position; lane k of a
  // group holds the key row's elements k, k + 8, ... (a group reads 32 consecutive bytes per
  // load) and sums its products with each query head in element order, then 3 shuffles add the
  // group's lanes (each lane ends with the same bits).
  const int grp = lane >> 3, gl = lane & 7;
  for (int base = warp * 4; base < np; base += kWarps * 4) {  // uniform over the warp
    const int p = base + grp;
    const bool live = p < np;
    const float* kr = a.k_cache + attn::cache_row(d, l, r, p0 + (live ? p : 0), kh, D);
    float kv[kPerLane];
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int i = gl + 8 * c;
      kv[c] = live && i < D ? kr[i] : 0.0f;
    }
    for (int g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      float s = 0.0f;
#pragma unroll
      for (int c = 0; c < kPerLane; ++c) {
        const int i = gl + 8 * c;
        if (i < D) s += qg[i] * kv[c];
      }
      s += gpuShflXor(s, 4);
      s += gpuShflXor(s, 2);
      s += gpuShflXor(s, 1);
      if (live && gl == 0) sc[g * chunk + p] = s;
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
#pragma unroll 4
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

// One block of kWarps warps per (query head, row, 32 columns): warp w sums part w of
// attn::combine_part (kWays == kWarps) for the lane's column; warp 0 adds the parts in order.
__global__ void __launch_bounds__(kThreads) combine_kernel(attn::Dims d, attn::Args a) {
  __shared__ float Ms[kWarps], Ls[kWarps], os[kWarps][32];
  const int64_t h = blockIdx.x, r = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = blockIdx.z * 32 + lane;
  const int64_t nv = attn::visible(d, a.positions[r]);
  if (lane == 0) Ms[warp] = attn::combine_max(d, a, r, h, nv, warp, kWarps);
  __syncthreads();
  float M = Ms[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) M = fmaxf(M, Ms[w]);
  float L = 0.0f, o = 0.0f;
  if (c < d.Dv) attn::combine_part(d, a, r, h, c, nv, M, warp, &L, &o);
  os[warp][lane] = o;
  if (lane == 0) Ls[warp] = L;
  __syncthreads();
  if (warp == 0 && c < d.Dv) {
    float Lw[kWarps], ow[kWarps];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      Lw[w] = Ls[w];
      ow[w] = os[w][lane];
    }
    a.o[(r * d.H + h) * d.Dv + c] = attn::combine_out(d, a, r, h, c, Lw, ow);
  }
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
  combine_kernel<<<dim3(static_cast<unsigned>(d.H), static_cast<unsigned>(d.b),
                        static_cast<unsigned>((d.Dv + 31) / 32)),
                   kThreads, 0, s>>>(d, a);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
