// ggml-exact CPU ops: the non-matmul arithmetic of llama.cpp's CPU backend (AVX2+FMA build, no
// flash attention) reproduced bit for bit, so that jaxvt's CPU kernel path computes llama.cpp's
// logits exactly (docs/NUMERICS.md). Float32 in and out.
//
//   rms_norm:  per row, sum of x*x (float32 products) accumulated in double in order;
//              mean = float(sum / d); scale = 1.0f / sqrtf(mean + eps); y = (x * scale) * w.
//   swiglu:    y = (g / (1 + expf(0 - g))) * u with ggml's vectorized expf (ggml_v_expf) on the
//              8-aligned part of each row, glibc expf on the rest.
//   rope:      theta_i = pos * theta_scale^i by repeated float32 multiplication from pos,
//              theta_scale = powf(base, -2/n_dims); cos/sin from glibc cosf/sinf; rotated pairs
//              (adjacent, or NEOX halves) y0 = fma(x0, c, -(x1*s)), y1 = fma(x0, s, x1*c) (the
//              contractions GCC makes in ggml's rotate_pairs); dims past n_dims copied.
//   attention: per query row, head h (kv head h / (H/K)): q rounded to the cache type; scores
//              q.k in tinyBLAS order (one 8-lane accumulator) when the call has >= 2 query tokens
//              and an f16 cache, else ggml_vec_dot order (4 x 8 lanes over steps of 32); scaled,
//              masked (positions > pos), soft-maxed with ggml_v_expf in blocks of 8, block sums in
//              double, times float(1/sum); probabilities rounded to the cache type; out = P.V in
//              tinyBLAS order when the call has >= 2 query tokens, else vec_dot order.
#ifndef JAXVT_FFI_CSRC_KERNELS_CPU_GGML_H_
#define JAXVT_FFI_CSRC_KERNELS_CPU_GGML_H_

#include <cstdint>

namespace jaxvt::cpu::ggml {

struct AttnArgs {
  const float* q;      // [B, T, H, D]
  const void* k;       // this layer's cache [B, S, K, D] (f16 bits or float32)
  const void* v;       // [B, S, K, Dv]
  const int32_t* pos;  // [B, T] absolute positions
  const int32_t* nq;   // [B] real query tokens of each row (>= 2: the prefill products); the
                       // tokens from nq[b] on are padding, their output zeros
  float* o;            // [B, T, H, Dv]
  int64_t B, T, H, K, D, Dv, S, kv_len;
  float scale;
};

void rms_norm(const float* x, const float* w, int64_t n, int64_t d, float eps, float* y);
void swiglu(const float* g, const float* u, int64_t n, int64_t d, float* y);
void rope(const float* x, const int32_t* pos, int64_t ntok, int64_t nh, int64_t hd,
          int64_t n_dims, float base, bool neox, float* y);
void attention(const AttnArgs& a, bool half_cache);

// The AVX2+FMA+F16C copies (kernels_cpu_ggml_avx2.cc); same bits as the portable ones.
namespace avx2 {
void rms_norm(const float* x, const float* w, int64_t d, float eps, float* y, int64_t r0,
              int64_t r1);
void swiglu(const float* g, const float* u, int64_t d, float* y, int64_t r0, int64_t r1);
void rope(const float* x, const int32_t* pos, int64_t nh, int64_t hd, int64_t n_dims, float base,
          bool neox, float* y, int64_t t0, int64_t t1);
void attention(const AttnArgs& a, bool half_cache, int64_t u0, int64_t u1);
// The prompt recipe with an f16 cache for query tokens [t0, t1) of row bi and the query heads
// of kv head kh, in register tiles (ggml_attn_block_avx2.h); kc: K of (bi, kh), vts rows of D
// f16; vt: V^T of (bi, kh), Dv rows of vts positions (vts: at least every token's last position
// + 1, rounded up to 8).
void attention_block(const AttnArgs& a, int64_t bi, int64_t kh, int64_t t0, int64_t t1,
                     const uint16_t* kc, const uint16_t* vt, int64_t vts);
}  // namespace avx2

}  // namespace jaxvt::cpu::ggml

#endif  // JAXVT_FFI_CSRC_KERNELS_CPU_GGML_H_
