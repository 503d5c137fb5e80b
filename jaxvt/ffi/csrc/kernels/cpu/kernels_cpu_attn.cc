// The fused attention decode step on the CPU (attn.h has the math). The same phases as the GPU's
// (kernels_gpu_attn.cu): the new keys and values written first, then one task per (row, kv head,
// split) computing the split's partials, then one per (row, query head) combining them, each
// summing in a fixed order, so the result does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/attn.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu {

namespace {

// out[i] (D values) = x normed (with `norm`, when qk_norm), roped at pos, times scale.
void head(const attn::Dims& d, const attn::Args& a, const float* x, const float* norm,
          int64_t pos, float scale, float* out) {
  std::vector<float> y(x, x + d.D);
  if (d.qk_norm) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d.D; ++i) ss += y[i] * y[i];
    const float rs = attn::rms_factor(d, ss);
    for (int64_t i = 0; i < d.D; ++i) y[i] = y[i] * rs * norm[i];
  }
  const float p = static_cast<float>(pos);
  for (int64_t i = 0; i < d.D; ++i) out[i] = attn::rope_at(d, a.inv_freq, y.data(), i, p) * scale;
}

// Phase 1 for (row r, kv head kh, split j): the partials of the G query heads.
void split(const attn::Dims& d, const attn::Args& a, int64_t l, int64_t n, int64_t r, int64_t kh,
           int64_t j) {
  const int64_t pos = a.positions[r];
  const int64_t p0 = j * d.chunk, p1 = std::min(p0 + d.chunk, attn::visible(d, pos));
  if (p0 >= p1) return;
  const int64_t G = d.G, D = d.D, Dv = d.Dv;
  std::vector<float> q(G * D), e(p1 - p0);
  for (int64_t g = 0; g < G; ++g)
    head(d, a, a.q + attn::q_head(d, r, kh * G + g), a.q_norm + n * D, pos, d.scale, &q[g * D]);
  for (int64_t g = 0; g < G; ++g) {
    float m = -INFINITY;
    for (int64_t s = p0; s < p1; ++s) {
      const float* ks = a.k_cache + attn::cache_row(d, l, r, s, kh, D);
      float acc = 0.0f;
      for (int64_t i = 0; i < D; ++i) acc += q[g * D + i] * ks[i];
      e[s - p0] = acc;
      m = std::max(m, acc);
    }
    float sum = 0.0f;
    for (int64_t s = p0; s < p1; ++s) {
      e[s - p0] = std::exp(e[s - p0] - m);
      sum += e[s - p0];
    }
    float* out = a.part + attn::part_of(d, r, kh, j, g);
    for (int64_t c = 0; c < Dv; ++c) out[c] = 0.0f;
    for (int64_t s = p0; s < p1; ++s) {
      const float* vs = a.v_cache + attn::cache_row(d, l, r, s, kh, Dv);
      for (int64_t c = 0; c < Dv; ++c) out[c] += e[s - p0] * vs[c];
    }
    out[Dv] = m;
    out[Dv + 1] = sum;
  }
}

}  // namespace

void attn_step(const attn::Dims& d, const attn::Args& a) {
  const int64_t l = attn::clamp_index(a.layer[0], d.A), n = attn::clamp_index(a.layer[0], d.An);
  for (int64_t r = 0; r < d.b; ++r) {
    const int64_t pos = a.positions[r];
    if (pos < 0 || pos >= d.S) continue;  // dropped, as the reference's scatter drops it
    for (int64_t kh = 0; kh < d.K; ++kh) {
      head(d, a, a.k + (r * d.K + kh) * d.D, a.k_norm + n * d.D, pos, 1.0f,
           a.k_cache + attn::cache_row(d, l, r, pos, kh, d.D));
      const float* v = a.v + (r * d.K + kh) * d.Dv;
      float* vc = a.v_cache + attn::cache_row(d, l, r, pos, kh, d.Dv);
      for (int64_t c = 0; c < d.Dv; ++c) vc[c] = v[c];
    }
  }
  auto phase1 = [&](int64_t t) {
    split(d, a, l, n, t / (d.K * d.splits), t / d.splits % d.K, t % d.splits);
  };
  parallel_for(d.b * d.K * d.splits, phase1);
  auto phase2 = [&](int64_t t) {
    const int64_t r = t / d.H, h = t % d.H;
    const int64_t nv = attn::visible(d, a.positions[r]);
    const float M = attn::combine_max(d, a, r, h, nv);
    float L[attn::kWays], o[attn::kWays];
    for (int64_t c = 0; c < d.Dv; ++c) {
      for (int w = 0; w < attn::kWays; ++w)
        attn::combine_part(d, a, r, h, c, nv, M, w, &L[w], &o[w]);
      a.o[t * d.Dv + c] = attn::combine_out(d, a, r, h, c, L, o);
    }
  };
  parallel_for(d.b * d.H, phase2);
}

}  // namespace jaxvt::cpu
