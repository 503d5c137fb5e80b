// XLA FFI handlers (platform "cpu") of the ggml-exact ops (kernels_cpu_ggml.h). jaxvt.ffi.ops
// calls them only on CPU; other platforms run their jnp formulas (same rounding points).
#include <cstdint>

#include "handlers/context.h"
#include "handlers/handlers.h"
#include "kernels/cpu/kernels_cpu_ggml.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxvt {
namespace {

int64_t LastDim(const ffi::Buffer<ffi::F32>& b) {
  auto d = b.dimensions();
  return d.size() == 0 ? 1 : d.back();
}

ffi::Error RmsNormCpu(NoStream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y, float eps) {
  const int64_t d = LastDim(x);
  if (static_cast<int64_t>(w.element_count()) != d)
    return ffi::Error::InvalidArgument("jaxvt_rms_norm: weight length differs from the row length");
  cpu::ggml::rms_norm(x.typed_data(), w.typed_data(), static_cast<int64_t>(x.element_count()) / d,
                      d, eps, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error SwigluCpu(NoStream, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                     ffi::ResultBuffer<ffi::F32> y) {
  const int64_t d = LastDim(g);
  cpu::ggml::swiglu(g.typed_data(), u.typed_data(), static_cast<int64_t>(g.element_count()) / d,
                    d, y->typed_data());
  return ffi::Error::Success();
}

// x [..., T, H, hd] with positions [..., T] (one per token).
ffi::Error RopeCpu(NoStream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> pos,
                   ffi::ResultBuffer<ffi::F32> y, int64_t n_dims, float base, int64_t neox) {
  auto d = x.dimensions();
  if (d.size() < 2) return ffi::Error::InvalidArgument("jaxvt_rope: x must be [..., heads, dim]");
  const int64_t hd = d[d.size() - 1], nh = d[d.size() - 2];
  const int64_t ntok = static_cast<int64_t>(pos.element_count());
  if (ntok * nh * hd != static_cast<int64_t>(x.element_count()) || n_dims > hd || n_dims % 2)
    return ffi::Error::InvalidArgument("jaxvt_rope: positions do not match x, or bad rope dims");
  cpu::ggml::rope(x.typed_data(), pos.typed_data(), ntok, nh, hd, n_dims, base, neox != 0,
                  y->typed_data());
  return ffi::Error::Success();
}

// q [B, T, H, D]; caches [A, B, S, K, D|Dv] (f16 or f32); layer []; pos [B, T]; nq [B].
ffi::Error AttentionCpu(NoStream, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc, ffi::AnyBuffer vc,
                        ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pos,
                        ffi::Buffer<ffi::S32> nq, ffi::ResultBuffer<ffi::F32> o, int64_t kv_len,
                        float scale) {
  auto qd = q.dimensions(), kd = kc.dimensions(), vd = vc.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || kc.element_type() != vc.element_type())
    return ffi::Error::InvalidArgument("jaxvt_attention: bad operand ranks or cache types");
  const bool half = kc.element_type() == ffi::DataType::F16;
  if (!half && kc.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("jaxvt_attention: the KV cache must be float16 or float32");
  cpu::ggml::AttnArgs a{};
  a.B = qd[0];
  a.T = qd[1];
  a.H = qd[2];
  a.D = qd[3];
  a.S = kd[2];
  a.K = kd[3];
  a.Dv = vd[4];
  a.kv_len = kv_len < a.S ? kv_len : a.S;
  a.scale = scale;
  if (kd[1] != a.B || kd[4] != a.D || vd[2] != a.S || vd[3] != a.K || a.H % a.K || a.kv_len % 8)
    return ffi::Error::InvalidArgument("jaxvt_attention: cache shapes do not match q");
  int64_t l = layer.typed_data()[0];
  l = l < 0 ? 0 : (l >= kd[0] ? kd[0] - 1 : l);
  const size_t es = half ? 2 : 4;
  a.k = static_cast<const uint8_t*>(kc.untyped_data()) + l * a.B * a.S * a.K * a.D * es;
  a.v = static_cast<const uint8_t*>(vc.untyped_data()) + l * a.B * a.S * a.K * a.Dv * es;
  a.q = q.typed_data();
  a.pos = pos.typed_data();
  a.nq = nq.typed_data();
  a.o = o->typed_data();
  cpu::ggml::attention(a, half);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxvt

#define JAXVT_HANDLER_FILE_GGML
#include "handlers/define.h"  // JaxvtStemCpu for the table's GGML ops
