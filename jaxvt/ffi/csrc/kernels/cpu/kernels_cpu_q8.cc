// ggml-mode matrix-vector products on the CPU, portable path (kernels_cpu_q8_avx2.cc has the
// AVX2 one; both give the same bits). Activations come converted to the weight format's vec-dot
// type (act.h); this file fixes the float32 order, which is that of ggml's AVX2 build:
//
//   Q4_0/Q8_0 x Q8_0, Q4_1 x Q8_1: per 32-block, 8 integer lanes of 4 consecutive products;
//     lane accumulators acc[l] = fma(d_w*d_a, lane, acc[l]) over the blocks of the row, then
//     ((acc4+acc0)+(acc6+acc2)) + ((acc5+acc1)+(acc7+acc3)); Q4_1 adds the chain
//     summs = fma(m_w, s_a, summs) last.
//   Q4_K/Q5_K/Q6_K x Q8_K: per 256-block the exact integer sum over sub-blocks of scale x
//     (sub-block integer dot) (and of min x bsums for Q4_K/Q5_K); acc = fma(d_a*d_w, sumi, acc),
//     accm = fma(-d_a*dmin_w, summ, accm); result acc + accm. (ggml's lanes differ here: the
//     K formats agree with llama.cpp to float32 rounding, not bit for bit.)
//   F32/F16/BF16: x rounded to the weight type, 4 accumulators of 8 lanes over 32-element steps
//     (fma), reduced as ggml's GGML_F32x8_REDUCE.
#include <cmath>

#define JAXVT_FORMATS_INTERNAL_LINKAGE 1
#include "common/act.h"
#include "common/formats.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu {
namespace {

inline float hsum8(const float* a) {
  const float r0 = a[4] + a[0], r1 = a[5] + a[1], r2 = a[6] + a[2], r3 = a[7] + a[3];
  return (r0 + r2) + (r1 + r3);
}

inline float reduce32(const float (&acc)[4][8]) {
  float x[8];
  for (int l = 0; l < 8; ++l) x[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
  const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];
  return (t0 + t1) + (t2 + t3);
}

// Integer weights of 32-block ib of a Q4_0 / Q4_1 / Q8_0 row.
template <int F>
inline void block_ints(const uint8_t* wb, int* q) {
  if constexpr (F == kQ8_0) {
    for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(wb[2 + j]);
  } else {
    const uint8_t* qs = wb + (F == kQ4_1 ? 4 : 2);
    const int off = F == kQ4_0 ? 8 : 0;
    for (int j = 0; j < 16; ++j) {
      q[j] = (qs[j] & 15) - off;
      q[j + 16] = (qs[j] >> 4) - off;
    }
  }
}

template <int F>
float dot_small(const uint8_t* w, const uint8_t* a, int64_t nkb) {
  constexpr int kbb = F == kQ4_0 ? 18 : F == kQ4_1 ? 20 : 34;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float summs = 0.f;
  int q[32];
  for (int64_t ib = 0; ib < nkb; ++ib) {
    const uint8_t* wb = w + ib * kbb;
    const uint8_t* ab = a + ib * kQ8Bytes;
    const int8_t* qa = reinterpret_cast<const int8_t*>(ab + 8);
    block_ints<F>(wb, q);
    const float d = ld_half(wb) * ld_f32(ab);
    if constexpr (F == kQ4_1) summs = std::fma(ld_half(wb + 2), ld_f32(ab + 4), summs);
    for (int l = 0; l < 8; ++l) {
      const int s = (q[4 * l] * qa[4 * l] + q[4 * l + 1] * qa[4 * l + 1]) +
                    (q[4 * l + 2] * qa[4 * l + 2] + q[4 * l + 3] * qa[4 * l + 3]);
      acc[l] = std::fma(d, static_cast<float>(s), acc[l]);
    }
  }
  return F == kQ4_1 ? hsum8(acc) + summs : hsum8(acc);
}

inline int16_t ld_i16(const uint8_t* p) { return static_cast<int16_t>(ld_u16(p)); }

// Q4_K / Q5_K element e (0..31) of sub-block j of the super-block at wb.
template <bool kFive>
inline int k45_q(const uint8_t* wb, int j, int e) {
  const uint8_t* qs = wb + (kFive ? 48 : 16) + 32 * (j >> 1);
  int v = (qs[e] >> (4 * (j & 1))) & 15;
  if (kFive) v |= ((wb[16 + e] >> j) & 1) << 4;
  return v;
}

template <bool kFive>
float dot_k45(const uint8_t* w, const uint8_t* a, int64_t nkb) {
  constexpr int kbb = kFive ? 176 : 144;
  float acc = 0.f, accm = 0.f;
  for (int64_t i = 0; i < nkb; ++i) {
    const uint8_t* wb = w + i * kbb;
    const uint8_t* ab = a + i * kQ8KBytes;
    const int8_t* qa = reinterpret_cast<const int8_t*>(ab + 36);
    const float ad = ld_f32(ab);
    const float d = ad * ld_half(wb), dmin = -ad * ld_half(wb + 2);
    int sumi = 0, summ = 0;
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      k4_scale_min(wb + 4, j, &sc, &mn);
      int s = 0;
      for (int e = 0; e < 32; ++e) s += k45_q<kFive>(wb, j, e) * qa[32 * j + e];
      sumi += sc * s;
      summ += mn * (ld_i16(ab + 4 + 4 * j) + ld_i16(ab + 6 + 4 * j));
    }
    acc = std::fma(d, static_cast<float>(sumi), acc);
    accm = std::fma(dmin, static_cast<float>(summ), accm);
  }
  return acc + accm;
}

