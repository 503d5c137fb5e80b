// AVX2 + FMA + F16C fused dequantize-and-dot (compiled with -mavx2 -mfma -mf16c; called only
// after kernels_cpu.cc has checked the CPU). Everything but avx2::gemv_rows has internal linkage
// so no AVX2 code can leak into the portable part through an inline function.
//
// Per 32-element unit with scale d1 and offset m1 (w = d1*q - m1 or similar), the row sum is
// accumulated as d1 * sum(q*x) in 8-wide float32 vectors, and the offset term as
// m1 * sum(x) from partial sums of x precomputed once per call (Batch::s16 / s32).
// With one batch row two accumulators alternate between units to hide FMA latency.
#include <immintrin.h>

#include <cstdint>

#define JAXVT_FORMATS_INTERNAL_LINKAGE 1
#include "common/formats.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu::avx2 {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline void i8x16_to_f(__m128i v, __m256* f) {
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}
// Bytes p[0..7] zero-extended to 8 int32 lanes (one shuffle uop, its load folded in).
inline __m256i zx8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 lo_nib(__m256i v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))); }
inline __m256 hi_nib(__m256i v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
inline __m256 dot4(const __m256* q, const float* x) {
  __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
  t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), t);
  t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), t);
  return _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), t);
}

// State of one output row for NB batch rows: NA alternating vector accumulators per batch row,
// plus the offset terms (scalar and vector) scaled by the format's constant at the end.
template <int NB>
struct Acc {
  static constexpr int NA = NB == 1 ? 2 : 1;
  __m256 v[NB * NA];
  __m256 mv[NB];
  float ms[NB][2];  // alternating scalar chains (a single one would bound a block to FMA latency)
  void zero() {
    for (int i = 0; i < NB * NA; ++i) v[i] = _mm256_setzero_ps();
    for (int b = 0; b < NB; ++b) { mv[b] = _mm256_setzero_ps(); ms[b][0] = ms[b][1] = 0.f; }
  }
  __m256& at(int b, int64_t u) { return v[b * NA + (NA == 1 ? 0 : (u & 1))]; }
  float total(int b, float mscale) {
    __m256 s = v[b * NA];
    if (NA == 2) s = _mm256_add_ps(s, v[b * NA + 1]);
    return hsum(s) + mscale * ((ms[b][0] + ms[b][1]) + hsum(mv[b]));
  }
};

// Each format: static constexpr float kM (offset-term scale) and
// block(kb, kb_index, x[NB], s16[NB], s32[NB], acc) for one k-block.
struct F32 {
  static constexpr float kM = 0.f;
  template <int NB>
  static void block(const uint8_t* kb, int64_t i, const float* const* x, const float* const*,
                    const float* const*, Acc<NB>& a) {
    const float* w = reinterpret_cast<const float*>(kb);
    __m256 q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_loadu_ps(w + 8 * j);
    for (int b = 0; b < NB; ++b) a.at(b, i) = _mm256_add_ps(a.at(b, i), dot4(q, x[b] + 32 * i));
  }
};
struct F16 {
  static constexpr float kM = 0.f;
  template <int NB>
  static void block(const uint8_t* kb, int64_t i, const float* const* x, const float* const*,
                    const float* const*, Acc<NB>& a) {
    __m256 q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kb + 16 * j)));
    for (int b = 0; b < NB; ++b) a.at(b, i) = _mm256_add_ps(a.at(b, i), dot4(q, x[b] + 32 * i));
  }
};
struct BF16 {
  static constexpr float kM = 0.f;
  template <int NB>
  static void block(const uint8_t* kb, int64_t i, const float* const* x, const float* const*,
                    const float* const*, Acc<NB>& a) {
    __m256 q[4];
    for (int j = 0; j < 4; ++j) {
      __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kb + 16 * j)));
      q[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    for (int b = 0; b < NB; ++b) a.at(b, i) = _mm256_add_ps(a.at(b, i), dot4(q, x[b] + 32 * i));
  }
};
// Q4_0: d*(q-8) -> d*sum(q x) - 8 d sum(x).
struct Q4_0 {
  static constexpr float kM = -8.f;
  template <int NB>
  static void block(const uint8_t* kb, int64_t i, const float* const* x, const float* const*,
                    const float* const* s32, Acc<NB>& a) {
    const float d = h2f(kb);
    const __m256i v0 = zx8(kb + 2), v1 = zx8(kb + 10);
    __m256 q[4] = {lo_nib(v0), lo_nib(v1), hi_nib(v0), hi_nib(v1)};
    const __m256 dv = _mm256_set1_ps(d);
    for (int b = 0; b < NB; ++b) {
      a.at(b, i) = _mm256_fmadd_ps(dv, dot4(q, x[b] + 32 * i), a.at(b, i));
      a.ms[b][i & 1] += d * s32[b][i];
    }
  }
};
// Q4_1: d*q + m -> d*sum(q x) + m sum(x).
struct Q4_1 {
  static constexpr float kM = 1.f;
  template <int NB>
  static void block(const uint8_t* kb, int64_t i, const float* const* x, const float* const*,
                    const float* const* s32, Acc<NB>& a) {
    const float d = h2f(kb), m = h2f(kb + 2);
    const __m256i v0 = zx8(kb + 4), v1 = zx8(kb + 12);
    __m256 q[4] = {lo_nib(v0), lo_nib(v1), hi_nib(v0), hi_nib(v1)};
    const __m256 dv = _mm256_set1_ps(d);
    for (int b = 0; b < NB; ++b) {
      a.at(b, i) = _mm256_fmadd_ps(dv, dot4(q, x[b] + 32 * i), a.at(b, i));
      a.ms[b][i & 1] += m * s32[b][i];
    }
  }
};
struct Q8_0 {
  static constexpr float kM = 0.f;
  template <int NB>
  static void block(const uint8_t* kb, int64_t i, const float* const* x, const float* const*,
                    const float* const*, Acc<NB>& a) {
    const __m256 dv = _mm256_set1_ps(h2f(kb));
    __m256 q[4];
    i8x16_to_f(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kb + 2)), q);
    i8x16_to_f(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kb + 18)), q + 2);
    for (int b = 0; b < NB; ++b)
      a.at(b, i) = _mm256_fmadd_ps(dv, dot4(q, x[b] + 32 * i), a.at(b, i));
  }
};

