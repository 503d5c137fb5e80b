// The context every handler takes first (ops.inc, define.h): the platform's stream on a GPU
// (PlatformStream<gpuStream_t>) and NoStream on the CPU, where ops run in order on the host. So
// the CPU and GPU bindings of an op differ in that type alone, and a handler body written over it
// serves both platforms (steps.h).
#ifndef JAXVT_FFI_CSRC_HANDLERS_CONTEXT_H_
#define JAXVT_FFI_CSRC_HANDLERS_CONTEXT_H_

#include <optional>

#include "xla/ffi/api/ffi.h"

namespace jaxvt {
struct NoStream {};
}  // namespace jaxvt

// The buffer types of the op table's bindings (ops.inc) and the handlers written over it.
namespace jaxvt::bind {
namespace ffi = xla::ffi;
using F32 = ffi::Buffer<ffi::F32>;
using BF16 = ffi::Buffer<ffi::BF16>;
using S32 = ffi::Buffer<ffi::S32>;
using U32 = ffi::Buffer<ffi::U32>;
using U8 = ffi::Buffer<ffi::U8>;
}  // namespace jaxvt::bind

// Decodes to NoStream{} from any call; reads nothing from XLA's context.
template <>
struct xla::ffi::CtxDecoding<jaxvt::NoStream> {
  using Type = jaxvt::NoStream;
  template <typename Context>
  static std::optional<Type> Decode(const XLA_FFI_Api*, Context*, DiagnosticEngine&) {
    return Type{};
  }
};

#endif  // JAXVT_FFI_CSRC_HANDLERS_CONTEXT_H_
