// The MoE router on the GPU (route.h's contract): one logical warp of 32 lanes per token, four
// tokens per block of 128 threads. Lane l holds experts l, l + 32, ... (V = ceil(E / 32) values,
// in registers: the loads are coalesced). The row's max and sum are butterfly reductions
// (xor shuffles 16, 8, 4, 2, 1; each lane first folds its own values in index order), so every
// lane ends with the same bits. Then k rounds of a warp argmax over (p, index) in route::before's
// order: each lane offers its best remaining value (the lowest index among equal ones), the
// butterfly keeps the winner, its owner lane removes it, and lane r % 32 writes round r.
#include <cmath>
#include <cstdint>

#include "common/route.h"
#include "common/vendor.h"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

constexpr int kWarp = route::kLanes;  // a logical warp (vendor.h)
constexpr int kTokensPerBlock = 4;
constexpr float kTaken = -1.0f;  // below every probability: a removed or padding slot

template <int V>  // values per lane: E <= 32 V
__global__ void moe_route_kernel(const float* __restrict__ logits, int64_t T, int E, int k,
                                 bool renormalise, int32_t* __restrict__ ids,
                                 float* __restrict__ weights) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + threadIdx.x / kWarp;
  if (t >= T) return;  // t is the same for the whole warp
  const float* x = logits + t * E;
  int32_t* out_ids = ids + t * k;
  float* out_w = weights + t * k;

  float p[V];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = lane + j * kWarp;
    p[j] = e < E ? x[e] : -INFINITY;
    m = p[j] > m ? p[j] : m;  // skips NaN (a NaN logit makes the sum NaN below)
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float u = gpuShflXor(m, o);
    m = u > m ? u : m;
  }
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    p[j] = lane + j * kWarp < E ? expf(p[j] - m) : 0.0f;
    s += p[j];
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) s += gpuShflXor(s, o);

  if (isnan(s)) {  // every p is NaN: ids 0 .. k-1, NaN weights (route.h)
    for (int r = lane; r < k; r += kWarp) {
      out_ids[r] = r;
      out_w[r] = NAN;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) p[j] = lane + j * kWarp < E ? p[j] / s : kTaken;

  float total = 0.0f;  // the same on every lane: the winners, added in round order
  for (int r = 0; r < k; ++r) {
    float bv = p[0];
    int bi = lane;
#pragma unroll
    for (int j = 1; j < V; ++j) {
      if (p[j] > bv) {  // strictly: the lower index keeps a tie
        bv = p[j];
        bi = lane + j * kWarp;
      }
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const float ov = gpuShflXor(bv, o);
      const int oi = gpuShflXor(bi, o);
      if (route::before(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (lane + j * kWarp == bi) p[j] = kTaken;
    if (lane == r % kWarp) {
      out_ids[r] = bi;
      out_w[r] = bv;
    }
    total += bv;
  }
  if (renormalise)  // each lane rescales the weights it wrote
    for (int r = lane; r < k; r += kWarp) out_w[r] = out_w[r] / total;
}

template <int V>
void launch(gpuStream_t s, const float* logits, int64_t T, int E, int k, bool renormalise,
            int32_t* ids, float* weights) {
  const int64_t blocks = (T + kTokensPerBlock - 1) / kTokensPerBlock;
  moe_route_kernel<V><<<static_cast<unsigned>(blocks), kWarp * kTokensPerBlock, 0, s>>>(
      logits, T, E, k, renormalise, ids, weights);
}

}  // namespace

gpuError_t launch_moe_route(gpuStream_t s, const float* logits, int64_t T, int64_t E, int64_t k,
                            bool renormalise, int32_t* ids, float* weights) {
  static_assert(route::kMaxExperts == 16 * kWarp, "the kernels below cover E <= 16 * 32");
  if (E < 1 || E > route::kMaxExperts || k < 1 || k > E || T < 0 ||
      (T + kTokensPerBlock - 1) / kTokensPerBlock > 0x7fffffff)
    return gpuErrorInvalidValue;
  if (T == 0) return gpuSuccess;
  const int e = static_cast<int>(E), kk = static_cast<int>(k);
  if (E <= kWarp) launch<1>(s, logits, T, e, kk, renormalise, ids, weights);
  else if (E <= 2 * kWarp) launch<2>(s, logits, T, e, kk, renormalise, ids, weights);
  else if (E <= 4 * kWarp) launch<4>(s, logits, T, e, kk, renormalise, ids, weights);
  else if (E <= 8 * kWarp) launch<8>(s, logits, T, e, kk, renormalise, ids, weights);
  else launch<16>(s, logits, T, e, kk, renormalise, ids, weights);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
