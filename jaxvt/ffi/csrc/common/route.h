// The MoE router (custom call jaxvt_moe_route), shared by the CPU kernel (kernels_cpu_route.cc)
// and the GPU kernel (kernels_gpu_route.cu). Its jnp reference is jaxvt.ffi.ops.moe_route_ref.
//
// logits float32 [T, E] -> ids int32 [T, k], weights float32 [T, k], per token:
//   m = max of the logits (NaNs skipped), e_i = exp(l_i - m), s = sum e_i, p_i = e_i / s;
//   s is summed in a fixed order, the GPU kernel's: 32 partial sums (of the e_i with
//   i = l mod 32, each in index order), then pairwise halvings (partial l += partial l + o for
//   o = 16, 8, 4, 2, 1), so the CPU and GPU kernels differ only by their exp's rounding;
//   ids: the k largest p in descending order, ties to the lower expert index (lax.top_k's order);
//   weights: p of those, divided by their sum (summed in that order) when renormalising.
// A row whose s is NaN (a NaN logit, a +inf logit, or every logit -inf) has every p NaN in the
// reference, which lax.top_k returns as ids 0 .. k-1: the kernels give those ids and NaN weights.
// Float32 throughout, fixed summation orders, no atomics: the same bits on every run.
#ifndef JAXVT_FFI_CSRC_ROUTE_H_
#define JAXVT_FFI_CSRC_ROUTE_H_

#include <cstdint>

#include "common/formats.h"  // JV_HD

namespace jaxvt::route {

constexpr int kMaxExperts = 512;  // E the kernels take (the GPU kernel holds a row in registers)
constexpr int kLanes = 32;  // the partial sums of s: the GPU kernel's lanes

// (p_a, a) comes before (p_b, b) in the top-k order: probability descending, then index ascending.
// A strict total order on rows without NaN, so every algorithm selects the same ids.
JV_HD bool before(float pa, int a, float pb, int b) { return pa > pb || (pa == pb && a < b); }

// The handlers' operand check: logits [..., E] (n_logits elements) with ids and weights
// [..., k] (n_ids, n_weights elements) over the same tokens. Returns an error message, or
// nullptr when the shapes are ones the kernels take.
inline const char* check_shapes(int64_t n_logits, int64_t E, int64_t n_ids, int64_t k,
                                int64_t n_weights) {
  if (E < 1 || E > kMaxExperts) return "jaxvt moe_route: experts (the logits' last axis) must be 1 .. 512";
  if (k < 1 || k > E) return "jaxvt moe_route: k must be 1 .. the number of experts";
  if (n_logits % E || n_ids != n_logits / E * k || n_weights != n_ids)
    return "jaxvt moe_route: ids and weights must be [..., k] over the logits' tokens";
  return nullptr;
}

}  // namespace jaxvt::route

#endif  // JAXVT_FFI_CSRC_ROUTE_H_
