// GPU-side helpers of the host tier (memory_gpu.cu) shared with the debug module's probes.
// Compiled by nvcc or hipcc only.
#ifndef JAXVT_FFI_CSRC_MEMORY_MEMORY_GPU_H_
#define JAXVT_FFI_CSRC_MEMORY_MEMORY_GPU_H_

#include <string>

#include "common/vendor.h"

namespace jaxvt::gpu_mem {

// True on success; else *err (when given) names `what` and the runtime's error, which is cleared.
inline bool ok(gpuError_t e, const char* what, std::string* err) {
  if (e == gpuSuccess) return true;
  if (err) *err = std::string(what) + ": " + gpuGetErrorString(e);
  (void)gpuGetLastError();
  return false;
}

}  // namespace jaxvt::gpu_mem

#endif  // JAXVT_FFI_CSRC_MEMORY_MEMORY_GPU_H_
