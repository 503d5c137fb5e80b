// Programmatic dependent launch (CUDA, Hopper and later): the decode step's kernels are launched
// with the programmatic stream serialization attribute, so a kernel's blocks may be scheduled while
// the kernel before it on the stream is still running (its blocks call
// griddepcontrol.launch_dependents on entry), and each kernel waits (griddepcontrol.wait) for the
// one before it to complete and its memory to be visible before reading anything. A kernel launched
// so must call pdl_enter() first. What is overlapped is the launch and the blocks' scheduling, not
// any read: the arithmetic and its inputs are those of a plain launch. Elsewhere (HIP, an older
// device, pdl_enabled() false) these are a plain launch and a no-op.
#ifndef JAXVT_FFI_CSRC_PDL_CUH_
#define JAXVT_FFI_CSRC_PDL_CUH_

#include <utility>

#include "common/vendor.h"

namespace jaxvt::gpu {

bool pdl_enabled();  // kernels_gpu.cu

__device__ __forceinline__ void pdl_enter() {
#if defined(JAXVT_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename... P, typename... A>
gpuError_t launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, gpuStream_t s,
                      A&&... args) {
#if defined(JAXVT_GPU_CUDA)
  if (pdl_enabled()) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
  }
#endif
  kernel<<<grid, block, smem, s>>>(std::forward<A>(args)...);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu

#endif  // JAXVT_FFI_CSRC_PDL_CUH_
