// Body of the ggml-exact CPU ops, included by kernels_cpu_ggml.cc twice: once portable and once
// compiled for AVX2+FMA+F16C (where the 8-lane loops below become single instructions). Both
// copies give the same bits: every fused multiply-add is an explicit std::fma and the units are
// compiled with -ffp-contract=off. The arithmetic mirrors llama.cpp's CPU backend as built for
// AVX2+FMA (see kernels_cpu_ggml.h for the op contracts). Included inside a namespace.

// ---- 8-lane helpers (a float[8] is one __m256 of ggml's code) ----------------------------------

inline float hsum8(const float* a) {  // ggml's hsum_float_8 / tinyBLAS hsum
  const float r0 = a[4] + a[0], r1 = a[5] + a[1], r2 = a[6] + a[2], r3 = a[7] + a[3];
  return (r0 + r2) + (r1 + r3);
}

inline float reduce32(const float (&acc)[4][8]) {  // GGML_F32x8_REDUCE
  float x[8];
  for (int l = 0; l < 8; ++l) x[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
  const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];
  return (t0 + t1) + (t2 + t3);
}

inline uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bitsf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ggml_v_expf (AVX2+FMA), one lane.
inline float v_expf(float x) {
  const float r = 0x1.8p23f;
  const float z = std::fma(x, 0x1.715476p+0f, r);
  const float n = z - r;
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  const uint32_t e = fbits(z) << 23;
  const float k = bitsf(e + fbits(1.f));
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, 0x1.ffffecp-1f * b);
  const float an = std::fabs(n);
  if (!(an > 126.f)) return std::fma(j, k, k);
  const uint32_t g = n <= 0.f ? 0x82000000u : 0u;
  const float s1 = bitsf(g + 0x7f000000u), s2 = bitsf(e - g);
  if (an > 192.f) return s1 * s1;
  return std::fma(s2, j, s2) * s1;
}

// ---- rms_norm -----------------------------------------------------------------------------------

inline void rms_norm_rows(const float* x, const float* w, int64_t d, float eps, float* y,
                          int64_t r0, int64_t r1) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* xi = x + i * d;
    float* yi = y + i * d;
    double sum = 0.0;
    for (int64_t j = 0; j < d; ++j) sum += static_cast<double>(xi[j] * xi[j]);
    const float mean = static_cast<float>(sum / static_cast<double>(d));
    const float scale = 1.0f / std::sqrt(mean + eps);
    if (w) {
      for (int64_t j = 0; j < d; ++j) yi[j] = (xi[j] * scale) * w[j];
    } else {
      for (int64_t j = 0; j < d; ++j) yi[j] = xi[j] * scale;
    }
  }
}

// ---- swiglu: silu(g) * u, 8 lanes from the start of each row, glibc expf on the tail ----------

inline void swiglu_rows(const float* g, const float* u, int64_t d, float* y, int64_t r0,
                        int64_t r1) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* gi = g + i * d;
    const float* ui = u + i * d;
    float* yi = y + i * d;
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
      for (int l = 0; l < 8; ++l) {
        const float x = gi[j + l];
        yi[j + l] = (x / (1.f + v_expf(0.f - x))) * ui[j + l];
      }
    for (; j < d; ++j) yi[j] = (gi[j] / (1.f + std::exp(-gi[j]))) * ui[j];
  }
}

// ---- rope (ggml_rope_ext, NORMAL or NEOX, no scaling) -------------------------------------------

inline void rope_tokens(const float* x, const int32_t* pos, int64_t nh, int64_t hd, int64_t n_dims,
                        float base, bool neox, float* y, int64_t t0, int64_t t1) {
  const float theta_scale = std::pow(base, -2.0f / static_cast<float>(n_dims));
  std::vector<float> cs(n_dims);
  for (int64_t t = t0; t < t1; ++t) {
    float theta = static_cast<float>(static_cast<int64_t>(pos[t]));
    for (int64_t i0 = 0; i0 < n_dims; i0 += 2) {
      cs[i0] = std::cos(theta);
      cs[i0 + 1] = std::sin(theta);
      theta *= theta_scale;
    }
    for (int64_t h = 0; h < nh; ++h) {
      const float* src = x + (t * nh + h) * hd;
      float* dst = y + (t * nh + h) * hd;
      const int64_t off = neox ? n_dims / 2 : 1;
      for (int64_t i0 = 0; i0 < n_dims; i0 += 2) {
        const int64_t ic = neox ? i0 / 2 : i0;
        const float c = cs[i0], s = cs[i0 + 1];
        const float x0 = src[ic], x1 = src[ic + off];
        dst[ic] = std::fma(x0, c, -(x1 * s));
        dst[ic + off] = std::fma(x0, s, x1 * c);
      }
      for (int64_t i = n_dims; i < hd; ++i) dst[i] = src[i];
    }
  }
}

// ---- attention (ggml's non-flash path: mul_mat, soft_max_ext, mul_mat) -------------------------

