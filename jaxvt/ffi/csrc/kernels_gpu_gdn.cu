// The fused Gated DeltaNet decode step on a GPU (CUDA, and HIP through vendor.h); gdn.h has the
// math, kernels_cpu_gdn.cc the same on the CPU.
//
// One block of kThreads threads per (batch row, value head): grid (nv, b). The block
//   1. computes its 2 dk + dv conv channels (q and k of its key head, v of its own head) from the
//      conv state, mixed and the conv kernel, with silu, into shared memory; it writes those
//      channels of the new conv state (a key head's q / k channels by one of its value heads);
//   2. l2-normalizes q and k (warp 0 sums q^2, warp 1 k^2, each in a fixed lane order and a fixed
//      shuffle tree);
//   3. streams the head's state S [dk, dv] twice: thread (j, p) owns column j (consecutive threads
//      read consecutive addresses) and rows [p R, (p + 1) R) of it, P = kThreads / dv slices of
//      R = ceil(dk / P) rows. Pass 1 sums kv_j = sum_i (S_ij e^g) k_i; the slices' partial sums
//      meet in shared memory and are added in slice order; delta = beta (v - kv). Pass 2 writes
//      S''_ij = S_ij e^g + k_i delta_j and sums o_j = sum_i S''_ij q_i the same way;
//   4. RMS-normalizes o (warp 0) and gates it with silu(z).
// Every sum has an order fixed by dk, dv and kThreads alone (no atomics), so the result does not
// depend on timing or on the grid. The state may be updated in place (each element is read and
// written by one thread, read before written).
#include <cstdint>

#include "gdn.h"
#include "vendor.h"

namespace jaxvt::gpu {
namespace {

constexpr int kThreads = 512;
constexpr int kMax = static_cast<int>(gdn::kMaxDim);
static_assert(kThreads >= 2 * kMax, "two column slices at least for dv = kMaxDim");

// sum_i x_i^2 over n values, by one whole warp (32 lanes); every lane returns the same sum.
__device__ __forceinline__ float warp_sum_squares(const float* x, int n, int lane) {
  float s = 0.0f;
  for (int i = lane; i < n; i += 32) s += x[i] * x[i];
  for (int o = 16; o > 0; o >>= 1) s += gpuShflXor(s, o);
  return s;
}

__global__ void __launch_bounds__(kThreads) gdn_step_kernel(gdn::Dims d, gdn::Args a) {
  __shared__ float x[2 * kMax + kMax];  // q | k | v of this head
  __shared__ float delta[kMax], o[kMax];
  __shared__ float part[kThreads];      // [P][dv] partial sums of the column slices
  __shared__ float sums[2];
  const int tid = threadIdx.x;
  const int64_t h = blockIdx.x, r = blockIdx.y;
  const int dk = static_cast<int>(d.dk), dv = static_cast<int>(d.dv);
  const int64_t kh = gdn::key_head(d, h), rh = r * d.nv + h;
  const bool valid = a.valid[r] != 0, owner = gdn::owns_qk(d, h);
  const float* mixed_r = a.mixed + r * d.conv_dim;
  const float* state_r = a.conv_state + r * (d.K - 1) * d.conv_dim;
  float* out_r = a.conv_out + r * (d.K - 1) * d.conv_dim;

  for (int i = tid; i < 2 * dk + dv; i += kThreads) {
    const int64_t c = gdn::channel(d, h, kh, i);
    x[i] = gdn::silu(gdn::conv(d, mixed_r, state_r, a.conv_w, c));
    if (i >= 2 * dk || owner) gdn::shift_state(d, mixed_r, state_r, out_r, c, valid);
  }
  const float beta = valid ? gdn::sigmoid(a.beta_raw[rh]) : 0.0f;
  const float g = valid ? a.a[h] * gdn::softplus(a.alpha_raw[rh] + a.dt_bias[h]) : 0.0f;
  const float decay = expf(g);
  __syncthreads();
  if (tid < 64) {
    const float s = warp_sum_squares(x + (tid < 32 ? 0 : dk), dk, tid & 31);
    if ((tid & 31) == 0) sums[tid >> 5] = s;
  }
  __syncthreads();
  const float rq = 1.0f / sqrtf(sums[0] + d.qk_eps), rk = 1.0f / sqrtf(sums[1] + d.qk_eps);
  __syncthreads();  // sums is reused below
  for (int i = tid; i < dk; i += kThreads) {
    x[i] = x[i] * rq * d.q_scale;
    x[dk + i] = x[dk + i] * rk;
  }
  __syncthreads();

  const float* q = x;
  const float* k = x + dk;
  const float* v = x + 2 * dk;
  const int P = kThreads / dv, R = (dk + P - 1) / P;
  const int j = tid % dv, p = tid / dv;
  const int i0 = min(p * R, dk), i1 = min(i0 + R, dk);
  const bool active = p < P;
  const float* S = a.ssm_state + rh * d.dk * d.dv;
  float* S_out = a.ssm_out + rh * d.dk * d.dv;

  float acc = 0.0f;
  if (active) {
    for (int i = i0; i < i1; ++i) acc += S[i * dv + j] * decay * k[i];
    part[p * dv + j] = acc;
  }
  __syncthreads();
  if (tid < dv) {
    float kv = 0.0f;
    for (int s = 0; s < P; ++s) kv += part[s * dv + tid];
    delta[tid] = beta * (v[tid] - kv);
  }
  __syncthreads();
  if (active) {
    acc = 0.0f;
    const float dj = delta[j];
    for (int i = i0; i < i1; ++i) {
      const float s = S[i * dv + j] * decay + k[i] * dj;
      S_out[i * dv + j] = s;
      acc += s * q[i];
    }
    part[p * dv + j] = acc;
  }
  __syncthreads();
  if (tid < dv) {
    float oj = 0.0f;
    for (int s = 0; s < P; ++s) oj += part[s * dv + tid];
    o[tid] = oj;
  }
  __syncthreads();
  if (tid < 32) {
    const float s = warp_sum_squares(o, dv, tid);
    if (tid == 0) sums[0] = s;
  }
  __syncthreads();
  const float ro = 1.0f / sqrtf(sums[0] / static_cast<float>(dv) + d.eps);
  const float* z = a.z + rh * d.dv;
  float* y = a.y + rh * d.dv;
  for (int jj = tid; jj < dv; jj += kThreads) y[jj] = o[jj] * ro * a.norm_w[jj] * gdn::silu(z[jj]);
}

}  // namespace

gpuError_t launch_gdn_step(gpuStream_t s, const gdn::Dims& d, const gdn::Args& a) {
  if (d.b == 0 || d.nv == 0) return gpuSuccess;
  if (d.b > 65535) return gpuErrorInvalidValue;
  gdn_step_kernel<<<dim3(static_cast<unsigned>(d.nv), static_cast<unsigned>(d.b)), kThreads, 0,
                    s>>>(d, a);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
