// The residual add and RMSNorm at a block boundary (custom call jaxvt_add_norm), shared by the
// CPU kernel (kernels_cpu_norm.cc) and the GPU kernel (kernels_gpu_norm.cu). Its jnp reference
// is jaxvt.ffi.norm.add_norm_ref.
//
// Per row t of x float32 [T, d], with y [T, d] (or y [T, K, d] with combine weights c [T, K]),
// the optional gated term s [T, d] and g [T], the norm weights w [L, d] and the optional vector
// stack v [L, d], at l = clamp(layer, 0, L - 1):
//   u   = y, or with c: c_0 y_0, then u = fma(c_k, y_k, u) for k = 1 .. K - 1
//   x'  = x + fma(sigmoid(g), s, u)       (x + u without s); sigmoid(g) = 1 / (1 + exp(-g))
//   h   = (x' * r) * w[l],  r = 1 / sqrt(ss / d + eps),  ss = the sum of x'^2
//   dot = the sum of h * v[l]              (with v; else 0)
// That is a decoder's residual stream: the block's output (a MoE's K routed experts' outputs,
// weighted, and its shared expert, gated) added to the residual, the next block's normed input,
// and the shared expert's gate logit.
// The sums run in a fixed order, the GPU kernel's: kLanes lane sums (lane i takes the terms
// j = i mod kLanes in index order, each added by fma), then within each group of 32 lanes
// pairwise halvings (lane i += lane i + o for o = 16, 8, 4, 2, 1), then the kLanes / 32 group
// sums halved the same way (o = 4, 2, 1). A row's bits therefore never depend on the other rows
// of the call, and the CPU and GPU kernels differ only by their exp's rounding.
// ggml (the CPU's only): ss as ggml's rms_norm sums it (float32 squares added in double in index
// order; r = 1.0f / sqrtf(float(ss / d) + eps)), so that x' and h are llama.cpp's bits.
#ifndef JAXVT_FFI_CSRC_NORM_H_
#define JAXVT_FFI_CSRC_NORM_H_

#include <cmath>
#include <cstdint>

#include "common/formats.h"  // JV_HD

namespace jaxvt::norm {

constexpr int kLanes = 256;  // the GPU kernel's threads a row
constexpr int kGroup = 32;   // a logical warp (vendor.h)

struct Args {
  const float* x;      // [T, d]
  const float* y;      // [T, d], or [T, K, d] with c
  const float* c;      // [T, K] or nullptr
  const float* s;      // [T, d] or nullptr (then g is unused)
  const float* g;      // [T]
  const float* w;      // [L, d]
  const float* v;      // [L, d] or nullptr
  const int32_t* layer;  // [] (read where the kernel runs)
  float* xo;           // [T, d]: x'
  float* h;            // [T, d]
  float* dot;          // [T]
  int64_t T, d, L, K;
  float eps;
  bool ggml;
};

// The handlers' operand check (element counts): x, xo, h of T*d; y of T*d, or T*K*d with c of
// T*K; s of T*d or 0 with g of T or 0 (both or neither); w and v of L*d (v may be 0); dot of T.
// Sets *K. Returns an error message, or nullptr.
inline const char* check_shapes(int64_t nx, int64_t d, int64_t ny, int64_t nc, int64_t ns,
                                int64_t ng, int64_t nw, int64_t nv, int64_t nxo, int64_t nh,
                                int64_t ndot, int64_t* K) {
  if (d < 1) return "jaxvt add_norm: rows must have at least one element";
  const int64_t T = nx / d;
  *K = T && nc ? nc / T : 1;
  if (nx % d || nxo != nx || nh != nx || ndot != T)
    return "jaxvt add_norm: x and the results must be [T, d] (the dot [T])";
  if (nc ? (nc != T * *K || ny != nx * *K) : ny != nx)
    return "jaxvt add_norm: y must be [T, d], or [T, K, d] with its weights c [T, K]";
  if ((ns == 0) != (ng == 0) || (ns && (ns != nx || ng != T)))
    return "jaxvt add_norm: the gated term takes s [T, d] with g [T], or neither";
  if (nw < d || nw % d || (nv && nv != nw))
    return "jaxvt add_norm: the norm weights (and the dotted vectors) must be [L, d]";
  return nullptr;
}

// u_j of row t (the contract's combine); y and c point at the row's.
JV_HD float combined(const float* y, const float* c, int64_t K, int64_t d, int64_t j) {
  if (!c) return y[j];
  float u = c[0] * y[j];
  for (int64_t k = 1; k < K; ++k) u = fmaf(c[k], y[k * d + j], u);
  return u;
}

}  // namespace jaxvt::norm

#endif  // JAXVT_FFI_CSRC_NORM_H_