template <bool kHalf>
inline float cache_val(const void* p, int64_t i) {
  if constexpr (kHalf) return half_to_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// dot(a[0..n), b[0..n)) in ggml's order: tinyBLAS (one 8-lane accumulator) or vec_dot (4 x 8
// lanes over steps of 32, leftovers added in double).
template <bool kHalf>
inline float dot_kq(const void* k, const float* q, int64_t n, bool tiny) {
  if (tiny) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < n; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] = std::fma(cache_val<kHalf>(k, i + l), q[i + l], acc[l]);
    return hsum8(acc);
  }
  float acc[4][8] = {};
  const int64_t np = n & ~int64_t{31};
  for (int64_t i = 0; i < np; i += 32)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 8; ++l)
        acc[j][l] = std::fma(cache_val<kHalf>(k, i + 8 * j + l), q[i + 8 * j + l], acc[j][l]);
  double s = reduce32(acc);
  for (int64_t i = np; i < n; ++i) s += static_cast<double>(cache_val<kHalf>(k, i) * q[i]);
  return static_cast<float>(s);
}


// Query token ti of row bi is padding (ti >= nq[bi]: a bucketed prefill's tail): its output is
// zeros, not computed (nothing real reads it; at a long prompt's bucket it is a large share of
// the quadratic work). Writes the zeros and returns true for such a query.
inline bool padding_query(const AttnArgs& a, int64_t bi, int64_t ti, int64_t h) {
  if (ti < a.nq[bi]) return false;
  float* out = a.o + ((bi * a.T + ti) * a.H + h) * a.Dv;
  for (int64_t c = 0; c < a.Dv; ++c) out[c] = 0.f;
  return true;
}

// Which of ggml's orders row bi's two products take (attend_one and the AVX2 copy in
// kernels_cpu_ggml_avx2.cc read it from here, so both follow one rule). KQ: with an f16 cache q
// is converted to f16 and tinyBLAS runs the batched product; an f32 q stays permuted
// (non-contiguous), so ggml takes vec_dot_f32 for every batch size. KQV: tinyBLAS when batched.
struct AttnRecipe {
  bool tiny_kq, tiny_v;
};
inline AttnRecipe attn_recipe(const AttnArgs& a, int64_t bi, bool half) {
  const bool batched = a.nq[bi] >= 2;
  return {half && batched && a.D % 8 == 0, batched && a.kv_len % 8 == 0 && a.Dv % 4 == 0};
}

// One (row, token, head): o = softmax(scale * q.K^T + mask) V with ggml's roundings.
template <bool kHalf>
inline void attend_one(const AttnArgs& a, int64_t bi, int64_t ti, int64_t h, float* scratch) {
  const int64_t kvh = h / (a.H / a.K);
  const int64_t p = a.pos[bi * a.T + ti];
  const int64_t n = a.kv_len;
  const int64_t last = p < n - 1 ? p : n - 1;  // positions beyond are masked (exact zeros)
  float* w = scratch;                          // [n]
  float* qh = scratch + n;                     // [D]
  const float* qs = a.q + ((bi * a.T + ti) * a.H + h) * a.D;
  for (int64_t d = 0; d < a.D; ++d) qh[d] = kHalf ? round_half(qs[d]) : qs[d];
  const AttnRecipe rc = attn_recipe(a, bi, kHalf);
  const bool tiny_kq = rc.tiny_kq;
  const size_t es = kHalf ? 2 : 4;
  const uint8_t* kb = static_cast<const uint8_t*>(a.k) + (bi * a.S * a.K + kvh) * a.D * es;
  float mx = -INFINITY;
  for (int64_t s = 0; s <= last; ++s) {
    const float sc = dot_kq<kHalf>(kb + s * a.K * a.D * es, qh, a.D, tiny_kq);
    w[s] = sc * a.scale;
    mx = w[s] > mx ? w[s] : mx;
  }
  // soft_max: exp in blocks of 8 (masked lanes give exactly 0), block sums added in double.
  double sum = 0.0;
  const int64_t nb8 = (last + 8) / 8;
  for (int64_t blk = 0; blk < nb8; ++blk) {
    float e8[8];
    for (int l = 0; l < 8; ++l) {
      const int64_t s = 8 * blk + l;
      e8[l] = s <= last ? v_expf(w[s] - mx) : 0.f;
      if (s <= last) w[s] = e8[l];
    }
    sum += static_cast<double>(hsum8(e8));
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t s = 0; s <= last; ++s) {
    const float pr = w[s] * inv;
    w[s] = kHalf ? round_half(pr) : pr;
  }
  // KQV: tinyBLAS when batched (lane s % 8), else vec_dot (accumulator (s/32)... lane s % 8).
  const bool tiny_v = rc.tiny_v;
  const uint8_t* vb = static_cast<const uint8_t*>(a.v) + (bi * a.S * a.K + kvh) * a.Dv * es;
  float* out = a.o + ((bi * a.T + ti) * a.H + h) * a.Dv;
  const int64_t vstride = a.K * a.Dv;  // elements between positions
  for (int64_t d = 0; d < a.Dv; ++d) {
    if (tiny_v) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t s = 0; s <= last; ++s)
        acc[s & 7] = std::fma(cache_val<kHalf>(vb, s * vstride + d), w[s], acc[s & 7]);
      out[d] = hsum8(acc);
    } else {
      float acc[4][8] = {};
      const int64_t np = n & ~int64_t{31};
      double tail = 0.0;
      for (int64_t s = 0; s <= last; ++s) {
        const float vv = cache_val<kHalf>(vb, s * vstride + d);
        if (s < np) {
          acc[(s >> 3) & 3][s & 7] = std::fma(vv, w[s], acc[(s >> 3) & 3][s & 7]);
        } else {
          tail += static_cast<double>(vv * w[s]);
        }
      }
      out[d] = static_cast<float>(static_cast<double>(reduce32(acc)) + tail);
    }
  }
}
