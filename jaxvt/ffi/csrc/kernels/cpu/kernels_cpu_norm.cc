// The residual add and RMSNorm on the CPU (norm.h's contract): a task per run of rows; the sums
// in norm.h's lane order (or ggml's for ss), so a row's bits do not depend on the other rows.
#include <cmath>
#include <cstdint>

#include "common/norm.h"
#include "kernels/cpu/kernels_cpu.h"
#include "kernels/cpu/kernels_cpu_ggml.h"

namespace jaxvt::cpu {
namespace {

// The sum of a[j] * b[j] over j < d in norm.h's order.
float lane_sum(const float* a, const float* b, int64_t d) {
  float lanes[norm::kLanes] = {};
  for (int64_t j = 0; j < d; ++j) {
    float& l = lanes[j % norm::kLanes];
    l = std::fma(a[j], b[j], l);
  }
  for (int g = 0; g < norm::kLanes; g += norm::kGroup)
    for (int o = norm::kGroup / 2; o > 0; o /= 2)
      for (int i = 0; i < o; ++i) lanes[g + i] += lanes[g + i + o];
  float groups[norm::kLanes / norm::kGroup];
  for (int i = 0; i < norm::kLanes / norm::kGroup; ++i) groups[i] = lanes[i * norm::kGroup];
  for (int o = norm::kLanes / norm::kGroup / 2; o > 0; o /= 2)
    for (int i = 0; i < o; ++i) groups[i] += groups[i + o];
  return groups[0];
}

void rows(const norm::Args& a, const float* w, const float* v, int64_t t0, int64_t t1) {
  const int64_t d = a.d;
  for (int64_t t = t0; t < t1; ++t) {
    const float* x = a.x + t * d;
    const float* y = a.y + t * a.K * d;
    const float* c = a.c ? a.c + t * a.K : nullptr;
    float* xo = a.xo + t * d;
    float* h = a.h + t * d;
    if (a.s) {
      const float* s = a.s + t * d;
      const float sg = 1.0f / (1.0f + std::exp(-a.g[t]));
      for (int64_t j = 0; j < d; ++j)
        xo[j] = x[j] + std::fma(sg, s[j], norm::combined(y, c, a.K, d, j));
    } else {
      for (int64_t j = 0; j < d; ++j) xo[j] = x[j] + norm::combined(y, c, a.K, d, j);
    }
    if (a.ggml) {
      ggml::rms_norm(xo, w, 1, d, a.eps, h);  // ggml's rounding (one row: no pool task)
    } else {
      const float r = 1.0f / std::sqrt(lane_sum(xo, xo, d) / static_cast<float>(d) + a.eps);
      for (int64_t j = 0; j < d; ++j) h[j] = (xo[j] * r) * w[j];
    }
    a.dot[t] = v ? lane_sum(h, v, d) : 0.0f;
  }
}

}  // namespace

void add_norm(const norm::Args& a) {
  int64_t l = a.layer[0];
  l = l < 0 ? 0 : (l >= a.L ? a.L - 1 : l);
  const float* w = a.w + l * a.d;
  const float* v = a.v ? a.v + l * a.d : nullptr;
  const int64_t grain = 1 + 16384 / a.d;  // rows a task
  const int64_t tasks = (a.T + grain - 1) / grain;
  if (tasks <= 1) return rows(a, w, v, 0, a.T);
  auto task = [&](int64_t i) { rows(a, w, v, i * grain, i + 1 == tasks ? a.T : (i + 1) * grain); };
  parallel_for(tasks, task);
}

}  // namespace jaxvt::cpu
