// 32 float32 values rounded to bf16 (formats.h float_to_bf16) and stored as four 16-byte words:
// the unit in which the staging kernel (kernels_gpu.cu) and the grouped product's weight tiles
// (kernels_gpu_grouped.cu) write dequantized weights. Compiled by nvcc or hipcc only.
#ifndef JAXVT_FFI_CSRC_KERNELS_GPU_BF16_CUH_
#define JAXVT_FFI_CSRC_KERNELS_GPU_BF16_CUH_

#include <cstdint>

#include "common/formats.h"
#include "common/vendor.h"

namespace jaxvt::gpu {

__device__ __forceinline__ void store_bf16x32(uint16_t* o, const float* wv) {
  uint32_t p[16];
#pragma unroll
  for (int j = 0; j < 16; ++j)
    p[j] = static_cast<uint32_t>(float_to_bf16(wv[2 * j])) |
           (static_cast<uint32_t>(float_to_bf16(wv[2 * j + 1])) << 16);
  uint4* o4 = reinterpret_cast<uint4*>(o);
#pragma unroll
  for (int j = 0; j < 4; ++j) o4[j] = make_uint4(p[4 * j], p[4 * j + 1], p[4 * j + 2], p[4 * j + 3]);
}

}  // namespace jaxvt::gpu

#endif  // JAXVT_FFI_CSRC_KERNELS_GPU_BF16_CUH_
