// Defines the XLA FFI handler symbols of one handler file from the op table (ops.inc): include it
// at the end of the file, after its implementations, with JAXVT_HANDLER_FILE_<name> defined (MAIN,
// GGML or PREFETCH) and, in a GPU file, JAXVT_HANDLER_GPU. Every op whose platform column names
// the file gets JaxvtStemCpu (jaxvt::StemCpu) or JaxvtStemGpu (jaxvt::StemGpu, with the
// command-buffer trait where the table gives it), bound to the platform's context (context.h)
// followed by the table's binding.
//
// A GPU file is compiled by nvcc or hipcc and a CPU file by the host compiler, so each expands
// only its platform's handlers; the binding itself is the table's, written once.
#ifndef JAXVT_FFI_CSRC_HANDLERS_DEFINE_H_
#define JAXVT_FFI_CSRC_HANDLERS_DEFINE_H_

#include <cstdint>

#include "handlers/context.h"
#include "handlers/handlers.h"
#include "handlers/select.h"
#include "xla/ffi/api/ffi.h"

// The table's shared operand groups.
#define JAXVT_WEIGHT .Arg<ffi::AnyBuffer>() .Arg<U32>() .Arg<S32>() .Arg<S32>()
#define JAXVT_XFETCH                                                                        \
  .Arg<S32>() .Arg<S32>() .Arg<ffi::AnyBuffer>() .RemainingArgs() .RemainingRets()          \
      .Attr<ffi::Span<const int64_t>>("rows") .Attr<ffi::Span<const int64_t>>("cols")       \
      .Attr<ffi::Span<const int64_t>>("slot") .Attr<int64_t>("experts")                     \
      .Attr<int64_t>("n_host") .Attr<int64_t>("n_device") .Attr<int64_t>("when")            \
      .Attr<int64_t>("blocks") .Attr<int64_t>("scale")

// JAXVT_IN(column, ...) keeps its text only where the column names this file (the one that
// defines JAXVT_HANDLER_FILE_<column>).
#define JAXVT_IN(column, ...) JAXVT_IN_(column, __VA_ARGS__)
#define JAXVT_IN_(column, ...) JAXVT_IN_##column(__VA_ARGS__)
#define JAXVT_IN_0(...)
#if defined(JAXVT_HANDLER_FILE_MAIN)
#define JAXVT_IN_MAIN(...) __VA_ARGS__
#else
#define JAXVT_IN_MAIN(...)
#endif
#if defined(JAXVT_HANDLER_FILE_GGML)
#define JAXVT_IN_GGML(...) __VA_ARGS__
#else
#define JAXVT_IN_GGML(...)
#endif
#if defined(JAXVT_HANDLER_FILE_PREFETCH)
#define JAXVT_IN_PREFETCH(...) __VA_ARGS__
#else
#define JAXVT_IN_PREFETCH(...)
#endif

#define JAXVT_TRAITS_0
#define JAXVT_TRAITS_1 ::xla::ffi::Traits::kCmdBufferCompatible

#if defined(JAXVT_HANDLER_GPU)
#define JAXVT_PLATFORM(cpu, gpu) gpu
#define JAXVT_CONTEXT ffi::PlatformStream<gpuStream_t>
#define JAXVT_TRAITS(cmd) JAXVT_TRAITS_##cmd
#else
#define JAXVT_PLATFORM(cpu, gpu) cpu
#define JAXVT_CONTEXT ::jaxvt::NoStream
#define JAXVT_TRAITS(cmd)
#endif
#define JAXVT_SYMBOL(Stem) JAXVT_PASTE(Jaxvt##Stem, JAXVT_PLATFORM(Cpu, Gpu))
#define JAXVT_IMPL(Stem) JAXVT_PASTE(::jaxvt::Stem, JAXVT_PLATFORM(Cpu, Gpu))
#define JAXVT_PASTE(a, b) JAXVT_PASTE_(a, b)
#define JAXVT_PASTE_(a, b) a##b
#define JAXVT_OP(target, Stem, cpu, gpu, cmd, ...)                                          \
  JAXVT_IN(JAXVT_PLATFORM(cpu, gpu), namespace jaxvt::bind {                               \
    XLA_FFI_DEFINE_HANDLER_SYMBOL(JAXVT_SYMBOL(Stem), JAXVT_IMPL(Stem),                     \
                                  ffi::Ffi::Bind().Ctx<JAXVT_CONTEXT>() __VA_ARGS__,       \
                                  {JAXVT_TRAITS(cmd)});                                    \
  })
#include "handlers/ops.inc"
#undef JAXVT_OP

#endif  // JAXVT_FFI_CSRC_HANDLERS_DEFINE_H_
