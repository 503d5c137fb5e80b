// The fused Gated DeltaNet decode step on the CPU (gdn.h has the math). Phase 1 (conv and the
// conv state's shift) in one loop; phase 2 one task per (row, value head), each summing in a
// fixed order, so the result does not depend on the thread count.
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/gdn.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu {

namespace {

void head(const gdn::Dims& d, const gdn::Args& a, const gdn::Layer& l, int64_t r, int64_t h) {
  const int64_t dk = d.dk, dv = d.dv, kh = gdn::key_head(d, h);
  std::vector<float> x(2 * dk + dv), kv(dv, 0.0f), delta(dv), o(dv, 0.0f);
  for (int64_t i = 0; i < 2 * dk + dv; ++i)
    x[i] = a.conv_out[r * d.conv_dim + gdn::channel(d, h, kh, i)];
  float* q = x.data();
  float* k = q + dk;
  const float* v = k + dk;
  float sq = 0.0f, sk = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    sq += q[i] * q[i];
    sk += k[i] * k[i];
  }
  const float rq = 1.0f / std::sqrt(sq + d.qk_eps), rk = 1.0f / std::sqrt(sk + d.qk_eps);
  for (int64_t i = 0; i < dk; ++i) {
    q[i] = q[i] * rq * d.q_scale;
    k[i] = k[i] * rk;
  }

  const bool valid = a.valid[r] != 0;
  const int64_t rh = r * d.nv + h;
  const float beta = valid ? gdn::sigmoid(a.beta_raw[rh]) : 0.0f;
  const float g = valid ? l.a[h] * gdn::softplus(a.alpha_raw[rh] + l.dt_bias[h]) : 0.0f;
  const float decay = std::exp(g);
  float* S = l.ssm_state + rh * dk * dv;  // in place: each element is read before it is written
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) kv[j] += S[i * dv + j] * decay * k[i];
  for (int64_t j = 0; j < dv; ++j) delta[j] = beta * (v[j] - kv[j]);
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) {
      const float s = S[i * dv + j] * decay + k[i] * delta[j];
      S[i * dv + j] = s;
      o[j] += s * q[i];
    }

  float so = 0.0f;
  for (int64_t j = 0; j < dv; ++j) so += o[j] * o[j];
  const float ro = 1.0f / std::sqrt(so / static_cast<float>(dv) + d.eps);
  const float* z = a.z + rh * dv;
  float* y = a.y + rh * dv;
  for (int64_t j = 0; j < dv; ++j) y[j] = o[j] * ro * l.norm_w[j] * gdn::silu(z[j]);
}

}  // namespace

void gdn_step(const gdn::Dims& d, const gdn::Args& a) {
  const gdn::Layer l = gdn::layer_of(d, a);
  for (int64_t r = 0; r < d.b; ++r)
    for (int64_t c = 0; c < d.conv_dim; ++c)
      a.conv_out[r * d.conv_dim + c] =
          gdn::conv_shift(d, a.mixed + r * d.conv_dim, l.conv_state + r * (d.K - 1) * d.conv_dim,
                          l.conv_w, c, a.valid[r] != 0);
  auto task = [&](int64_t t) { head(d, a, l, t / d.nv, t % d.nv); };
  parallel_for(d.b * d.nv, task);
}

}  // namespace jaxvt::cpu
