// The fused Gated DeltaNet decode step on a GPU (CUDA, and HIP through vendor.h); gdn.h has the
// math, kernels_cpu_gdn.cc the same on the CPU. Three launches on the FFI stream:
//
// 1. conv_kernel, one thread per (row, channel): x = silu(conv) into conv_out, and the channel's
//    conv state (layer `layer` of the stack) shifted in place; each channel is read and written by
//    its one thread, read before written.
// 2. head_kernel, one block per (column block, value head, row): grid (nc nv, b), C = dv / nc
//    columns a block (C = 32 where dv is a multiple of 32 and larger; else C = dv, nc = 1). The
//    block reads its 2 dk + C inputs of x from conv_out, l2-normalizes q and k (warp 0 sums q^2,
//    warp 1 k^2, in a fixed lane order and shuffle tree), then streams its columns of the head's
//    state S [dk, dv] twice: thread (j, p) owns column j (consecutive threads read consecutive
//    addresses) and rows [p R, (p + 1) R), P = kThreads / C slices of R = ceil(dk / P) rows
//    (short serial chains: each thread's loads are what bounds the kernel). Pass 1 sums
//    kv_j = sum_i (S_ij e^g) k_i; the slices' partial sums meet in shared memory and are added in
//    slice order; delta = beta (v - kv). Pass 2 writes S''_ij = S_ij e^g + k_i delta_j in place
//    and sums o_j = sum_i S''_ij q_i the same way; o goes to y.
// 3. norm_kernel, one warp per (value head, row): y = o * rsqrt(mean(o^2) + eps) * norm_w *
//    silu(z), o^2 summed in a fixed lane order and shuffle tree.
// Every sum has an order fixed by dk, dv and kThreads alone (no atomics), so the result does not
// depend on timing or on the grid.
#include <cstdint>

#include "common/gdn.h"
#include "common/vendor.h"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

constexpr int kThreads = 512;  // a head block's threads at most: P slices of C columns
constexpr int kConvThreads = 256;
constexpr int kMax = static_cast<int>(gdn::kMaxDim);
static_assert(kThreads >= 2 * kMax, "two column slices at least for dv = kMaxDim");

// sum_i x_i^2 over n values, by one whole warp (32 lanes); every lane returns the same sum.
__device__ __forceinline__ float warp_sum_squares(const float* x, int n, int lane) {
  float s = 0.0f;
  for (int i = lane; i < n; i += 32) s += x[i] * x[i];
  for (int o = 16; o > 0; o >>= 1) s += gpuShflXor(s, o);
  return s;
}

// Columns a head_kernel block owns.
__host__ __device__ __forceinline__ int block_cols(int dv) {
  return dv > 32 && dv % 32 == 0 ? 32 : dv;
}

__global__ void __launch_bounds__(kConvThreads) conv_kernel(gdn::Dims d, gdn::Args a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kConvThreads + threadIdx.x;
  if (t >= d.b * d.conv_dim) return;
  const int64_t r = t / d.conv_dim, c = t % d.conv_dim;
  const gdn::Layer l = gdn::layer_of(d, a);
  a.conv_out[t] = gdn::conv_shift(d, a.mixed + r * d.conv_dim,
                                  l.conv_state + r * (d.K - 1) * d.conv_dim, l.conv_w, c,
                                  a.valid[r] != 0);
}

