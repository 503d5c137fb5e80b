// ggml_ops_impl.h compiled for AVX2+FMA+F16C (-mavx2 -mfma -mf16c -ffp-contract=off); called
// only after kernels_cpu.cc checked the CPU. Attention takes the explicitly vectorized copy of
// attend_one in ggml_attn_avx2.h, or for a prompt's calls its register tiles in
// ggml_attn_block_avx2.h (same bits).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define JAXVT_FORMATS_INTERNAL_LINKAGE 1
#include "common/formats.h"
#include "kernels/cpu/avx2_sums.h"
#include "kernels/cpu/kernels_cpu_ggml.h"

namespace jaxvt::cpu::ggml::avx2 {
namespace {
#include "kernels/cpu/ggml_ops_impl.h"
}  // namespace
#include "kernels/cpu/ggml_attn_avx2.h"
#include "kernels/cpu/ggml_attn_block_avx2.h"

void rms_norm(const float* x, const float* w, int64_t d, float eps, float* y, int64_t r0,
              int64_t r1) {
  rms_norm_rows(x, w, d, eps, y, r0, r1);
}
void swiglu(const float* g, const float* u, int64_t d, float* y, int64_t r0, int64_t r1) {
  swiglu_rows(g, u, d, y, r0, r1);
}
void rope(const float* x, const int32_t* pos, int64_t nh, int64_t hd, int64_t n_dims, float base,
          bool neox, float* y, int64_t t0, int64_t t1) {
  rope_tokens(x, pos, nh, hd, n_dims, base, neox, y, t0, t1);
}
void attention(const AttnArgs& a, bool half_cache, int64_t u0, int64_t u1) {
  std::vector<float> scratch(a.kv_len + a.D + 8);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t h = u % a.H, ti = (u / a.H) % a.T, bi = u / (a.H * a.T);
    if (padding_query(a, bi, ti, h)) continue;
    if (half_cache) attend_one_v<true>(a, bi, ti, h, scratch.data());
    else attend_one_v<false>(a, bi, ti, h, scratch.data());
  }
}

}  // namespace jaxvt::cpu::ggml::avx2
