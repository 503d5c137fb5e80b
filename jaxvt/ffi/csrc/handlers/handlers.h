// The handler symbols of every op in ops.inc, as module.cc registers them: JaxvtStemCpu for the
// ops with a CPU handler, JaxvtStemGpu for those with a GPU one (GPU builds).
#ifndef JAXVT_FFI_CSRC_HANDLERS_HANDLERS_H_
#define JAXVT_FFI_CSRC_HANDLERS_HANDLERS_H_

#include "handlers/select.h"
#include "xla/ffi/api/api.h"

#define JAXVT_OP(target, Stem, cpu, gpu, cmd, ...)                                  \
  JAXVT_IF(cpu, XLA_FFI_DECLARE_HANDLER_SYMBOL(Jaxvt##Stem##Cpu);)                 \
  JAXVT_IF_GPU(JAXVT_IF(gpu, XLA_FFI_DECLARE_HANDLER_SYMBOL(Jaxvt##Stem##Gpu);))
#include "handlers/ops.inc"
#undef JAXVT_OP

#endif  // JAXVT_FFI_CSRC_HANDLERS_HANDLERS_H_