__global__ void __launch_bounds__(kThreads) head_kernel(gdn::Dims d, gdn::Args a) {
  __shared__ float x[2 * kMax + kMax];  // q | k | v (this block's columns) of this head
  __shared__ float delta[kMax];
  __shared__ float part[kThreads];      // [P][C] partial sums of the column slices
  __shared__ float sums[2];
  const int tid = threadIdx.x;
  const int dk = static_cast<int>(d.dk), dv = static_cast<int>(d.dv);
  const int C = block_cols(dv), nc = dv / C;
  const int64_t h = blockIdx.x / nc, r = blockIdx.y;
  const int j0 = static_cast<int>(blockIdx.x % nc) * C;  // the block's first column
  const int64_t kh = gdn::key_head(d, h), rh = r * d.nv + h;
  const bool valid = a.valid[r] != 0;
  const gdn::Layer l = gdn::layer_of(d, a);
  const float* x_r = a.conv_out + r * d.conv_dim;

  for (int i = tid; i < 2 * dk + C; i += blockDim.x)
    x[i] = x_r[gdn::channel(d, h, kh, i < 2 * dk ? i : i + j0)];
  const float beta = valid ? gdn::sigmoid(a.beta_raw[rh]) : 0.0f;
  const float g = valid ? l.a[h] * gdn::softplus(a.alpha_raw[rh] + l.dt_bias[h]) : 0.0f;
  const float decay = expf(g);
  __syncthreads();
  if (tid < 64) {  // P C > kThreads - C >= 64 threads (C <= 32, or C = dv <= kMax)
    const float s = warp_sum_squares(x + (tid < 32 ? 0 : dk), dk, tid & 31);
    if ((tid & 31) == 0) sums[tid >> 5] = s;
  }
  __syncthreads();
  const float rq = 1.0f / sqrtf(sums[0] + d.qk_eps), rk = 1.0f / sqrtf(sums[1] + d.qk_eps);
  for (int i = tid; i < dk; i += blockDim.x) {
    x[i] = x[i] * rq * d.q_scale;
    x[dk + i] = x[dk + i] * rk;
  }
  __syncthreads();

  const float* q = x;
  const float* k = x + dk;
  const float* v = x + 2 * dk;
  const int P = kThreads / C, R = (dk + P - 1) / P;
  const int j = tid % C, p = tid / C;
  const int i0 = min(p * R, dk), i1 = min(i0 + R, dk);
  float* S = l.ssm_state + rh * d.dk * d.dv + j0;  // column j0 + j: S[i * dv + j]

  float acc = 0.0f;
  for (int i = i0; i < i1; ++i) acc += S[i * dv + j] * decay * k[i];
  part[p * C + j] = acc;
  __syncthreads();
  if (tid < C) {
    float kv = 0.0f;
    for (int s = 0; s < P; ++s) kv += part[s * C + tid];
    delta[tid] = beta * (v[tid] - kv);
  }
  __syncthreads();
  acc = 0.0f;
  const float dj = delta[j];
  for (int i = i0; i < i1; ++i) {
    const float s = S[i * dv + j] * decay + k[i] * dj;
    S[i * dv + j] = s;
    acc += s * q[i];
  }
  part[p * C + j] = acc;
  __syncthreads();
  if (tid < C) {
    float oj = 0.0f;
    for (int s = 0; s < P; ++s) oj += part[s * C + tid];
    a.y[rh * d.dv + j0 + tid] = oj;
  }
}

__global__ void __launch_bounds__(32) norm_kernel(gdn::Dims d, gdn::Args a) {
  const int64_t h = blockIdx.x, r = blockIdx.y, rh = r * d.nv + h;
  const int lane = threadIdx.x, dv = static_cast<int>(d.dv);
  const gdn::Layer l = gdn::layer_of(d, a);
  float* y = a.y + rh * d.dv;  // o, normalized and gated in place
  const float* z = a.z + rh * d.dv;
  const float s = warp_sum_squares(y, dv, lane);
  const float ro = 1.0f / sqrtf(s / static_cast<float>(dv) + d.eps);
  for (int jj = lane; jj < dv; jj += 32) y[jj] = y[jj] * ro * l.norm_w[jj] * gdn::silu(z[jj]);
}

}  // namespace

gpuError_t launch_gdn_step(gpuStream_t s, const gdn::Dims& d, const gdn::Args& a) {
  if (d.b == 0 || d.nv == 0) return gpuSuccess;
  if (d.b > 65535) return gpuErrorInvalidValue;
  const int64_t n = d.b * d.conv_dim;
  conv_kernel<<<static_cast<unsigned>((n + kConvThreads - 1) / kConvThreads), kConvThreads, 0,
                s>>>(d, a);
  if (gpuError_t e = gpuGetLastError()) return e;
  const int dv = static_cast<int>(d.dv), C = block_cols(dv);
  const unsigned nb = static_cast<unsigned>(d.nv * (dv / C)), rows = static_cast<unsigned>(d.b);
  head_kernel<<<dim3(nb, rows), (kThreads / C) * C, 0, s>>>(d, a);
  if (gpuError_t e = gpuGetLastError()) return e;
  norm_kernel<<<dim3(static_cast<unsigned>(d.nv), rows), 32, 0, s>>>(d, a);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
