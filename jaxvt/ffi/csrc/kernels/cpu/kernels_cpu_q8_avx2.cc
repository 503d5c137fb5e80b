// ggml-mode matrix-vector products, AVX2 + FMA + F16C (compiled with -mavx2 -mfma -mf16c
// -ffp-contract=off; called only after kernels_cpu.cc checked the CPU). Same float32 order as
// the portable path in kernels_cpu_q8.cc, which is ggml's: integer products by
// _mm256_maddubs_epi16 / _mm256_madd_epi16, 8 lane accumulators per output, ggml's horizontal
// sums. Several weight rows (batch 1) or activation rows (batch > 1) are interleaved: their
// accumulation chains are independent, so this changes no rounding.
#include <immintrin.h>

#include <cstdint>

#define JAXVT_FORMATS_INTERNAL_LINKAGE 1
#include "common/act.h"
#include "common/formats.h"
#include "kernels/cpu/avx2_sums.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu::avx2 {
namespace {

using avx2_sums::hsum8;
using avx2_sums::reduce32;
inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
inline float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline float f32at(const uint8_t* p) {
  float f;
  __builtin_memcpy(&f, p, 4);
  return f;
}
inline __m256i nibbles32(const uint8_t* p) {  // bytes 0..15: low nibbles, 16..31: high nibbles
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(b, _mm256_set1_epi8(15));
}
inline __m256 lanes_us(__m256i u, __m256i s) {  // unsigned x signed bytes -> 8 float lanes
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(u, s)));
}
inline __m256 lanes_ss(__m256i x, __m256i y) {  // signed x signed bytes -> 8 float lanes
  return lanes_us(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}

// ---- Q4_0 / Q4_1 / Q8_0: R weight rows x NB activation rows per pass -----------------------

template <int F>
inline __m256i wq(const uint8_t* wb) {
  if constexpr (F == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 2));
  if constexpr (F == kQ4_1) return nibbles32(wb + 4);
  return _mm256_sub_epi8(nibbles32(wb + 2), _mm256_set1_epi8(8));
}

template <int F, int R, int NB>
void tile_small(const uint8_t* w, int64_t rb, int64_t nkb, const uint8_t* const* a, float* const* y,
                int64_t r) {
  constexpr int kbb = F == kQ4_0 ? 18 : F == kQ4_1 ? 20 : 34;
  __m256 acc[R][NB];
  float summs[R][NB];
  for (int i = 0; i < R; ++i)
    for (int b = 0; b < NB; ++b) {
      acc[i][b] = _mm256_setzero_ps();
      summs[i][b] = 0.f;
    }
  for (int64_t ib = 0; ib < nkb; ++ib) {
    __m256i qa[NB];
    float da[NB], sa[NB];
    for (int b = 0; b < NB; ++b) {
      const uint8_t* ab = a[b] + ib * kQ8Bytes;
      qa[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + 8));
      da[b] = f32at(ab);
      sa[b] = f32at(ab + 4);
    }
    for (int i = 0; i < R; ++i) {
      const uint8_t* wb = w + (r + i) * rb + ib * kbb;
      _mm_prefetch(reinterpret_cast<const char*>(wb + 8 * kbb), _MM_HINT_T0);
      const __m256i q = wq<F>(wb);
      const float dw = h2f(wb);
      for (int b = 0; b < NB; ++b) {
        const __m256 xy = F == kQ8_0 || F == kQ4_0 ? lanes_ss(q, qa[b]) : lanes_us(q, qa[b]);
        acc[i][b] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da[b]), xy, acc[i][b]);
        if constexpr (F == kQ4_1) summs[i][b] = __builtin_fmaf(h2f(wb + 2), sa[b], summs[i][b]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int b = 0; b < NB; ++b)
      y[b][r + i] = F == kQ4_1 ? hsum8(acc[i][b]) + summs[i][b] : hsum8(acc[i][b]);
}

// ---- K formats: one weight row x NB activation rows -----------------------------------------

