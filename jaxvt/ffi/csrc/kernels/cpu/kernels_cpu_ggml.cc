// ggml-exact CPU ops (kernels_cpu_ggml.h): the portable copy of ggml_ops_impl.h, the run-time
// choice of the AVX2 copy, and the split of the work across the thread pool (rows, tokens or
// (row, token, head) units are independent, so the split changes no bits).
#include "kernels/cpu/kernels_cpu_ggml.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#define JAXVT_FORMATS_INTERNAL_LINKAGE 1
#include "common/formats.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu::ggml {
namespace portable {
namespace {
#include "kernels/cpu/ggml_ops_impl.h"
}  // namespace
}  // namespace portable

namespace {

bool fast() {
#if defined(JAXVT_HAVE_AVX2_TU)
  return use_avx2();
#else
  return false;
#endif
}

// Runs fn(i0, i1) over [0, n) in pieces of at least `grain`, on the pool when it pays.
template <class F>
void split(int64_t n, int64_t grain, F&& fn) {
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(n / std::max<int64_t>(grain, 1),
                                                                4 * num_threads()));
  if (pieces <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  auto task = [&](int64_t t) { fn(t * n / pieces, (t + 1) * n / pieces); };
  parallel_for(pieces, task);
}

}  // namespace

void rms_norm(const float* x, const float* w, int64_t n, int64_t d, float eps, float* y) {
  split(n, std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
#if defined(JAXVT_HAVE_AVX2_TU)
    if (fast()) return avx2::rms_norm(x, w, d, eps, y, r0, r1);
#endif
    portable::rms_norm_rows(x, w, d, eps, y, r0, r1);
  });
}

void swiglu(const float* g, const float* u, int64_t n, int64_t d, float* y) {
  split(n, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
#if defined(JAXVT_HAVE_AVX2_TU)
    if (fast()) return avx2::swiglu(g, u, d, y, r0, r1);
#endif
    portable::swiglu_rows(g, u, d, y, r0, r1);
  });
}

void rope(const float* x, const int32_t* pos, int64_t ntok, int64_t nh, int64_t hd,
          int64_t n_dims, float base, bool neox, float* y) {
  split(ntok, std::max<int64_t>(1, 16384 / std::max<int64_t>(nh * hd, 1)),
        [&](int64_t t0, int64_t t1) {
#if defined(JAXVT_HAVE_AVX2_TU)
          if (fast()) return avx2::rope(x, pos, nh, hd, n_dims, base, neox, y, t0, t1);
#endif
          portable::rope_tokens(x, pos, nh, hd, n_dims, base, neox, y, t0, t1);
        });
}

namespace {

#if defined(JAXVT_HAVE_AVX2_TU)
// A call of at least kBlockTokens query tokens (a prefill) with an f16 cache takes the tiled
// kernel: tasks of kTaskTokens tokens x one kv head's query heads, after K and V are gathered
// once per (row, kv head). Fewer tokens (decode) take one (token, head) at a time, as does a row
// whose recipe is not the prompt's (llama.cpp's one-token products under "llamacpp").
constexpr int64_t kBlockTokens = 16;
constexpr int64_t kTaskTokens = 4;

bool tiled(const AttnArgs& a, bool half_cache) {
  return fast() && half_cache && a.T >= kBlockTokens && a.D % 8 == 0 && a.Dv % 4 == 0 &&
         a.kv_len % 8 == 0 && a.H % a.K == 0;
}

void attention_tiled(const AttnArgs& a) {
  // The positions some real query sees (up to its last, rounded up to 8), per (row, kv head):
  // K's rows contiguous (vts rows of D; the cache interleaves the kv heads, which at a long
  // context's length leaves most of each line read unused) and V^T (Dv rows of vts positions).
  int64_t seen = 0;
  for (int64_t bi = 0; bi < a.B; ++bi)
    for (int64_t ti = 0; ti < std::min<int64_t>(a.nq[bi], a.T); ++ti)
      seen = std::max<int64_t>(seen, std::min<int64_t>(a.pos[bi * a.T + ti] + 1, a.kv_len));
  const int64_t vts = std::max<int64_t>(8, (seen + 7) & ~int64_t{7});
  std::vector<uint16_t> kc(a.B * a.K * a.D * vts), vt(a.B * a.K * a.Dv * vts);
  auto gather = [&](int64_t u) {
    const int64_t bi = u / a.K, kh = u % a.K;
    const uint16_t* k = static_cast<const uint16_t*>(a.k) + (bi * a.S * a.K + kh) * a.D;
    for (int64_t s = 0; s < vts; ++s)
      std::memcpy(kc.data() + (u * vts + s) * a.D, k + s * a.K * a.D, a.D * sizeof(uint16_t));
    const uint16_t* v = static_cast<const uint16_t*>(a.v) + (bi * a.S * a.K + kh) * a.Dv;
    uint16_t* dst = vt.data() + u * a.Dv * vts;
    for (int64_t s0 = 0; s0 < vts; s0 += 8)
      for (int64_t c = 0; c < a.Dv; ++c)
        for (int64_t s = s0; s < s0 + 8; ++s) dst[c * vts + s] = v[s * a.K * a.Dv + c];
  };
  parallel_for(a.B * a.K, gather);
  const int64_t blocks = (a.T + kTaskTokens - 1) / kTaskTokens, G = a.H / a.K;
  auto task = [&](int64_t u) {  // the longest (latest) token blocks first
    const int64_t blk = blocks - 1 - u / (a.B * a.K), bi = u / a.K % a.B, kh = u % a.K;
    const int64_t t0 = blk * kTaskTokens, t1 = std::min(t0 + kTaskTokens, a.T);
    if (portable::attn_recipe(a, bi, true).tiny_kq && portable::attn_recipe(a, bi, true).tiny_v)
      return avx2::attention_block(a, bi, kh, t0, t1, kc.data() + (bi * a.K + kh) * a.D * vts,
                                   vt.data() + (bi * a.K + kh) * a.Dv * vts, vts);
    for (int64_t ti = t0; ti < t1; ++ti)
      for (int64_t h = kh * G; h < kh * G + G; ++h) {
        const int64_t unit = (bi * a.T + ti) * a.H + h;
        avx2::attention(a, true, unit, unit + 1);
      }
  };
  parallel_for(blocks * a.B * a.K, task);
}
#endif

}  // namespace

void attention(const AttnArgs& a, bool half_cache) {
#if defined(JAXVT_HAVE_AVX2_TU)
  if (tiled(a, half_cache)) return attention_tiled(a);
#endif
  const int64_t units = a.B * a.T * a.H;
  const int64_t work = std::max<int64_t>(1, a.kv_len * (a.D + a.Dv));
  split(units, std::max<int64_t>(1, 65536 / work), [&](int64_t u0, int64_t u1) {
#if defined(JAXVT_HAVE_AVX2_TU)
    if (fast()) return avx2::attention(a, half_cache, u0, u1);
#endif
    std::vector<float> scratch(a.kv_len + a.D);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t h = u % a.H, ti = (u / a.H) % a.T, bi = u / (a.H * a.T);
      if (portable::padding_query(a, bi, ti, h)) continue;
      if (half_cache) portable::attend_one<true>(a, bi, ti, h, scratch.data());
      else portable::attend_one<false>(a, bi, ti, h, scratch.data());
    }
  });
}

}  // namespace jaxvt::cpu::ggml
