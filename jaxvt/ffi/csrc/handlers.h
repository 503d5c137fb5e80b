// The XLA FFI handler symbols module.cc exposes (handlers_cpu.cc, handlers_gpu.cu).
#ifndef JAXVT_FFI_CSRC_HANDLERS_H_
#define JAXVT_FFI_CSRC_HANDLERS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxvtQMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxvtQMatmulExpertsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxvtQEmbedCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxvtQDequantCpu);

#if defined(JAXVT_WITH_GPU)
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxvtQMatmulGpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxvtQMatmulExpertsGpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxvtQEmbedGpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxvtQDequantGpu);
#endif

#endif  // JAXVT_FFI_CSRC_HANDLERS_H_
