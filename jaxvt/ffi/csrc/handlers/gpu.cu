// XLA FFI handlers for platform "CUDA" (nvcc) or "ROCM" (hipcc). They only pass device pointers
// and static shapes to the launchers: the layer index, fmts, table and ids stay on the device and
// are read by the kernels. With no host-side per-step logic, each handler carries the
// command-buffer trait, so XLA may capture it into a CUDA graph and replay it.
#include <cstdint>
#include <optional>
#include <string>

#include "common/attn.h"
#include "common/gdn.h"
#include "handlers/handlers.h"
#include "kernels/gpu/kernels_gpu.h"
#include "common/route.h"
#include "common/vendor.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxvt {
namespace {

gpu::WeightArgs Weights(const ffi::AnyBuffer& data, const ffi::Buffer<ffi::U32>& table,
                        const ffi::Buffer<ffi::S32>& fmts, const ffi::Buffer<ffi::S32>& layer) {
  auto dd = data.dimensions();
  return gpu::WeightArgs{static_cast<const uint8_t*>(data.untyped_data()),
                         dd.size() == 2 ? dd[1] : 0,
                         table.typed_data(),
                         fmts.typed_data(),
                         static_cast<int64_t>(fmts.element_count()),
                         layer.typed_data()};
}

// A decode expert ring (prefetch.h) passed after an experts call's ids, or nullptr.
const uint8_t* RingOf(const std::optional<ffi::Buffer<ffi::U8>>& ring) {
  return ring.has_value() ? ring->typed_data() : nullptr;
}

gpu::WeightArgs WithRing(gpu::WeightArgs w, const std::optional<ffi::Buffer<ffi::U8>>& ring) {
  w.ring = RingOf(ring);
  return w;
}

ffi::Error Status(gpuError_t e, const char* op) {
  if (e == gpuSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxvt ") + op + ": " + gpuGetErrorString(e));
}

ffi::Error QMatmulGpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                      ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t rows,
                      int64_t cols) {
  const int64_t batch = static_cast<int64_t>(x.element_count()) / cols;
  return Status(gpu::launch_qmatmul(s, Weights(data, table, fmts, layer), x.typed_data(), batch,
                                    y->typed_data(), rows, cols),
                "qmatmul");
}

// ggml's arithmetic ("ggml" / "q8" modes): the signature of the CPU's jaxvt_qmatmul_q8, whose
// second result (its activation scratch) the GPU kernels do not need (they quantize in shared
// memory).
ffi::Error QMatmulQ8Gpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                        ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                        ffi::ResultBuffer<ffi::U8> scratch, int64_t rows, int64_t cols) {
  (void)scratch;
  const int64_t batch = static_cast<int64_t>(x.element_count()) / cols;
  return Status(gpu::launch_qmatmul(s, Weights(data, table, fmts, layer), x.typed_data(), batch,
                                    y->typed_data(), rows, cols, true),
                "qmatmul (ggml arithmetic)");
}

ffi::Error QMatmulExpertsQ8Gpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                               ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                               std::optional<ffi::Buffer<ffi::U8>> ring,
                               ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::U8> scratch,
                               int64_t rows, int64_t cols, int64_t experts) {
  (void)scratch;
  const int64_t slots = static_cast<int64_t>(ids.element_count());
  auto idd = ids.dimensions();
  const int64_t k = idd.size() >= 1 ? idd.back() : 1;
  const bool per_slot = static_cast<int64_t>(x.element_count()) / cols == slots;
  return Status(gpu::launch_qmatmul_experts(s, WithRing(Weights(data, table, fmts, layer), ring),
                                            x.typed_data(), per_slot, ids.typed_data(), slots, k,
                                            y->typed_data(), rows, cols, experts, true),
                "qmatmul_experts (ggml arithmetic)");
}

ffi::Error QMatmulExpertsGpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                             ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                             std::optional<ffi::Buffer<ffi::U8>> ring,
                             ffi::ResultBuffer<ffi::F32> y, int64_t rows, int64_t cols,
                             int64_t experts) {
  const int64_t slots = static_cast<int64_t>(ids.element_count());
  auto idd = ids.dimensions();
  const int64_t k = idd.size() >= 1 ? idd.back() : 1;
  const bool per_slot = static_cast<int64_t>(x.element_count()) / cols == slots;
  return Status(gpu::launch_qmatmul_experts(s, WithRing(Weights(data, table, fmts, layer), ring),
                                            x.typed_data(), per_slot, ids.typed_data(), slots, k,
                                            y->typed_data(), rows, cols, experts),
                "qmatmul_experts");
}

