// XLA FFI handlers for platform "CUDA" (nvcc) or "ROCM" (hipcc) of the op table's MAIN ops
// (ops.inc: operands, results, attributes, traits). They only pass device pointers
// and static shapes to the launchers: the layer index, fmts, table and ids stay on the device and
// are read by the kernels. With no host-side per-step logic, each handler carries the
// command-buffer trait, so XLA may capture it into a CUDA graph and replay it.
#include <cstdint>
#include <optional>
#include <string>

#include "common/attn.h"
#include "common/gdn.h"
#include "common/route.h"
#include "common/vendor.h"
#include "handlers/handlers.h"
#include "handlers/steps.h"
#include "kernels/gpu/kernels_gpu.h"
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

// The expert cache's operands (expert_cache.h) on a stack's arguments.
gpu::WeightArgs WithCache(gpu::WeightArgs w, const ffi::Buffer<ffi::S32>& where,
                          const ffi::Buffer<ffi::U32>& ctab, int64_t cslot) {
  w.where = where.typed_data();
  w.ctab = ctab.typed_data();
  w.cslot = cslot;
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

// swiglu's down product: the kernels form swiglu(g, u) as they hold the activation rows.
ffi::Error SwigluQMatmulQ8Gpu(gpuStream_t s, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                              ffi::AnyBuffer data, ffi::Buffer<ffi::U32> table,
                              ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::U8> scratch,
                              int64_t rows, int64_t cols) {
  (void)scratch;
  if (g.element_count() != u.element_count())
    return ffi::Error::InvalidArgument("jaxvt swiglu product: g and u must have one shape");
  gpu::WeightArgs w = Weights(data, table, fmts, layer);
  w.up = u.typed_data();
  const int64_t batch = static_cast<int64_t>(g.element_count()) / cols;
  return Status(gpu::launch_qmatmul(s, w, g.typed_data(), batch, y->typed_data(), rows, cols,
                                    true),
                "swiglu qmatmul (ggml arithmetic)");
}

// The routed experts (kernels_gpu_experts.cu) in float32 or ggml's arithmetic.
ffi::Error Experts(gpuStream_t s, const ffi::Buffer<ffi::F32>& x, const gpu::WeightArgs& w,
                   const ffi::Buffer<ffi::S32>& ids, float* y, int64_t rows, int64_t cols,
                   int64_t experts, bool ggml, const char* op) {
  const int64_t slots = static_cast<int64_t>(ids.element_count());
  auto idd = ids.dimensions();
  const int64_t k = idd.size() >= 1 ? idd.back() : 1;
  const bool per_slot = static_cast<int64_t>(x.element_count()) / cols == slots;
  return Status(gpu::launch_qmatmul_experts(s, w, x.typed_data(), per_slot, ids.typed_data(), slots,
                                            k, y, rows, cols, experts, ggml),
                op);
}

// The CPU's jaxvt_qmatmul_experts_q8 signature; the activation scratch is not needed here.
ffi::Error QMatmulExpertsQ8Gpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                               ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                               std::optional<ffi::Buffer<ffi::U8>> ring,
                               ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::U8> scratch,
                               int64_t rows, int64_t cols, int64_t experts) {
  (void)scratch;
  return Experts(s, x, WithRing(Weights(data, table, fmts, layer), ring), ids, y->typed_data(),
                 rows, cols, experts, true, "qmatmul_experts (ggml arithmetic)");
}

ffi::Error SwigluExpertsQ8Gpu(gpuStream_t s, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                              ffi::AnyBuffer data, ffi::Buffer<ffi::U32> table,
                              ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> ids, std::optional<ffi::Buffer<ffi::U8>> ring,
                              ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::U8> scratch,
                              int64_t rows, int64_t cols, int64_t experts) {
  (void)scratch;
  if (g.element_count() != u.element_count())
    return ffi::Error::InvalidArgument("jaxvt swiglu product: g and u must have one shape");
  gpu::WeightArgs w = WithRing(Weights(data, table, fmts, layer), ring);
  w.up = u.typed_data();
  return Experts(s, g, w, ids, y->typed_data(), rows, cols, experts, true,
                 "swiglu qmatmul_experts (ggml arithmetic)");
}

ffi::Error QMatmulExpertsGpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                             ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                             std::optional<ffi::Buffer<ffi::U8>> ring,
                             ffi::ResultBuffer<ffi::F32> y, int64_t rows, int64_t cols,
                             int64_t experts) {
  return Experts(s, x, WithRing(Weights(data, table, fmts, layer), ring), ids, y->typed_data(),
                 rows, cols, experts, false, "qmatmul_experts");
}

ffi::Error QMatmulExpertsCachedGpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                                   ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                                   ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                                   ffi::Buffer<ffi::S32> where, ffi::Buffer<ffi::U32> ctab,
                                   std::optional<ffi::Buffer<ffi::U8>> ring,
                                   ffi::ResultBuffer<ffi::F32> y, int64_t rows, int64_t cols,
                                   int64_t experts, int64_t cslot) {
  const auto w = WithCache(WithRing(Weights(data, table, fmts, layer), ring), where, ctab, cslot);
  return Experts(s, x, w, ids, y->typed_data(), rows, cols, experts, false,
                 "qmatmul_experts (expert cache)");
}

