// Phase 2 of the fused Gated DeltaNet step on the CPU (gdn.h has the math): the recurrent step of
// value heads [t0, t1) of the rows (task t: row t / nv, head t % nv). Included inside a namespace
// by kernels_cpu_gdn.cc (portable) and kernels_cpu_gdn_avx2.cc (-mavx2, -ffp-contract=off like
// every CPU unit): the column loops over dv vectorize, each element's operations stay those
// written here, and every sum over dk, dv runs serially, so both builds give the same bits. Not
// a standalone header.

inline void gdn_head(const gdn::Dims& d, const gdn::Args& a, const gdn::Layer& l, int64_t r,
                     int64_t h) {
  const int64_t dk = d.dk, dv = d.dv, kh = gdn::key_head(d, h);
  float x[3 * gdn::kMaxDim], kv[gdn::kMaxDim], delta[gdn::kMaxDim], o[gdn::kMaxDim];
  for (int64_t i = 0; i < 2 * dk + dv; ++i)
    x[i] = a.conv_out[r * d.conv_dim + gdn::channel(d, h, kh, i)];
  float* q = x;
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
  float* __restrict__ S = l.ssm_state + rh * dk * dv;  // in place: read before written
  for (int64_t j = 0; j < dv; ++j) kv[j] = 0.0f, o[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i];
    const float* __restrict__ Si = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) kv[j] += Si[j] * decay * ki;
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = beta * (v[j] - kv[j]);
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i], qi = q[i];
    float* __restrict__ Si = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      const float s = Si[j] * decay + ki * delta[j];
      Si[j] = s;
      o[j] += s * qi;
    }
  }

  float so = 0.0f;
  for (int64_t j = 0; j < dv; ++j) so += o[j] * o[j];
  const float ro = 1.0f / std::sqrt(so / static_cast<float>(dv) + d.eps);
  const float* z = a.z + rh * dv;
  float* y = a.y + rh * dv;
  for (int64_t j = 0; j < dv; ++j) y[j] = o[j] * ro * l.norm_w[j] * gdn::silu(z[j]);
}

inline void gdn_heads(const gdn::Dims& d, const gdn::Args& a, const gdn::Layer& l, int64_t t0,
                      int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) gdn_head(d, a, l, t / d.nv, t % d.nv);
}