template <bool kFive, int NB>
void row_k45(const uint8_t* w, int64_t nkb, const uint8_t* const* a, float* const* y, int64_t r) {
  constexpr int kbb = kFive ? 176 : 144;
  float acc[NB], accm[NB];
  for (int b = 0; b < NB; ++b) acc[b] = accm[b] = 0.f;
  const __m256i m15 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < nkb; ++i) {
    const uint8_t* wb = w + (r * nkb + i) * kbb;
    _mm_prefetch(reinterpret_cast<const char*>(wb + 2 * kbb), _MM_HINT_T0);
    int sc[8], mn[8];
    for (int j = 0; j < 8; ++j) k4_scale_min(wb + 4, j, &sc[j], &mn[j]);
    const __m256i qh = kFive ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 16))
                             : _mm256_setzero_si256();
    __m256i q[8];
    for (int g = 0; g < 4; ++g) {
      const uint8_t* qs = wb + (kFive ? 48 : 16) + 32 * g;
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      q[2 * g] = _mm256_and_si256(bits, m15);
      q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m15);
      if (kFive) {
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * g + h;  // bit j of qh[e] -> bit 4 of element e
          const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, j), one);
          q[j] = _mm256_or_si256(q[j], _mm256_slli_epi16(hb, 4));
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint8_t* ab = a[b] + i * kQ8KBytes;
      __m256i sumi = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + 36 + 32 * j));
        const __m256i p16 = _mm256_maddubs_epi16(q[j], qa);
        const __m256i scv = _mm256_set1_epi16(static_cast<int16_t>(sc[j]));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p16, scv));
      }
      int summ = 0;
      for (int j = 0; j < 8; ++j) {
        int16_t b0, b1;
        __builtin_memcpy(&b0, ab + 4 + 4 * j, 2);
        __builtin_memcpy(&b1, ab + 6 + 4 * j, 2);
        summ += mn[j] * (b0 + b1);
      }
      const float ad = f32at(ab);
      const float d = ad * h2f(wb), dmin = -ad * h2f(wb + 2);
      acc[b] = __builtin_fmaf(d, static_cast<float>(hsum_i32(sumi)), acc[b]);
      accm[b] = __builtin_fmaf(dmin, static_cast<float>(summ), accm[b]);
    }
  }
  for (int b = 0; b < NB; ++b) y[b][r] = acc[b] + accm[b];
}

template <int NB>
void row_q6k(const uint8_t* w, int64_t nkb, const uint8_t* const* a, float* const* y, int64_t r) {
  float acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = 0.f;
  const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  for (int64_t i = 0; i < nkb; ++i) {
    const uint8_t* wb = w + (r * nkb + i) * 210;
    _mm_prefetch(reinterpret_cast<const char*>(wb + 420), _MM_HINT_T0);
    const int8_t* sc = reinterpret_cast<const int8_t*>(wb + 192);
    __m256i q[8];  // unit u = 4h + qq: elements 128h + 32qq .. +32, values 0..63
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + 32 * h));
      auto hi = [&](int sh) {
        return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, sh), m3), 4);
      };
      q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m15), hi(0));
      q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m15), hi(2));
      q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15), hi(4));
      q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), hi(6));
    }
    for (int b = 0; b < NB; ++b) {
      const uint8_t* ab = a[b] + i * kQ8KBytes;
      __m256i sumi = _mm256_setzero_si256();
      int corr = 0;
      for (int u = 0; u < 8; ++u) {
        const int s0 = sc[2 * u], s1 = sc[2 * u + 1];  // 8h + 2qq = 2u
        const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + 36 + 32 * u));
        const __m256i p16 = _mm256_maddubs_epi16(q[u], qa);
        const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(s1)),
                                             _mm_set1_epi16(static_cast<int16_t>(s0)));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p16, scv));
        int16_t b0, b1;
        __builtin_memcpy(&b0, ab + 4 + 4 * u, 2);
        __builtin_memcpy(&b1, ab + 6 + 4 * u, 2);
        corr += s0 * b0 + s1 * b1;
      }
      const float d = f32at(ab) * h2f(wb + 208);
      acc[b] = __builtin_fmaf(d, static_cast<float>(hsum_i32(sumi) - 32 * corr), acc[b]);
    }
  }
  for (int b = 0; b < NB; ++b) y[b][r] = acc[b];
}

// ---- F32 / F16 / BF16 -------------------------------------------------------------------------

template <int F>
inline __m256 ld8(const uint8_t* p) {
  if constexpr (F == kF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  if constexpr (F == kF16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

template <int F, int NB>
void row_float(const uint8_t* w, int64_t cols, const uint8_t* const* a, float* const* y,
               int64_t r) {
  constexpr int es = F == kF32 ? 4 : 2;
  const uint8_t* wr = w + r * cols * es;
  __m256 acc[NB][4];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < 4; ++j) acc[b][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < cols; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(wr + (i + 256) * es), _MM_HINT_T0);
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = ld8<F>(wr + (i + 8 * j) * es);
      for (int b = 0; b < NB; ++b)
        acc[b][j] = _mm256_fmadd_ps(wv, ld8<F>(a[b] + (i + 8 * j) * es), acc[b][j]);
    }
  }
  for (int b = 0; b < NB; ++b) y[b][r] = reduce32(acc[b][0], acc[b][1], acc[b][2], acc[b][3]);
}

