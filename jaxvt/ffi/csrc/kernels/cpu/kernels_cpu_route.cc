// The MoE router on the CPU (route.h's contract): softmax over each token's logits, top k, and
// renormalisation, one token per task.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "common/route.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu {
namespace {

// One token: x [E] -> ids [k], w [k]; p and order are scratch of E elements.
void route_row(const float* x, int64_t E, int64_t k, bool renormalise, float* p, int32_t* order,
               int32_t* ids, float* w) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < E; ++i) m = x[i] > m ? x[i] : m;
  float lanes[route::kLanes] = {};  // the sum in route.h's order (the GPU kernel's)
  for (int64_t i = 0; i < E; ++i) {
    p[i] = std::exp(x[i] - m);
    lanes[i % route::kLanes] += p[i];
  }
  for (int o = route::kLanes / 2; o > 0; o /= 2)
    for (int l = 0; l < o; ++l) lanes[l] += lanes[l + o];
  const float s = lanes[0];
  if (std::isnan(s)) {  // every p is NaN (route.h)
    for (int64_t r = 0; r < k; ++r) {
      ids[r] = static_cast<int32_t>(r);
      w[r] = std::numeric_limits<float>::quiet_NaN();
    }
    return;
  }
  for (int64_t i = 0; i < E; ++i) p[i] = p[i] / s;
  std::iota(order, order + E, 0);
  std::partial_sort(order, order + k, order + E,
                    [p](int32_t a, int32_t b) { return route::before(p[a], a, p[b], b); });
  float total = 0.0f;
  for (int64_t r = 0; r < k; ++r) {
    ids[r] = order[r];
    w[r] = p[order[r]];
    total += w[r];
  }
  if (renormalise)
    for (int64_t r = 0; r < k; ++r) w[r] = w[r] / total;
}

}  // namespace

void moe_route(const float* logits, int64_t T, int64_t E, int64_t k, bool renormalise,
               int32_t* ids, float* weights) {
  constexpr int64_t kTokensPerTask = 64;
  auto task = [&](int64_t t0) {
    std::vector<float> p(E);
    std::vector<int32_t> order(E);
    const int64_t t1 = std::min(T, (t0 + 1) * kTokensPerTask);
    for (int64_t t = t0 * kTokensPerTask; t < t1; ++t)
      route_row(logits + t * E, E, k, renormalise, p.data(), order.data(), ids + t * k,
                weights + t * k);
  };
  parallel_for((T + kTokensPerTask - 1) / kTokensPerTask, task);
}

}  // namespace jaxvt::cpu