// Q4_K / Q5_K: 8 sub-blocks of 32, w = (d*sc)*q - (dmin*m); offset term vectorized over the
// block's 8 sub-blocks against s32.
template <bool kFive>
struct QK45 {
  static constexpr float kM = -1.f;
  template <int NB>
  static void block(const uint8_t* kb, int64_t i, const float* const* x, const float* const*,
                    const float* const* s32, Acc<NB>& a) {
    const float d = h2f(kb), dmin = h2f(kb + 2);
    alignas(32) float dsc[8], mmn[8];
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      k4_scale_min(kb + 4, j, &sc, &mn);
      dsc[j] = d * static_cast<float>(sc);
      mmn[j] = dmin * static_cast<float>(mn);
    }
    const uint8_t* qs = kb + (kFive ? 48 : 16);
    const uint8_t* qh = kb + 16;
    const __m256i sixteen = _mm256_set1_epi32(16);
    for (int g = 0; g < 4; ++g) {  // units 2g (low nibbles) and 2g+1 (high nibbles)
      __m256 q0[4], q1[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = zx8(qs + 32 * g + 8 * j);
        __m256i n0 = _mm256_and_si256(v, _mm256_set1_epi32(15)), n1 = _mm256_srli_epi32(v, 4);
        if (kFive) {  // bit u of qh[l] is bit 4 of element l of unit u
          const __m256i h = zx8(qh + 8 * j);
          n0 = _mm256_or_si256(n0, _mm256_and_si256(
              2 * g <= 4 ? _mm256_slli_epi32(h, 4 - 2 * g) : _mm256_srli_epi32(h, 2 * g - 4), sixteen));
          n1 = _mm256_or_si256(n1, _mm256_and_si256(
              2 * g + 1 <= 4 ? _mm256_slli_epi32(h, 3 - 2 * g) : _mm256_srli_epi32(h, 2 * g - 3), sixteen));
        }
        q0[j] = _mm256_cvtepi32_ps(n0);
        q1[j] = _mm256_cvtepi32_ps(n1);
      }
      const __m256 d0 = _mm256_set1_ps(dsc[2 * g]), d1 = _mm256_set1_ps(dsc[2 * g + 1]);
      for (int b = 0; b < NB; ++b) {
        const float* xb = x[b] + 256 * i + 64 * g;
        __m256& a0 = a.at(b, 0);
        a0 = _mm256_fmadd_ps(d0, dot4(q0, xb), a0);
        __m256& a1 = a.at(b, 1);
        a1 = _mm256_fmadd_ps(d1, dot4(q1, xb + 32), a1);
      }
    }
    const __m256 mv = _mm256_load_ps(mmn);
    for (int b = 0; b < NB; ++b) a.mv[b] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(s32[b] + 8 * i), a.mv[b]);
  }
};

