// attend_one (ggml_ops_impl.h) written with AVX2+FMA+F16C intrinsics: the same float32 operations
// in the same order, so the same bits. Included by kernels_cpu_ggml_avx2.cc inside its namespace,
// after ggml_ops_impl.h (attn_recipe, round_half, cache_val).
//
// The portable body converts f16 one element at a time in software and walks V a column at a
// time (a stride of K*Dv elements per step), which makes a long prompt's attention the bulk of
// its prefill. Here each lane of ggml's 8-lane accumulators is one register lane:
// - KQ: one key row's dot product in registers (4 rows interleaved: independent chains);
// - softmax: ggml_v_expf on 8 scores at a time;
// - KQV: 8 output columns at a time, one register per ggml lane (s % 8, or (s / 8) % 4 and
//   s % 8), so V is read a row at a time; the reductions are ggml's hsum / REDUCE per column.
namespace {

template <bool kHalf>
inline __m256 ld8(const void* p, int64_t i) {
  if constexpr (kHalf)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

inline __m256 round_half8(__m256 x) {  // to f16 (nearest even) and back, as round_half
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

using avx2_sums::hsum8;
using avx2_sums::reduce32;

// hsum8 of eight registers, lane by lane: out[c] = hsum8({A[0][c], ..., A[7][c]}).
inline __m256 hsum8_cols(const __m256 (&A)[8]) {
  const __m256 r0 = _mm256_add_ps(A[4], A[0]), r1 = _mm256_add_ps(A[5], A[1]);
  const __m256 r2 = _mm256_add_ps(A[6], A[2]), r3 = _mm256_add_ps(A[7], A[3]);
  return _mm256_add_ps(_mm256_add_ps(r0, r2), _mm256_add_ps(r1, r3));
}

// reduce32 of 32 registers, lane by lane: out[c] = reduce32({{A[j][l][c]}}).
inline __m256 reduce32_cols(const __m256 (&A)[4][8]) {
  __m256 x[8];
  for (int l = 0; l < 8; ++l)
    x[l] = _mm256_add_ps(_mm256_add_ps(A[0][l], A[2][l]), _mm256_add_ps(A[1][l], A[3][l]));
  const __m256 t0 = _mm256_add_ps(x[0], x[4]), t1 = _mm256_add_ps(x[1], x[5]);
  const __m256 t2 = _mm256_add_ps(x[2], x[6]), t3 = _mm256_add_ps(x[3], x[7]);
  return _mm256_add_ps(_mm256_add_ps(t0, t1), _mm256_add_ps(t2, t3));
}

// ggml_v_expf (AVX2+FMA), as v_expf lane by lane.
inline __m256 v_expf8(__m256 x) {
  const __m256 r = _mm256_set1_ps(0x1.8p23f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
  const __m256 n = _mm256_sub_ps(z, r);
  const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k = _mm256_castsi256_ps(
      _mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.f))));
  const __m256 an = _mm256_andnot_ps(_mm256_set1_ps(-0.f), n);
  const __m256 c = _mm256_cmp_ps(an, _mm256_set1_ps(126.f), _CMP_GT_OQ);
  const __m256 u = _mm256_mul_ps(b, b);
  const __m256 j = _mm256_fmadd_ps(
      _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b,
                                      _mm256_set1_ps(0x1.573e2ep-5f)),
                      u,
                      _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b,
                                      _mm256_set1_ps(0x1.fffdb6p-2f))),
      u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
  const __m256 plain = _mm256_fmadd_ps(j, k, k);
  if (!_mm256_movemask_ps(c)) return plain;
  const __m256i g = _mm256_and_si256(
      _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
      _mm256_set1_epi32(static_cast<int>(0x82000000u)));
  const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256 dd = _mm256_cmp_ps(an, _mm256_set1_ps(192.f), _CMP_GT_OQ);
  const __m256 big = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
  return _mm256_blendv_ps(_mm256_blendv_ps(plain, big, c), _mm256_mul_ps(s1, s1), dd);
}