// x [B, cols], layer, then (data, table, fmts) per matrix; one result [B, rows_i] per matrix.
ffi::Error QMatmulMultiGpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                           ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t cols,
                           int64_t ggml) {
  const int64_t n = static_cast<int64_t>(rets.size());
  if (n < 1 || n > gpu::kMaxMulti || static_cast<int64_t>(args.size()) != 3 * n)
    return ffi::Error::InvalidArgument("jaxvt qmatmul_multi: 1-4 matrices, 3 buffers each");
  gpu::WeightArgs w[gpu::kMaxMulti];
  float* y[gpu::kMaxMulti];
  int64_t rows[gpu::kMaxMulti];
  for (int64_t i = 0; i < n; ++i) {
    auto data = args.get<ffi::AnyBuffer>(3 * i);
    auto table = args.get<ffi::Buffer<ffi::U32>>(3 * i + 1);
    auto fmts = args.get<ffi::Buffer<ffi::S32>>(3 * i + 2);
    auto out = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!data.has_value() || !table.has_value() || !fmts.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("jaxvt qmatmul_multi: bad operand types");
    w[i] = Weights(*data, *table, *fmts, layer);
    y[i] = (*out)->typed_data();
    auto od = (*out)->dimensions();
    rows[i] = od.size() ? od.back() : 0;
  }
  const int64_t batch = static_cast<int64_t>(x.element_count()) / cols;
  return Status(gpu::launch_qmatmul_multi(s, static_cast<int>(n), w, y, rows, x.typed_data(), batch,
                                          cols, ggml != 0),
                "qmatmul_multi");
}

ffi::Error QMatmulExperts2Gpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data0,
                              ffi::Buffer<ffi::U32> table0, ffi::Buffer<ffi::S32> fmts0,
                              ffi::AnyBuffer data1, ffi::Buffer<ffi::U32> table1,
                              ffi::Buffer<ffi::S32> fmts1, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> ids, std::optional<ffi::Buffer<ffi::U8>> ring0,
                              std::optional<ffi::Buffer<ffi::U8>> ring1,
                              ffi::ResultBuffer<ffi::F32> y0,
                              ffi::ResultBuffer<ffi::F32> y1, int64_t rows, int64_t cols,
                              int64_t experts, int64_t ggml) {
  const int64_t slots = static_cast<int64_t>(ids.element_count());
  auto idd = ids.dimensions();
  const int64_t k = idd.size() >= 1 ? idd.back() : 1;
  const bool per_slot = static_cast<int64_t>(x.element_count()) / cols == slots;
  const gpu::WeightArgs w0 = WithRing(Weights(data0, table0, fmts0, layer), ring0);
  const gpu::WeightArgs w1 = WithRing(Weights(data1, table1, fmts1, layer), ring1);
  return Status(gpu::launch_qmatmul_experts2(s, w0, w1, x.typed_data(), per_slot,
                                             ids.typed_data(), slots, k, y0->typed_data(),
                                             y1->typed_data(), rows, cols, experts, ggml != 0),
                "qmatmul_experts2");
}

ffi::Error QEmbedGpu(gpuStream_t s, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer data,
                     ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t rows,
                     int64_t cols) {
  return Status(gpu::launch_qembed(s, Weights(data, table, fmts, layer), ids.typed_data(),
                                   static_cast<int64_t>(ids.element_count()), out->typed_data(),
                                   rows, cols),
                "qembed");
}

ffi::Error QDequantGpu(gpuStream_t s, ffi::AnyBuffer data, ffi::Buffer<ffi::U32> table,
                       ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::BF16> out, int64_t rows, int64_t cols,
                       int64_t experts) {
  return Status(gpu::launch_qdequant(s, Weights(data, table, fmts, layer),
                                     reinterpret_cast<uint16_t*>(out->untyped_data()), rows, cols,
                                     experts),
                "qdequant");
}

// x bf16 [T or T*k, cols]; order int32 [S] (slots sorted by expert), offsets int32 [E' + 1]
// (E' = max(experts, 1)); y [S, rows] in slot order. x holds one row per token (slot s reads row
// s / (S / rows of x)) or one per slot.
ffi::Error QMatmulGroupedGpu(gpuStream_t s, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer data,
                             ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> order,
                             ffi::Buffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::F32> y,
                             int64_t rows, int64_t cols, int64_t experts) {
  const int64_t slots = static_cast<int64_t>(order.element_count());
  const int64_t nx = static_cast<int64_t>(x.element_count()) / cols;
  const int64_t groups = experts > 0 ? experts : 1;
  if (static_cast<int64_t>(offsets.element_count()) != groups + 1 || nx < 1 || slots % nx)
    return ffi::Error::InvalidArgument("jaxvt qmatmul_grouped: offsets must be [experts + 1] and "
                                       "x one row per token or per slot");
  return Status(gpu::launch_qmatmul_grouped(
                    s, Weights(data, table, fmts, layer),
                    reinterpret_cast<const uint16_t*>(x.untyped_data()), slots / nx,
                    order.typed_data(), offsets.typed_data(), slots, y->typed_data(), rows, cols,
                    experts),
                "qmatmul_grouped");
}