ffi::Error QMatmulExpertsCachedQ8Gpu(gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                                     ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                                     ffi::Buffer<ffi::S32> where, ffi::Buffer<ffi::U32> ctab,
                                     std::optional<ffi::Buffer<ffi::U8>> ring,
                                     ffi::ResultBuffer<ffi::F32> y,
                                     ffi::ResultBuffer<ffi::U8> scratch, int64_t rows,
                                     int64_t cols, int64_t experts, int64_t cslot) {
  (void)scratch;
  const auto w = WithCache(WithRing(Weights(data, table, fmts, layer), ring), where, ctab, cslot);
  return Experts(s, x, w, ids, y->typed_data(), rows, cols, experts, true,
                 "qmatmul_experts (ggml arithmetic, expert cache)");
}

ffi::Error SwigluExpertsCachedQ8Gpu(gpuStream_t s, ffi::Buffer<ffi::F32> g,
                                    ffi::Buffer<ffi::F32> u, ffi::AnyBuffer data,
                                    ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                                    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                                    ffi::Buffer<ffi::S32> where, ffi::Buffer<ffi::U32> ctab,
                                    std::optional<ffi::Buffer<ffi::U8>> ring,
                                    ffi::ResultBuffer<ffi::F32> y,
                                    ffi::ResultBuffer<ffi::U8> scratch, int64_t rows,
                                    int64_t cols, int64_t experts, int64_t cslot) {
  (void)scratch;
  if (g.element_count() != u.element_count())
    return ffi::Error::InvalidArgument("jaxvt swiglu product: g and u must have one shape");
  gpu::WeightArgs w =
      WithCache(WithRing(Weights(data, table, fmts, layer), ring), where, ctab, cslot);
  w.up = u.typed_data();
  return Experts(s, g, w, ids, y->typed_data(), rows, cols, experts, true,
                 "swiglu qmatmul_experts (ggml arithmetic, expert cache)");
}

ffi::Error ExpertCacheAssignGpu(gpuStream_t s, ffi::Buffer<ffi::S32> ids,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::U32> stab,
                                ffi::ResultBuffer<ffi::S32> where) {
  return Status(gpu::launch_expert_cache_assign(
                    s, ids.typed_data(), static_cast<int64_t>(ids.element_count()),
                    layer.typed_data(), stab.typed_data(),
                    static_cast<int64_t>(stab.element_count()) / 2, where->typed_data()),
                "expert_cache_assign");
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

ffi::Error QMatmulExperts2CachedGpu(
    gpuStream_t s, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data0, ffi::Buffer<ffi::U32> table0,
    ffi::Buffer<ffi::S32> fmts0, ffi::AnyBuffer data1, ffi::Buffer<ffi::U32> table1,
    ffi::Buffer<ffi::S32> fmts1, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
    ffi::Buffer<ffi::S32> where, ffi::Buffer<ffi::U32> ctab0, ffi::Buffer<ffi::U32> ctab1,
    std::optional<ffi::Buffer<ffi::U8>> ring0, std::optional<ffi::Buffer<ffi::U8>> ring1,
    ffi::ResultBuffer<ffi::F32> y0, ffi::ResultBuffer<ffi::F32> y1, int64_t rows, int64_t cols,
    int64_t experts, int64_t ggml, int64_t cslot0, int64_t cslot1) {
  const int64_t slots = static_cast<int64_t>(ids.element_count());
  auto idd = ids.dimensions();
  const int64_t k = idd.size() >= 1 ? idd.back() : 1;
  const bool per_slot = static_cast<int64_t>(x.element_count()) / cols == slots;
  const auto w0 = WithCache(WithRing(Weights(data0, table0, fmts0, layer), ring0), where, ctab0,
                            cslot0);
  const auto w1 = WithCache(WithRing(Weights(data1, table1, fmts1, layer), ring1), where, ctab1,
                            cslot1);
  return Status(gpu::launch_qmatmul_experts2(s, w0, w1, x.typed_data(), per_slot,
                                             ids.typed_data(), slots, k, y0->typed_data(),
                                             y1->typed_data(), rows, cols, experts, ggml != 0),
                "qmatmul_experts2 (expert cache)");
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

// The fused steps (steps.h) on XLA's stream (gdn.h, kernels_gpu_gdn.cu; attn.h,
// kernels_gpu_attn.cu; route.h, kernels_gpu_route.cu; norm.h, kernels_gpu_norm.cu).
struct GpuSteps {
  using Stream = gpuStream_t;
  static constexpr auto route = &gpu::launch_moe_route;
  static constexpr auto norm = &gpu::launch_add_norm;
  static constexpr auto gdn = &gpu::launch_gdn_step;
  static constexpr auto attn = &gpu::launch_attn_step;
  template <typename Kernel, typename... A>
  static ffi::Error run(Stream s, const char* op, Kernel kernel, const A&... a) {
    return Status(kernel(s, a...), op);
  }
  static ffi::Error copy(Stream s, void* dst, const void* src, size_t nbytes, const char* op) {
    return Status(gpuMemcpyAsync(dst, src, nbytes, gpuMemcpyDeviceToDevice, s), op);
  }
};
constexpr auto MoeRouteGpu = steps::MoeRoute<GpuSteps>;
constexpr auto AddNormGpu = steps::AddNorm<GpuSteps>;
constexpr auto GdnStepGpu = steps::GdnStep<GpuSteps>;
constexpr auto AttnStepGpu = steps::AttnStep<GpuSteps>;

}  // namespace
}  // namespace jaxvt

#define JAXVT_HANDLER_GPU
#define JAXVT_HANDLER_FILE_MAIN
#include "handlers/define.h"  // JaxvtStemGpu for the table's MAIN ops
