// The prompt recipe of attend_one (tinyBLAS products, f16 cache) for a block of query tokens and
// the G query heads of one kv head, as register tiles: the same float32 operations on every
// output in the same order as attend_one_v, so the same bits, with far fewer loads and
// conversions. Included by kernels_cpu_ggml_avx2.cc after ggml_attn_avx2.h.
//
// Both products are tinyBLAS's A.B^T: one 8-lane accumulator per output over steps of 8 of the
// reduced dimension, then ggml's hsum. KQ reduces over the head dim (A = the G q rows of a token,
// B = K rows, which the caller gathers contiguous once per call); KQV reduces over positions
// (A = the G probability rows, B = rows of V^T, which the caller transposes once per call):
// lane l of an output's accumulator then sums the positions s = l (mod 8) in order, the lane
// attend_one_v gives position s. A tile of MR rows x NR columns loads each B vector (and converts
// it from f16) once for MR rows. Only the positions up to each token's last are computed; the
// KQV's last block of 8 masks V^T's lanes past it, so the positions it adds there are exactly
// 0 * 0 (a zero added to a nonzero sum leaves it as it is, as attend_one_v's stop at the last
// position).
namespace {

// hsum8 of four registers at once, ggml's order in each lane: out[j] = hsum8(a_j).
inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  auto half = [](__m256 x) {
    return _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  };
  const __m128 x0 = half(a0), x1 = half(a1), x2 = half(a2), x3 = half(a3);  // [r0 r1 r2 r3]
  const __m128 y01 = _mm_add_ps(_mm_shuffle_ps(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)));  // r0+r2, r1+r3
  const __m128 y23 = _mm_add_ps(_mm_shuffle_ps(x2, x3, _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm_shuffle_ps(x2, x3, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm_add_ps(_mm_shuffle_ps(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m256 ldh(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// out[r * os + j] = f * hsum8(acc[r][j]) for j < NR (f == 1: the plain sum).
template <int MR, int NR>
inline void put_tile(const __m256 (&acc)[MR][NR], float f, float* out, int64_t os) {
  for (int r = 0; r < MR; ++r) {
    if constexpr (NR == 4) {
      const __m128 s = hsum8x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      _mm_storeu_ps(out + r * os, f == 1.f ? s : _mm_mul_ps(s, _mm_set1_ps(f)));
    } else {
      for (int j = 0; j < NR; ++j)
        out[r * os + j] = f == 1.f ? hsum8(acc[r][j]) : hsum8(acc[r][j]) * f;
    }
  }
}

// KQ: w[r * ws + j] = scale * (q_r . k_j), q_r = q + r * D (f16-rounded floats), k_j = k0 + j *
// kstride (f16 bits); D % 8 == 0.
template <int MR, int NR>
__attribute__((always_inline)) inline void kq_tile(const float* q, int64_t D, const uint16_t* k0,
                                                   int64_t kstride, float scale, float* w,
                                                   int64_t ws) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8)
    for (int j = 0; j < NR; ++j) {  // one B register at a time: the tile's accumulators fit
      const __m256 kv = ldh(k0 + j * kstride + i);
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + r * D + i), acc[r][j]);
    }
  put_tile<MR, NR>(acc, scale, w, ws);
}

// KQV: out[r * os + j] = sum over s < n8 of vt_j[s] * w_r[s] (lane s % 8, then hsum8), vt_j = vt
// + j * vts (f16 bits), w_r = w + r * ws; the block from n8 - 8 has its lanes past `keep` zeroed
// in vt.
template <int MR, int NC>
void pv_tile(const float* w, int64_t ws, const uint16_t* vt, int64_t vts, int64_t n8, __m256 keep,
             float* out, int64_t os) {
  __m256 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NC; ++j) acc[r][j] = _mm256_setzero_ps();
  auto step = [&](int64_t s, bool tail) __attribute__((always_inline)) {
    for (int j = 0; j < NC; ++j) {
      __m256 vv = ldh(vt + j * vts + s);
      if (tail) vv = _mm256_and_ps(vv, keep);
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm256_fmadd_ps(vv, _mm256_loadu_ps(w + r * ws + s), acc[r][j]);
    }
  };
  int64_t s = 0;
  for (; s + 8 < n8; s += 8) step(s, false);
  step(s, true);
  put_tile<MR, NC>(acc, 1.f, out, os);
}

// The tiles for mr in 1..3 rows and nr in 1..4 columns.
template <int MR>
void kq_tiles(const float* q, int64_t D, const uint16_t* k0, int64_t kstride, float scale,
              float* w, int64_t ws, int64_t last) {
  int64_t s = 0;
  for (; s + 4 <= last + 1; s += 4)
    kq_tile<MR, 4>(q, D, k0 + s * kstride, kstride, scale, w + s, ws);
  const uint16_t* k = k0 + s * kstride;
  switch (last + 1 - s) {
    case 3: return kq_tile<MR, 3>(q, D, k, kstride, scale, w + s, ws);
    case 2: return kq_tile<MR, 2>(q, D, k, kstride, scale, w + s, ws);
    case 1: return kq_tile<MR, 1>(q, D, k, kstride, scale, w + s, ws);
    default: return;
  }
}

template <int MR>
void pv_tiles(const float* w, int64_t ws, const uint16_t* vt, int64_t vts, int64_t n8,
              __m256 keep, int64_t Dv, float* out, int64_t os) {
  int64_t c = 0;
  for (; c + 4 <= Dv; c += 4) pv_tile<MR, 4>(w, ws, vt + c * vts, vts, n8, keep, out + c, os);
  const uint16_t* v = vt + c * vts;
  switch (Dv - c) {
    case 3: return pv_tile<MR, 3>(w, ws, v, vts, n8, keep, out + c, os);
    case 2: return pv_tile<MR, 2>(w, ws, v, vts, n8, keep, out + c, os);
    case 1: return pv_tile<MR, 1>(w, ws, v, vts, n8, keep, out + c, os);
    default: return;
  }
}

// soft_max of w[0..last] in place as attend_one_v's (max in position order, exp in blocks of
// 8, block sums in double, times float(1/sum), rounded to f16), then zeros up to the block end.
inline void softmax_row(float* w, int64_t last) {
  // The max in lanes, then across them: the same value as in position order, but for which of
  // +0 and -0 a zero max is, which changes no bit below (w - mx is then +-0 only where w is, and
  // v_expf8 gives 1 for both).
  __m256 m4[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                  _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
  int64_t s = 0;
  for (; s + 32 <= last + 1; s += 32)
    for (int j = 0; j < 4; ++j) m4[j] = _mm256_max_ps(_mm256_loadu_ps(w + s + 8 * j), m4[j]);
  for (; s <= last; s += 8)
    m4[0] = _mm256_max_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(w + s),
                                           _mm256_castsi256_ps(first_lanes(last + 1 - s))),
                          m4[0]);
  const __m256 m8 = _mm256_max_ps(_mm256_max_ps(m4[0], m4[1]), _mm256_max_ps(m4[2], m4[3]));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float mx = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const double sum = exp_sum<true>(w, last, mx);
  const __m256 invv = _mm256_set1_ps(static_cast<float>(1.0 / sum));
  for (int64_t s0 = 0; s0 <= last; s0 += 8)
    _mm256_storeu_ps(w + s0, round_half8(_mm256_mul_ps(_mm256_loadu_ps(w + s0), invv)));
}

}  // namespace

