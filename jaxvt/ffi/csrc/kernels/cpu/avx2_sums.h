// ggml's two horizontal sums of AVX2 float32 registers, in its order (the AVX2 kernels that
// reproduce ggml's bits use these, never their own): hsum_float_8 and GGML_F32x8_REDUCE.
// Include only from units compiled with AVX2.
#pragma once

#include <immintrin.h>

namespace jaxvt::cpu::avx2_sums {

// ggml's hsum_float_8: (a4+a0 + a6+a2) + (a5+a1 + a7+a3).
inline float hsum8(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// GGML_F32x8_REDUCE of four accumulators.
inline float reduce32(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  a0 = _mm256_add_ps(a0, a2);
  a1 = _mm256_add_ps(a1, a3);
  a0 = _mm256_add_ps(a0, a1);
  const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
  const __m128 t1 = _mm_hadd_ps(t0, t0);
  return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}

}  // namespace jaxvt::cpu::avx2_sums