// Lanes l < count set (count clamped into [0, 8]).
inline __m256i first_lanes(int64_t count) {
  const int c = static_cast<int>(count < 0 ? 0 : count > 8 ? 8 : count);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Scores w[s] = scale * q.k_s for s <= last, in the recipe's order; returns their max.
template <bool kHalf>
float scores(const uint8_t* kb, int64_t kstride, const float* qh, int64_t D, int64_t last,
             bool tiny, float scale, float* w) {
  float mx = -INFINITY;
  auto put = [&](int64_t s, float sc) {
    w[s] = sc * scale;
    mx = w[s] > mx ? w[s] : mx;
  };
  const size_t es = kHalf ? 2 : 4;
  int64_t s = 0;
  if (tiny) {  // one 8-lane accumulator over D (D % 8 == 0), four key rows at once
    for (; s + 4 <= last + 1; s += 4) {
      const uint8_t* k0 = kb + s * kstride * es;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + i);
        for (int r = 0; r < 4; ++r)
          acc[r] = _mm256_fmadd_ps(ld8<kHalf>(k0 + r * kstride * es, i), qv, acc[r]);
      }
      for (int r = 0; r < 4; ++r) put(s + r, hsum8(acc[r]));
    }
    for (; s <= last; ++s) {
      const uint8_t* k0 = kb + s * kstride * es;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8)
        acc = _mm256_fmadd_ps(ld8<kHalf>(k0, i), _mm256_loadu_ps(qh + i), acc);
      put(s, hsum8(acc));
    }
    return mx;
  }
  const int64_t np = D & ~int64_t{31};  // vec_dot: 4 x 8 lanes over steps of 32, tail in double
  for (; s <= last; ++s) {
    const uint8_t* k0 = kb + s * kstride * es;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < np; i += 32) {
      a0 = _mm256_fmadd_ps(ld8<kHalf>(k0, i), _mm256_loadu_ps(qh + i), a0);
      a1 = _mm256_fmadd_ps(ld8<kHalf>(k0, i + 8), _mm256_loadu_ps(qh + i + 8), a1);
      a2 = _mm256_fmadd_ps(ld8<kHalf>(k0, i + 16), _mm256_loadu_ps(qh + i + 16), a2);
      a3 = _mm256_fmadd_ps(ld8<kHalf>(k0, i + 24), _mm256_loadu_ps(qh + i + 24), a3);
    }
    double sum = reduce32(a0, a1, a2, a3);
    for (int64_t i = np; i < D; ++i) sum += static_cast<double>(cache_val<kHalf>(k0, i) * qh[i]);
    put(s, static_cast<float>(sum));
  }
  return mx;
}

// KQV, tinyBLAS order: out[c] = hsum8 over lanes s % 8 of fma chains. V is read a row at a time
// (every column block of row s, then row s + 1): accumulator A[s % 8][c / 8] holds ggml's lane
// s % 8 of the 8 columns of block c / 8.
constexpr int64_t kMaxBlocks = 32;  // Dv <= 256 in registers' worth of stack; wider: per block

template <bool kHalf>
void pv_tiny(const uint8_t* vb, int64_t vstride, const float* w, int64_t last, int64_t Dv,
             float* out) {
  const int64_t nb = Dv / 8 <= kMaxBlocks ? Dv / 8 : 0;
  if (nb) {
    alignas(32) __m256 A[8][kMaxBlocks];
    for (int l = 0; l < 8; ++l)
      for (int64_t cb = 0; cb < nb; ++cb) A[l][cb] = _mm256_setzero_ps();
    for (int64_t s = 0; s <= last; ++s) {
      const __m256 ws = _mm256_set1_ps(w[s]);
      __m256* acc = A[s & 7];
      const int64_t row = s * vstride;
      for (int64_t cb = 0; cb < nb; ++cb)
        acc[cb] = _mm256_fmadd_ps(ld8<kHalf>(vb, row + 8 * cb), ws, acc[cb]);
    }
    for (int64_t cb = 0; cb < nb; ++cb) {
      const __m256 cols[8] = {A[0][cb], A[1][cb], A[2][cb], A[3][cb],
                              A[4][cb], A[5][cb], A[6][cb], A[7][cb]};
      _mm256_storeu_ps(out + 8 * cb, hsum8_cols(cols));
    }
  }
  for (int64_t c0 = 8 * nb; c0 + 8 <= Dv; c0 += 8) {  // only where Dv / 8 > kMaxBlocks
    __m256 A[8];
    for (int l = 0; l < 8; ++l) A[l] = _mm256_setzero_ps();
    for (int64_t s = 0; s <= last; ++s)
      A[s & 7] = _mm256_fmadd_ps(ld8<kHalf>(vb, s * vstride + c0), _mm256_set1_ps(w[s]),
                                 A[s & 7]);
    _mm256_storeu_ps(out + c0, hsum8_cols(A));
  }
  for (int64_t c = Dv & ~int64_t{7}; c < Dv; ++c) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t s = 0; s <= last; ++s)
      acc[s & 7] = std::fma(cache_val<kHalf>(vb, s * vstride + c), w[s], acc[s & 7]);
    out[c] = hsum8(acc);
  }
}