// Query tokens [t0, t1) of row bi, query heads kh * G .. kh * G + G - 1, the prompt recipe with
// an f16 cache (attn_recipe's tiny_kq and tiny_v); kb: this (row, kv head)'s K rows, D apart; vt:
// its V^T, Dv rows of vts >= every token's last + 1 positions (rounded up to 8) apart.
void attention_block(const AttnArgs& a, int64_t bi, int64_t kh, int64_t t0, int64_t t1,
                     const uint16_t* kb, const uint16_t* vt, int64_t vts) {
  thread_local std::vector<float> scratch;
  const int64_t G = a.H / a.K, D = a.D, Dv = a.Dv;
  const int64_t kstride = D;
  for (int64_t ti = t0; ti < t1; ++ti) {
    float* out = a.o + ((bi * a.T + ti) * a.H + kh * G) * Dv;  // G heads, Dv apart
    const int64_t p = a.pos[bi * a.T + ti];
    const int64_t last = p < a.kv_len - 1 ? p : a.kv_len - 1;
    if (ti >= a.nq[bi] || last < 0) {  // padding, or a position that sees nothing: zeros
      for (int64_t c = 0; c < G * Dv; ++c) out[c] = 0.f;
      continue;
    }
    const int64_t n8 = (last + 8) & ~int64_t{7};
    if (static_cast<int64_t>(scratch.size()) < G * (D + n8)) scratch.resize(G * (D + n8));
    float* q = scratch.data();  // [G, D]
    float* w = q + G * D;       // [G, n8]
    const float* qs = a.q + ((bi * a.T + ti) * a.H + kh * G) * D;
    for (int64_t d = 0; d < G * D; d += 8)
      _mm256_storeu_ps(q + d, round_half8(_mm256_loadu_ps(qs + d)));
    const __m256 keep = _mm256_castsi256_ps(first_lanes(last + 1 - (n8 - 8)));
    for (int64_t r0 = 0; r0 < G; r0 += 3) {
      const float* qr = q + r0 * D;
      float* wr = w + r0 * n8;
      switch (G - r0 < 3 ? G - r0 : 3) {
        case 3: kq_tiles<3>(qr, D, kb, kstride, a.scale, wr, n8, last); break;
        case 2: kq_tiles<2>(qr, D, kb, kstride, a.scale, wr, n8, last); break;
        default: kq_tiles<1>(qr, D, kb, kstride, a.scale, wr, n8, last); break;
      }
      for (int64_t r = r0; r < r0 + 3 && r < G; ++r) softmax_row(w + r * n8, last);
      switch (G - r0 < 3 ? G - r0 : 3) {
        case 3: pv_tiles<3>(wr, n8, vt, vts, n8, keep, Dv, out + r0 * Dv, Dv); break;
        case 2: pv_tiles<2>(wr, n8, vt, vts, n8, keep, Dv, out + r0 * Dv, Dv); break;
        default: pv_tiles<1>(wr, n8, vt, vts, n8, keep, Dv, out + r0 * Dv, Dv); break;
      }
    }
  }
}
