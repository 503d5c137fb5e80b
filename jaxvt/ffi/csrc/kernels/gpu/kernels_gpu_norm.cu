// The residual add and RMSNorm on the GPU (norm.h's contract): one block of norm::kLanes threads
// a row. Thread i takes the elements j = i mod kLanes; its squares (then its h * v products) are
// folded by fma in index order, each logical warp's 32 sums by xor butterflies (16 .. 1: every
// lane ends with norm.h's halving order, the adds being commutative), and thread 0 halves the
// warps' sums.
// A decode row is a chain of latencies, not of bytes (a few KB a row): where a thread's elements
// fit in registers (d <= kLanes * EP), every load that does not depend on the layer (x, the K
// slots, s, their weights) is issued at once, the layer's w and v rows while the first sum runs,
// and x' stays in registers between the passes (storing x' and reading it back through
// possibly aliased pointers keeps each load behind the previous store: 7-9 us a row on an
// H100). Larger rows take the loop kernel, which stores x' and reads it back.
#include <cmath>
#include <cstdint>

#include "common/norm.h"
#include "common/vendor.h"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

constexpr int kWarps = norm::kLanes / norm::kGroup;

// The block's sum of each thread's `v` in norm.h's order; every thread gets it.
__device__ float block_sum(float v, float* smem) {
#pragma unroll
  for (int o = norm::kGroup / 2; o > 0; o /= 2) v += gpuShflXor(v, o);
  const int warp = static_cast<int>(threadIdx.x) / norm::kGroup;
  if (static_cast<int>(threadIdx.x) % norm::kGroup == 0) smem[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int o = kWarps / 2; o > 0; o /= 2)
      for (int i = 0; i < o; ++i) smem[i] += smem[i + o];
  }
  __syncthreads();
  const float total = smem[0];
  __syncthreads();  // smem is reused by the next sum
  return total;
}

constexpr int kMaxSlots = 16;  // slots (K) whose loads one thread issues together

// u_j (norm.h's combine) with the K slots' loads issued before their fma chain: KM 1, y alone;
// KM kMaxSlots, K <= KM weighted slots (cw: their weights); 0, any K (a load per step).
template <int KM>
__device__ __forceinline__ float combine_at(const float* y, const float* c, const float* cw,
                                            int64_t K, int64_t d, int64_t j) {
  if constexpr (KM == 1) {
    return y[j];
  } else if constexpr (KM == 0) {
    return norm::combined(y, c, K, d, j);
  } else {
    float t[KM];
#pragma unroll
    for (int k = 0; k < KM; ++k) t[k] = k < K ? y[k * d + j] : 0.0f;
    float u = cw[0] * t[0];
#pragma unroll
    for (int k = 1; k < KM; ++k)
      if (k < K) u = fmaf(cw[k], t[k], u);
    return u;
  }
}

// KM 1: y alone; KM > 1: K <= KM weighted slots. EP: elements a thread holds (d <= kLanes EP).
template <int KM, int EP>
__global__ void __launch_bounds__(norm::kLanes) add_norm_regs_kernel(norm::Args a) {
  __shared__ float smem[kWarps];
  const int64_t t = blockIdx.x, d = a.d, K = a.K;
  const int i = static_cast<int>(threadIdx.x);
  const float* __restrict__ x = a.x + t * d;
  const float* __restrict__ y = a.y + t * K * d;
  const float* __restrict__ s = a.s ? a.s + t * d : nullptr;
  float cw[KM];
  if constexpr (KM > 1) {
#pragma unroll
    for (int k = 0; k < KM; ++k) cw[k] = k < K ? a.c[t * K + k] : 0.0f;
  }
  const float sg = s ? 1.0f / (1.0f + expf(-a.g[t])) : 0.0f;
  const int32_t layer = a.layer[0];
  float xp[EP];  // x[j], then x'[j]
  float acc = 0.0f;
#pragma unroll
  for (int e = 0; e < EP; ++e) {
    const int64_t j = i + static_cast<int64_t>(e) * norm::kLanes;
    if (j >= d) break;
    float u;
    if constexpr (KM == 1) {
      u = y[j];
    } else {
      float yk[KM];
#pragma unroll
      for (int k = 0; k < KM; ++k) yk[k] = k < K ? y[k * d + j] : 0.0f;
      u = cw[0] * yk[0];
#pragma unroll
      for (int k = 1; k < KM; ++k)
        if (k < K) u = fmaf(cw[k], yk[k], u);
    }
    const float sj = s ? s[j] : 0.0f;
    xp[e] = x[j] + (s ? fmaf(sg, sj, u) : u);
    acc = fmaf(xp[e], xp[e], acc);
  }
  const int64_t l = layer < 0 ? 0 : (layer >= a.L ? a.L - 1 : layer);
  const float* __restrict__ w = a.w + l * d;
  const float* __restrict__ vec = a.v ? a.v + l * d : nullptr;
  float wv[EP], vv[EP];
#pragma unroll
  for (int e = 0; e < EP; ++e) {
    const int64_t j = i + static_cast<int64_t>(e) * norm::kLanes;
    if (j >= d) break;
    wv[e] = w[j];
    vv[e] = vec ? vec[j] : 0.0f;
  }
  float* __restrict__ xo = a.xo + t * d;
#pragma unroll
  for (int e = 0; e < EP; ++e) {
    const int64_t j = i + static_cast<int64_t>(e) * norm::kLanes;
    if (j >= d) break;
    xo[j] = xp[e];
  }
  const float ss = block_sum(acc, smem);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(d) + a.eps);
  float* __restrict__ h = a.h + t * d;
  acc = 0.0f;