// KQV, vec_dot order: accumulator (s / 8) % 4, lane s % 8 below np = n & ~31, then the rest
// added in double; 8 columns at a time.
template <bool kHalf>
void pv_vecdot(const uint8_t* vb, int64_t vstride, const float* w, int64_t last, int64_t n,
               int64_t Dv, float* out) {
  const int64_t np = n & ~int64_t{31};
  const int64_t lim = last + 1 < np ? last + 1 : np;
  int64_t c0 = 0;
  for (; c0 + 8 <= Dv; c0 += 8) {
    __m256 A[4][8];
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 8; ++l) A[j][l] = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 32 <= lim; s += 32)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 8; ++l) {
          const int64_t t = s + 8 * j + l;
          A[j][l] = _mm256_fmadd_ps(ld8<kHalf>(vb, t * vstride + c0), _mm256_set1_ps(w[t]),
                                    A[j][l]);
        }
    for (; s < lim; ++s)
      A[(s >> 3) & 3][s & 7] = _mm256_fmadd_ps(ld8<kHalf>(vb, s * vstride + c0),
                                               _mm256_set1_ps(w[s]), A[(s >> 3) & 3][s & 7]);
    __m256d t0 = _mm256_setzero_pd(), t1 = _mm256_setzero_pd();
    for (s = lim; s <= last; ++s) {
      const __m256 pr = _mm256_mul_ps(ld8<kHalf>(vb, s * vstride + c0), _mm256_set1_ps(w[s]));
      t0 = _mm256_add_pd(t0, _mm256_cvtps_pd(_mm256_castps256_ps128(pr)));
      t1 = _mm256_add_pd(t1, _mm256_cvtps_pd(_mm256_extractf128_ps(pr, 1)));
    }
    const __m256 r = reduce32_cols(A);
    const __m256d r0 = _mm256_cvtps_pd(_mm256_castps256_ps128(r));
    const __m256d r1 = _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1));
    const __m128 lo = _mm256_cvtpd_ps(_mm256_add_pd(r0, t0));
    const __m128 hi = _mm256_cvtpd_ps(_mm256_add_pd(r1, t1));
    _mm256_storeu_ps(out + c0, _mm256_set_m128(hi, lo));
  }
  for (int64_t c = c0; c < Dv; ++c) {
    float acc[4][8] = {};
    double tail = 0.0;
    for (int64_t s = 0; s <= last; ++s) {
      const float vv = cache_val<kHalf>(vb, s * vstride + c);
      if (s < np) {
        acc[(s >> 3) & 3][s & 7] = std::fma(vv, w[s], acc[(s >> 3) & 3][s & 7]);
      } else {
        tail += static_cast<double>(vv * w[s]);
      }
    }
    out[c] = static_cast<float>(static_cast<double>(reduce32(acc)) + tail);
  }
}

// soft_max's middle: w[s] = exp(w[s] - mx) for s <= last, in blocks of 8 (masked lanes give
// exactly 0), the block sums added in double; returns the sum. kWhole: each block is stored
// whole (zeros past last, up to the block's end), else only its lanes up to last.
template <bool kWhole>
double exp_sum(float* w, int64_t last, float mx) {
  double sum = 0.0;
  const __m256 mxv = _mm256_set1_ps(mx);
  for (int64_t s0 = 0; s0 <= last; s0 += 8) {
    const __m256i keep = first_lanes(last + 1 - s0);
    const __m256 e = _mm256_and_ps(v_expf8(_mm256_sub_ps(_mm256_loadu_ps(w + s0), mxv)),
                                   _mm256_castsi256_ps(keep));
    if constexpr (kWhole) _mm256_storeu_ps(w + s0, e);
    else _mm256_maskstore_ps(w + s0, keep, e);
    sum += static_cast<double>(hsum8(e));
  }
  return sum;
}

// attend_one with the loops above; scratch holds kv_len + D + 8 floats.
template <bool kHalf>
void attend_one_v(const AttnArgs& a, int64_t bi, int64_t ti, int64_t h, float* scratch) {
  const int64_t kvh = h / (a.H / a.K);
  const int64_t p = a.pos[bi * a.T + ti];
  const int64_t n = a.kv_len;
  const int64_t last = p < n - 1 ? p : n - 1;
  const AttnRecipe rc = attn_recipe(a, bi, kHalf);
  float* w = scratch;       // [n] (+ 8: a block's loads past the last score)
  float* qh = scratch + n + 8;  // [D]
  const float* qs = a.q + ((bi * a.T + ti) * a.H + h) * a.D;
  int64_t d = 0;
  if constexpr (kHalf)
    for (; d + 8 <= a.D; d += 8) _mm256_storeu_ps(qh + d, round_half8(_mm256_loadu_ps(qs + d)));
  for (; d < a.D; ++d) qh[d] = kHalf ? round_half(qs[d]) : qs[d];
  const size_t es = kHalf ? 2 : 4;
  const uint8_t* kb = static_cast<const uint8_t*>(a.k) + (bi * a.S * a.K + kvh) * a.D * es;
  const float mx = scores<kHalf>(kb, a.K * a.D, qh, a.D, last, rc.tiny_kq, a.scale, w);
  const double sum = exp_sum<false>(w, last, mx);
  const float inv = static_cast<float>(1.0 / sum);
  const __m256 invv = _mm256_set1_ps(inv);
  for (int64_t s0 = 0; s0 <= last; s0 += 8) {
    const __m256 pr = _mm256_mul_ps(_mm256_loadu_ps(w + s0), invv);
    _mm256_maskstore_ps(w + s0, first_lanes(last + 1 - s0), kHalf ? round_half8(pr) : pr);
  }
  const uint8_t* vb = static_cast<const uint8_t*>(a.v) + (bi * a.S * a.K + kvh) * a.Dv * es;
  float* out = a.o + ((bi * a.T + ti) * a.H + h) * a.Dv;
  if (rc.tiny_v) pv_tiny<kHalf>(vb, a.K * a.Dv, w, last, a.Dv, out);
  else pv_vecdot<kHalf>(vb, a.K * a.Dv, w, last, n, a.Dv, out);
}

}  // namespace