// The MoE router (route.h): logits f32 [..., E] -> ids int32 [..., k], weights f32 [..., k].
ffi::Error MoeRouteGpu(gpuStream_t s, ffi::Buffer<ffi::F32> logits,
                       ffi::ResultBuffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> weights,
                       bool renormalise) {
  auto ld = logits.dimensions();
  auto id = ids->dimensions();
  const int64_t E = ld.size() ? ld.back() : 0, k = id.size() ? id.back() : 0;
  const int64_t n = static_cast<int64_t>(logits.element_count());
  if (const char* err = route::check_shapes(n, E, static_cast<int64_t>(ids->element_count()), k,
                                            static_cast<int64_t>(weights->element_count())))
    return ffi::Error::InvalidArgument(err);
  return Status(gpu::launch_moe_route(s, logits.typed_data(), n / E, E, k, renormalise,
                                      ids->typed_data(), weights->typed_data()),
                "moe_route");
}

// The fused Gated DeltaNet decode step (gdn.h, kernels_gpu_gdn.cu); the CPU handler's operands.
ffi::Error GdnStepGpu(gpuStream_t s, ffi::Buffer<ffi::F32> mixed, ffi::Buffer<ffi::F32> z,
                      ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> alpha,
                      ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> dt_bias,
                      ffi::Buffer<ffi::F32> conv_w, ffi::Buffer<ffi::F32> norm_w,
                      ffi::Buffer<ffi::F32> conv_state, ffi::Buffer<ffi::F32> ssm_state,
                      ffi::Buffer<ffi::S32> valid, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> conv_res,
                      ffi::ResultBuffer<ffi::F32> ssm_res, ffi::ResultBuffer<ffi::F32> conv_out,
                      int64_t nk, int64_t grouped, float eps, float qk_eps) {
  gdn::Dims d;
  gdn::Args args;
  bool copy_conv, copy_ssm;
  if (const char* e = gdn::prepare(mixed, z, beta, alpha, a, dt_bias, conv_w, norm_w, conv_state,
                                   ssm_state, valid, layer, y, conv_res, ssm_res, conv_out, nk,
                                   grouped, eps, qk_eps, &d, &args, &copy_conv, &copy_ssm))
    return ffi::Error::InvalidArgument(e);
  // XLA aliases the stacks (input_output_aliases); were it not to, the results start as copies
  if (copy_conv)
    if (gpuError_t e = gpuMemcpyAsync(args.conv_state, conv_state.typed_data(),
                                      conv_state.size_bytes(), gpuMemcpyDeviceToDevice, s))
      return Status(e, "gdn_step");
  if (copy_ssm)
    if (gpuError_t e = gpuMemcpyAsync(args.ssm_state, ssm_state.typed_data(),
                                      ssm_state.size_bytes(), gpuMemcpyDeviceToDevice, s))
      return Status(e, "gdn_step");
  return Status(gpu::launch_gdn_step(s, d, args), "gdn_step");
}


// The fused attention decode step (attn.h, kernels_gpu_attn.cu); the CPU handler's operands.
ffi::Error AttnStepGpu(gpuStream_t s, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> q_norm,
                       ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> inv_freq,
                       ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                       ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> k_res,
                       ffi::ResultBuffer<ffi::F32> v_res, ffi::ResultBuffer<ffi::F32> part,
                       int64_t kv_len, int64_t rope_dim, int64_t chunk, bool gate, bool qk_norm,
                       bool interleaved, float eps, float scale) {
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
    if (gpuError_t e = gpuMemcpyAsync(args.k_cache, k_cache.typed_data(), k_cache.size_bytes(),
                                      gpuMemcpyDeviceToDevice, s))
      return Status(e, "attn_step");
  if (copy_v)
    if (gpuError_t e = gpuMemcpyAsync(args.v_cache, v_cache.typed_data(), v_cache.size_bytes(),
                                      gpuMemcpyDeviceToDevice, s))
      return Status(e, "attn_step");
  return Status(gpu::launch_attn_step(s, d, args), "attn_step");
}

}  // namespace
}  // namespace jaxvt

#define JAXVT_HANDLER_GPU
#define JAXVT_HANDLER_FILE_MAIN
#include "handlers/define.h"  // JaxvtStemGpu for the table's MAIN ops