#pragma unroll
  for (int e = 0; e < EP; ++e) {
    const int64_t j = i + static_cast<int64_t>(e) * norm::kLanes;
    if (j >= d) break;
    const float hv = (xp[e] * r) * wv[e];
    h[j] = hv;
    acc = fmaf(hv, vv[e], acc);
  }
  if (!vec) {
    if (i == 0) a.dot[t] = 0.0f;
    return;
  }
  const float dot = block_sum(acc, smem);
  if (i == 0) a.dot[t] = dot;
}

// Any d and K: x' stored, then read back by the thread that wrote it.
template <int KM>
__global__ void __launch_bounds__(norm::kLanes) add_norm_kernel(norm::Args a) {
  __shared__ float smem[kWarps];
  const int64_t t = blockIdx.x, d = a.d;
  const int i = static_cast<int>(threadIdx.x);
  int64_t l = a.layer[0];
  l = l < 0 ? 0 : (l >= a.L ? a.L - 1 : l);
  const float* x = a.x + t * d;
  const float* y = a.y + t * a.K * d;
  const float* c = a.c ? a.c + t * a.K : nullptr;
  float* xo = a.xo + t * d;
  float* h = a.h + t * d;
  const float* w = a.w + l * d;
  float cw[KM > 1 ? KM : 1];
  if constexpr (KM > 1) {
#pragma unroll
    for (int k = 0; k < KM; ++k) cw[k] = k < a.K ? c[k] : 0.0f;
  }
  const float* s = a.s ? a.s + t * d : nullptr;
  const float sg = s ? 1.0f / (1.0f + expf(-a.g[t])) : 0.0f;

  float acc = 0.0f;
#pragma unroll 2
  for (int64_t j = i; j < d; j += norm::kLanes) {
    const float u = combine_at<KM>(y, c, cw, a.K, d, j);
    const float v = x[j] + (s ? fmaf(sg, s[j], u) : u);
    xo[j] = v;
    acc = fmaf(v, v, acc);
  }
  const float ss = block_sum(acc, smem);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(d) + a.eps);
  const float* vec = a.v ? a.v + l * d : nullptr;
  acc = 0.0f;
  for (int64_t j = i; j < d; j += norm::kLanes) {
    const float hv = (xo[j] * r) * w[j];
    h[j] = hv;
    if (vec) acc = fmaf(hv, vec[j], acc);
  }
  if (!vec) {
    if (i == 0) a.dot[t] = 0.0f;
    return;
  }
  const float dot = block_sum(acc, smem);
  if (i == 0) a.dot[t] = dot;
}

}  // namespace

gpuError_t launch_add_norm(gpuStream_t s, const norm::Args& a) {
  if (a.ggml || a.d < 1 || a.L < 1 || a.K < 1 || a.T < 0 || a.T > 0x7fffffff)
    return gpuErrorInvalidValue;
  if (a.T == 0) return gpuSuccess;
  const unsigned blocks = static_cast<unsigned>(a.T);
  const int ep = a.d <= 8 * norm::kLanes ? 8 : (a.d <= 16 * norm::kLanes ? 16 : 0);
  const int km = !a.c ? 1 : (a.K <= 8 ? 8 : 0);
  if (ep && km) {
    if (km == 1 && ep == 8) add_norm_regs_kernel<1, 8><<<blocks, norm::kLanes, 0, s>>>(a);
    else if (km == 1) add_norm_regs_kernel<1, 16><<<blocks, norm::kLanes, 0, s>>>(a);
    else if (ep == 8) add_norm_regs_kernel<8, 8><<<blocks, norm::kLanes, 0, s>>>(a);
    else add_norm_regs_kernel<8, 16><<<blocks, norm::kLanes, 0, s>>>(a);
    return gpuGetLastError();
  }
  if (!a.c) add_norm_kernel<1><<<blocks, norm::kLanes, 0, s>>>(a);
  else if (a.K <= kMaxSlots) add_norm_kernel<kMaxSlots><<<blocks, norm::kLanes, 0, s>>>(a);
  else add_norm_kernel<0><<<blocks, norm::kLanes, 0, s>>>(a);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