float dot_q6k(const uint8_t* w, const uint8_t* a, int64_t nkb) {
  float acc = 0.f;
  for (int64_t i = 0; i < nkb; ++i) {
    const uint8_t* wb = w + i * 210;
    const uint8_t* ab = a + i * kQ8KBytes;
    const int8_t* qa = reinterpret_cast<const int8_t*>(ab + 36);
    const int8_t* sc = reinterpret_cast<const int8_t*>(wb + 192);
    const float d = ld_f32(ab) * ld_half(wb + 208);
    int sumi = 0;
    for (int u = 0; u < 8; ++u) {  // 32-element unit u: sub-blocks 2u, 2u+1 (as unit_weights)
      const int h = u >> 2, qq = u & 3;
      const uint8_t* ql = wb + 64 * h + 32 * (qq & 1);
      const uint8_t* qh = wb + 128 + 32 * h;
      const int lsh = (qq >> 1) * 4, hsh = 2 * qq;
      for (int half = 0; half < 2; ++half) {
        int s = 0;
        for (int e = 16 * half; e < 16 * half + 16; ++e) {
          const int v = ((ql[e] >> lsh) & 15) | (((qh[e] >> hsh) & 3) << 4);
          s += (v - 32) * qa[32 * u + e];
        }
        sumi += sc[8 * h + 2 * qq + half] * s;
      }
    }
    acc = std::fma(d, static_cast<float>(sumi), acc);
  }
  return acc;
}

template <int F>
inline float wval(const uint8_t* w, int64_t e) {
  if constexpr (F == kF32) return ld_f32(w + 4 * e);
  if constexpr (F == kF16) return half_to_float(static_cast<uint16_t>(ld_u16(w + 2 * e)));
  return bf16_to_float(static_cast<uint16_t>(ld_u16(w + 2 * e)));
}

template <int F>
float dot_float(const uint8_t* w, const uint8_t* a, int64_t cols) {
  float acc[4][8] = {};
  for (int64_t i = 0; i < cols; i += 32)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 8; ++l) {
        const int64_t e = i + 8 * j + l;
        acc[j][l] = std::fma(wval<F>(w, e), wval<F>(a, e), acc[j][l]);
      }
  return reduce32(acc);
}

template <int F>
float dot_row(const uint8_t* w, const uint8_t* a, int64_t cols) {
  if constexpr (F == kQ4_0 || F == kQ4_1 || F == kQ8_0) return dot_small<F>(w, a, cols / 32);
  if constexpr (F == kQ4_K) return dot_k45<false>(w, a, cols / 256);
  if constexpr (F == kQ5_K) return dot_k45<true>(w, a, cols / 256);
  if constexpr (F == kQ6_K) return dot_q6k(w, a, cols / 256);
  return dot_float<F>(w, a, cols);
}

template <int F>
void rows_generic(const uint8_t* w, int64_t cols, const QBatch& bt, int64_t r0, int64_t r1) {
  const int64_t rb = row_bytes(F, cols);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < bt.n; ++b) bt.y[b][r] = dot_row<F>(w + r * rb, bt.a[b], cols);
}

}  // namespace

bool gemv_q8_rows(int fmt, const uint8_t* w, int64_t cols, const QBatch& bt, int64_t r0,
                  int64_t r1) {
#if defined(JAXVT_HAVE_AVX2_TU)
  if (use_avx2()) return avx2::gemv_q8_rows(fmt, w, cols, bt, r0, r1);
#endif
  switch (fmt) {
    case kF32: rows_generic<kF32>(w, cols, bt, r0, r1); return true;
    case kF16: rows_generic<kF16>(w, cols, bt, r0, r1); return true;
    case kBF16: rows_generic<kBF16>(w, cols, bt, r0, r1); return true;
    case kQ4_0: rows_generic<kQ4_0>(w, cols, bt, r0, r1); return true;
    case kQ4_1: rows_generic<kQ4_1>(w, cols, bt, r0, r1); return true;
    case kQ8_0: rows_generic<kQ8_0>(w, cols, bt, r0, r1); return true;
    case kQ4_K: rows_generic<kQ4_K>(w, cols, bt, r0, r1); return true;
    case kQ5_K: rows_generic<kQ5_K>(w, cols, bt, r0, r1); return true;
    case kQ6_K: rows_generic<kQ6_K>(w, cols, bt, r0, r1); return true;
    default: return false;
  }
}

}  // namespace jaxvt::cpu
