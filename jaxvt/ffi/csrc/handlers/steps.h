// The handlers of the fused steps (moe_route, add_norm, gdn_step, attn_step), one body for every
// platform.
// Each checks its operands against the op's contract (route.h, norm.h, gdn.h, attn.h) and runs
// the platform's kernel through a policy P (handlers/cpu.cc CpuSteps, handlers/gpu.cu GpuSteps):
//   P::Stream                          the handler's context (context.h)
//   P::route, P::norm, P::gdn, P::attn the platform's kernels of the four steps
//   P::run(s, op, kernel, args...)     runs one (on a GPU: launches it on s)
//   P::copy(s, dst, src, nbytes, op)   a copy within the platform's memory
// the last two returning an ffi::Error that names `op`.
#ifndef JAXVT_FFI_CSRC_HANDLERS_STEPS_H_
#define JAXVT_FFI_CSRC_HANDLERS_STEPS_H_

#include <cstdint>

#include "common/attn.h"
#include "common/gdn.h"
#include "common/norm.h"
#include "common/route.h"
#include "handlers/context.h"
#include "xla/ffi/api/ffi.h"

namespace jaxvt::steps {
namespace ffi = xla::ffi;
using bind::F32;
using bind::S32;
using RF32 = ffi::ResultBuffer<ffi::F32>;

// The MoE router (route.h): logits f32 [..., E] -> ids int32 [..., k], weights f32 [..., k].
template <typename P>
ffi::Error MoeRoute(typename P::Stream s, F32 logits, ffi::ResultBuffer<ffi::S32> ids,
                    RF32 weights, bool renormalise) {
  auto ld = logits.dimensions();
  auto id = ids->dimensions();
  const int64_t E = ld.size() ? ld.back() : 0, k = id.size() ? id.back() : 0;
  const int64_t n = static_cast<int64_t>(logits.element_count());
  if (const char* err = route::check_shapes(n, E, static_cast<int64_t>(ids->element_count()), k,
                                            static_cast<int64_t>(weights->element_count())))
    return ffi::Error::InvalidArgument(err);
  return P::run(s, "moe_route", P::route, logits.typed_data(), n / E, E, k, renormalise,
                ids->typed_data(), weights->typed_data());
}

// The residual add and RMSNorm (norm.h): x [T, d], y [T, d] or [T, K, d] with c [T, K] (or c
// empty), s [T, d] and g [T] (or both empty), w [L, d], v [L, d] (or empty), layer -> x', h
// [T, d], dot [T]. ggml: ss in ggml's order (the CPU's only).
template <typename P>
ffi::Error AddNorm(typename P::Stream st, F32 x, F32 y, F32 c, F32 s, F32 g, F32 w, F32 v,
                   S32 layer, RF32 xo, RF32 h, RF32 dot, float eps, bool ggml) {
  auto xd = x.dimensions();
  const int64_t d = xd.size() ? xd.back() : 0;
  auto n = [](const auto& b) { return static_cast<int64_t>(b.element_count()); };
  norm::Args a{};
  if (const char* err = norm::check_shapes(n(x), d, n(y), n(c), n(s), n(g), n(w), n(v), n(*xo),
                                           n(*h), n(*dot), &a.K))
    return ffi::Error::InvalidArgument(err);
  if (n(layer) != 1) return ffi::Error::InvalidArgument("jaxvt add_norm: the layer is a scalar");
  a.x = x.typed_data();
  a.y = y.typed_data();
  a.c = n(c) ? c.typed_data() : nullptr;
  a.s = n(s) ? s.typed_data() : nullptr;
  a.g = n(g) ? g.typed_data() : nullptr;
  a.w = w.typed_data();
  a.v = n(v) ? v.typed_data() : nullptr;
  a.layer = layer.typed_data();
  a.xo = xo->typed_data();
  a.h = h->typed_data();
  a.dot = dot->typed_data();
  a.T = n(x) / d;
  a.d = d;
  a.L = n(w) / d;
  a.eps = eps;
  a.ggml = ggml;
  return P::run(st, "add_norm", P::norm, a);
}

// The fused Gated DeltaNet decode step (gdn.h); the attributes as jaxvt/ffi/gdn.py passes them.
template <typename P>
ffi::Error GdnStep(typename P::Stream s, F32 mixed, F32 z, F32 beta, F32 alpha, F32 a,
                   F32 dt_bias, F32 conv_w, F32 norm_w, F32 conv_state, F32 ssm_state, S32 valid,
                   S32 layer, RF32 y, RF32 conv_res, RF32 ssm_res, RF32 conv_out, int64_t nk,
                   int64_t grouped, float eps, float qk_eps) {
  gdn::Dims d;
  gdn::Args args;
  bool copy_conv, copy_ssm;
  if (const char* e = gdn::prepare(mixed, z, beta, alpha, a, dt_bias, conv_w, norm_w, conv_state,
                                   ssm_state, valid, layer, y, conv_res, ssm_res, conv_out, nk,
                                   grouped, eps, qk_eps, &d, &args, &copy_conv, &copy_ssm))
    return ffi::Error::InvalidArgument(e);
  // XLA aliases the stacks (input_output_aliases); were it not to, the results start as copies
  if (copy_conv)
    if (auto e = P::copy(s, args.conv_state, conv_state.typed_data(), conv_state.size_bytes(),
                         "gdn_step");
        !e.success())
      return e;
  if (copy_ssm)
    if (auto e = P::copy(s, args.ssm_state, ssm_state.typed_data(), ssm_state.size_bytes(),
                         "gdn_step");
        !e.success())
      return e;
  return P::run(s, "gdn_step", P::gdn, d, args);
}

// The fused attention decode step (attn.h); the attributes as jaxvt/ffi/attn.py passes them.
template <typename P>
ffi::Error AttnStep(typename P::Stream s, F32 q, F32 k, F32 v, F32 q_norm, F32 k_norm,
                    F32 inv_freq, F32 k_cache, F32 v_cache, S32 layer, S32 positions, RF32 o,
                    RF32 k_res, RF32 v_res, RF32 part, int64_t kv_len, int64_t rope_dim,
                    int64_t chunk, bool gate, bool qk_norm, bool interleaved, float eps,
                    float scale) {
  attn::Dims d;
  attn::Args args;
  bool copy_k, copy_v;
  if (const char* e = attn::prepare(q, k, v, q_norm, k_norm, inv_freq, k_cache, v_cache, layer,
                                    positions, o, k_res, v_res, part, kv_len, rope_dim, chunk,
                                    gate, qk_norm, interleaved, eps, scale, &d, &args, &copy_k,
                                    &copy_v))
    return ffi::Error::InvalidArgument(e);
  // XLA aliases the stacks (input_output_aliases); were it not to, the results start as copies
  if (copy_k)
    if (auto e = P::copy(s, args.k_cache, k_cache.typed_data(), k_cache.size_bytes(), "attn_step");
        !e.success())
      return e;
  if (copy_v)
    if (auto e = P::copy(s, args.v_cache, v_cache.typed_data(), v_cache.size_bytes(), "attn_step");
        !e.success())
      return e;
  return P::run(s, "attn_step", P::attn, d, args);
}

}  // namespace jaxvt::steps

#endif  // JAXVT_FFI_CSRC_HANDLERS_STEPS_H_