// ---- dispatch ---------------------------------------------------------------------------------

template <int F, int NB>
void rows_nb(const uint8_t* w, int64_t cols, const uint8_t* const* a, float* const* y, int64_t r0,
             int64_t r1) {
  const int64_t rb = row_bytes(F, cols);
  int64_t r = r0;
  if constexpr (F == kQ4_0 || F == kQ4_1 || F == kQ8_0) {
    constexpr int R = NB == 1 ? 4 : NB == 2 ? 2 : 1;
    for (; r + R <= r1; r += R) tile_small<F, R, NB>(w, rb, cols / 32, a, y, r);
    for (; r < r1; ++r) tile_small<F, 1, NB>(w, rb, cols / 32, a, y, r);
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    for (; r < r1; ++r) row_k45<F == kQ5_K, NB>(w, cols / 256, a, y, r);
  } else if constexpr (F == kQ6_K) {
    for (; r < r1; ++r) row_q6k<NB>(w, cols / 256, a, y, r);
  } else {
    for (; r < r1; ++r) row_float<F, NB>(w, cols, a, y, r);
  }
}

// Many activation rows (a prefill) are taken in blocks of about 32 KiB (a multiple of 4 rows), each
// block against every tile of the task's weight rows: the block stays in L1/L2 while the task's
// weight rows (tens of KiB) are swept, instead of every activation row being streamed from the
// last-level cache once per tile of 16 weight rows. Each output is still one rows_nb chain (the
// groups of 4 activation rows and the remainder group are the same), so no bit changes.
template <int F>
void rows(const uint8_t* w, int64_t cols, const QBatch& bt, int64_t r0, int64_t r1) {
  constexpr int64_t kRowTile = 16;  // a tile of weight rows stays in L1 across batch groups
  const int64_t abytes = act_row_bytes(vec_type(F), cols);
  const int64_t fit = (int64_t{32} << 10) / (abytes > 0 ? abytes : 1);
  const int64_t block = fit < 4 ? 4 : fit & ~int64_t{3};
  for (int64_t b0 = 0; b0 < bt.n; b0 += block) {
    const int64_t bz = b0 + block < bt.n ? b0 + block : bt.n;
    for (int64_t ra = r0; ra < r1; ra += kRowTile) {
      const int64_t rz = ra + kRowTile < r1 ? ra + kRowTile : r1;
      int64_t b = b0;
      for (; b + 4 <= bz; b += 4) rows_nb<F, 4>(w, cols, bt.a + b, bt.y + b, ra, rz);
      switch (bz - b) {
        case 3: rows_nb<F, 3>(w, cols, bt.a + b, bt.y + b, ra, rz); break;
        case 2: rows_nb<F, 2>(w, cols, bt.a + b, bt.y + b, ra, rz); break;
        case 1: rows_nb<F, 1>(w, cols, bt.a + b, bt.y + b, ra, rz); break;
        default: break;
      }
    }
  }
}

}  // namespace

bool gemv_q8_rows(int fmt, const uint8_t* w, int64_t cols, const QBatch& bt, int64_t r0,
                  int64_t r1) {
  switch (fmt) {
    case kF32: rows<kF32>(w, cols, bt, r0, r1); return true;
    case kF16: rows<kF16>(w, cols, bt, r0, r1); return true;
    case kBF16: rows<kBF16>(w, cols, bt, r0, r1); return true;
    case kQ4_0: rows<kQ4_0>(w, cols, bt, r0, r1); return true;
    case kQ4_1: rows<kQ4_1>(w, cols, bt, r0, r1); return true;
    case kQ8_0: rows<kQ8_0>(w, cols, bt, r0, r1); return true;
    case kQ4_K: rows<kQ4_K>(w, cols, bt, r0, r1); return true;
    case kQ5_K: rows<kQ5_K>(w, cols, bt, r0, r1); return true;
    case kQ6_K: rows<kQ6_K>(w, cols, bt, r0, r1); return true;
    default: return false;
  }
}

}  // namespace jaxvt::cpu::avx2