// Q6_K: 16 sub-blocks of 16, w = (d*sc)*(q-32) -> (d*sc)*sum(q x) - 32 (d*sc) sum(x).
struct Q6K {
  static constexpr float kM = -32.f;
  template <int NB>
  static void block(const uint8_t* kb, int64_t i, const float* const* x, const float* const* s16,
                    const float* const*, Acc<NB>& a) {
    const float d = h2f(kb + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(kb + 192);
    alignas(32) float ds[16];
    for (int j = 0; j < 16; ++j) ds[j] = d * static_cast<float>(sc[j]);
    const __m256i m15 = _mm256_set1_epi32(15), m48 = _mm256_set1_epi32(48);
    for (int h = 0; h < 2; ++h) {  // 128 elements: units 4h + qq, qq = 0..3
      const uint8_t* ql = kb + 64 * h;
      const uint8_t* qh = kb + 128 + 32 * h;
      __m256 q[4][4];
      for (int j = 0; j < 4; ++j) {  // elements 8j..8j+7 of each of the four units
        const __m256i l0 = zx8(ql + 8 * j), l1 = zx8(ql + 32 + 8 * j), hb = zx8(qh + 8 * j);
        q[0][j] = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_and_si256(_mm256_slli_epi32(hb, 4), m48)));
        q[1][j] = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_and_si256(_mm256_slli_epi32(hb, 2), m48)));
        q[2][j] = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(l0, 4), _mm256_and_si256(hb, m48)));
        q[3][j] = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(l1, 4), _mm256_and_si256(_mm256_srli_epi32(hb, 2), m48)));
      }
      for (int qq = 0; qq < 4; ++qq) {
        const __m256 d0 = _mm256_set1_ps(ds[8 * h + 2 * qq]), d1 = _mm256_set1_ps(ds[8 * h + 2 * qq + 1]);
        for (int b = 0; b < NB; ++b) {
          const float* xb = x[b] + 256 * i + 128 * h + 32 * qq;
          __m256 t0 = _mm256_fmadd_ps(q[qq][1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(q[qq][0], _mm256_loadu_ps(xb)));
          __m256 t1 = _mm256_fmadd_ps(q[qq][3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(q[qq][2], _mm256_loadu_ps(xb + 16)));
          __m256& acc = a.at(b, qq);
          acc = _mm256_fmadd_ps(d0, t0, acc);
          acc = _mm256_fmadd_ps(d1, t1, acc);
        }
      }
    }
    const __m256 dv0 = _mm256_load_ps(ds), dv1 = _mm256_load_ps(ds + 8);
    for (int b = 0; b < NB; ++b) {
      a.mv[b] = _mm256_fmadd_ps(dv0, _mm256_loadu_ps(s16[b] + 16 * i), a.mv[b]);
      a.mv[b] = _mm256_fmadd_ps(dv1, _mm256_loadu_ps(s16[b] + 16 * i + 8), a.mv[b]);
    }
  }
};

template <class K, int NB>
void rows_nb(const uint8_t* w, int64_t kbb, int64_t nkb, const Batch& bt, int64_t b0, int64_t r0,
             int64_t r1) {
  const float* x[NB];
  const float* s16[NB];
  const float* s32[NB];
  for (int b = 0; b < NB; ++b) {
    x[b] = bt.x[b0 + b];
    s16[b] = bt.s16[b0 + b];
    s32[b] = bt.s32[b0 + b];
  }
  const int64_t rb = nkb * kbb;
  Acc<NB> a;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * rb;
    a.zero();
    for (int64_t i = 0; i < nkb; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(row + (i + 8) * kbb), _MM_HINT_T0);
      K::template block<NB>(row + i * kbb, i, x, s16, s32, a);
    }
    for (int b = 0; b < NB; ++b) bt.y[b0 + b][r] = a.total(b, K::kM);
  }
}

template <class K>
void rows(const uint8_t* w, int64_t kbb, int64_t nkb, const Batch& bt, int64_t r0, int64_t r1) {
  // Batch rows in groups of up to 4 (registers); the weight row stays in L1 between groups.
  constexpr int64_t kRowTile = 16;
  for (int64_t ra = r0; ra < r1; ra += kRowTile) {
    const int64_t rz = ra + kRowTile < r1 ? ra + kRowTile : r1;
    int64_t b = 0;
    for (; b + 4 <= bt.n; b += 4) rows_nb<K, 4>(w, kbb, nkb, bt, b, ra, rz);
    switch (bt.n - b) {
      case 3: rows_nb<K, 3>(w, kbb, nkb, bt, b, ra, rz); break;
      case 2: rows_nb<K, 2>(w, kbb, nkb, bt, b, ra, rz); break;
      case 1: rows_nb<K, 1>(w, kbb, nkb, bt, b, ra, rz); break;
      default: break;
    }
  }
}

}  // namespace

bool gemv_rows(int fmt, const uint8_t* w, int64_t cols, const Batch& bt, int64_t r0, int64_t r1) {
  const int64_t kbb = kblock_bytes(fmt), nkb = cols / kblock_elems(fmt);
  switch (fmt) {
    case kF32: rows<F32>(w, kbb, nkb, bt, r0, r1); return true;
    case kF16: rows<F16>(w, kbb, nkb, bt, r0, r1); return true;
    case kBF16: rows<BF16>(w, kbb, nkb, bt, r0, r1); return true;
    case kQ4_0: rows<Q4_0>(w, kbb, nkb, bt, r0, r1); return true;
    case kQ4_1: rows<Q4_1>(w, kbb, nkb, bt, r0, r1); return true;
    case kQ8_0: rows<Q8_0>(w, kbb, nkb, bt, r0, r1); return true;
    case kQ4_K: rows<QK45<false>>(w, kbb, nkb, bt, r0, r1); return true;
    case kQ5_K: rows<QK45<true>>(w, kbb, nkb, bt, r0, r1); return true;
    case kQ6_K: rows<Q6K>(w, kbb, nkb, bt, r0, r1); return true;
    default: return false;
  }
}

}  // namespace jaxvt::cpu::avx2
