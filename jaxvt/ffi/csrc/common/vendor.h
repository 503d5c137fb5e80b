// One header that maps the gpu* names used by jaxvt's device code onto CUDA or HIP.
//
// The same sources compile with nvcc (JAXVT_GPU_CUDA) and with hipcc -x hip (JAXVT_GPU_HIP), in the
// manner of jaxlib's gpu/vendor.h. Device code must use only the names defined here (plus the
// language's common subset: __global__, __shared__, threadIdx, <<<...>>>), never cuda*/hip* directly.
//
// Warps: jaxvt kernels are written for a *logical* warp of 32 lanes. On NVIDIA and on AMD wave32
// parts (RDNA) it is the hardware warp; on AMD wave64 parts (CDNA) a wavefront holds two logical
// warps, and shuffles pass width 32 so they never cross between them.
#ifndef JAXVT_FFI_CSRC_VENDOR_H_
#define JAXVT_FFI_CSRC_VENDOR_H_

#if defined(JAXVT_GPU_CUDA)

#include <cuda_runtime.h>

#define JAXVT_GPU_NAME "CUDA"
typedef cudaStream_t gpuStream_t;
typedef cudaError_t gpuError_t;
typedef cudaEvent_t gpuEvent_t;
#define gpuSuccess cudaSuccess
#define gpuErrorMemoryAllocation cudaErrorMemoryAllocation
#define gpuErrorInvalidValue cudaErrorInvalidValue
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuGetDevice cudaGetDevice
#define gpuSetDevice cudaSetDevice
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuDevAttrConcurrentManagedAccess cudaDevAttrConcurrentManagedAccess
#define gpuDeviceSynchronize cudaDeviceSynchronize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuMemGetInfo cudaMemGetInfo
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuMemcpyDefault cudaMemcpyDefault
#define gpuMemsetAsync cudaMemsetAsync
#define gpuStreamCreate cudaStreamCreate
#define gpuStreamDestroy cudaStreamDestroy
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuEventCreate cudaEventCreate
#define gpuEventDestroy cudaEventDestroy
#define gpuEventRecord cudaEventRecord
#define gpuEventSynchronize cudaEventSynchronize
#define gpuEventElapsedTime cudaEventElapsedTime
#define gpuEventCreateWithFlags cudaEventCreateWithFlags
#define gpuEventDisableTiming cudaEventDisableTiming
#define gpuStreamWaitEvent cudaStreamWaitEvent
#define gpuStreamCreateWithPriority cudaStreamCreateWithPriority
#define gpuStreamNonBlocking cudaStreamNonBlocking
#define gpuDeviceGetStreamPriorityRange cudaDeviceGetStreamPriorityRange
// A thread's short pause in a device-side wait loop (about a microsecond).
#define gpuSleep() __nanosleep(1000)
// Pinned host memory. CUDA's pinned memory is always coherent; the coherent/non-coherent flags
// exist on HIP only and are 0 here so callers can pass them unconditionally.
#define gpuHostAlloc cudaHostAlloc
#define gpuFreeHost cudaFreeHost
#define gpuHostGetDevicePointer cudaHostGetDevicePointer
#define gpuHostAllocMapped cudaHostAllocMapped
#define gpuHostAllocPortable cudaHostAllocPortable
#define gpuHostAllocCoherent 0u
#define gpuHostAllocNonCoherent 0u
#define gpuHostAllocWriteCombined cudaHostAllocWriteCombined
#define gpuHostRegister cudaHostRegister
#define gpuHostUnregister cudaHostUnregister
#define gpuHostRegisterMapped cudaHostRegisterMapped
#define gpuHostRegisterPortable cudaHostRegisterPortable
#define gpuMallocManaged cudaMallocManaged
#define gpuMemAttachGlobal cudaMemAttachGlobal

#define gpuShflXor(v, o) __shfl_xor_sync(0xffffffffu, (v), (o), 32)
#define gpuSyncWarp() __syncwarp()
#define gpuDevAttrMaxSharedMemoryPerBlockOptin cudaDevAttrMaxSharedMemoryPerBlockOptin
// c + the dot product of a's and b's four signed bytes.
#define gpuDp4a(a, b, c) __dp4a((a), (b), (c))
// Lets blocks of `kernel` use up to `bytes` of dynamic shared memory (above the 48 KiB default).
template <typename K>
inline gpuError_t gpuSetMaxDynamicSmem(K kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
// Reads of shared memory through an address in the shared window (ld.shared: no generic-address
// resolution per load, 32-bit address arithmetic). gpuSmemAt converts a generic pointer known to
// point into shared memory; an address plus a byte offset is an address. The asm is volatile with
// a memory clobber so the compiler never moves a read across the stores that fill the buffer.
typedef uint32_t gpuSmemAddr;
__device__ __forceinline__ gpuSmemAddr gpuSmemAt(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t gpuLdsU32(gpuSmemAddr a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ uint2 gpuLdsU2(gpuSmemAddr a) {  // a: 8-byte aligned
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ uint4 gpuLdsU4(gpuSmemAddr a) {  // a: 16-byte aligned
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
// The low 32 bits of (hi:lo) >> sh, sh in [0, 32).
#define gpuFunnelR(lo, hi, sh) __funnelshift_r((lo), (hi), (sh))

#elif defined(JAXVT_GPU_HIP)

#include <hip/hip_runtime.h>

#define JAXVT_GPU_NAME "ROCM"
typedef hipStream_t gpuStream_t;
typedef hipError_t gpuError_t;
typedef hipEvent_t gpuEvent_t;
#define gpuSuccess hipSuccess
#define gpuErrorMemoryAllocation hipErrorOutOfMemory
#define gpuErrorInvalidValue hipErrorInvalidValue
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuGetDevice hipGetDevice
#define gpuSetDevice hipSetDevice
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuDevAttrConcurrentManagedAccess hipDeviceAttributeConcurrentManagedAccess
#define gpuDeviceSynchronize hipDeviceSynchronize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuMemGetInfo hipMemGetInfo
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuMemcpyDefault hipMemcpyDefault
#define gpuMemsetAsync hipMemsetAsync
#define gpuStreamCreate hipStreamCreate
#define gpuStreamDestroy hipStreamDestroy
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuEventCreate hipEventCreate
#define gpuEventDestroy hipEventDestroy
#define gpuEventRecord hipEventRecord
#define gpuEventSynchronize hipEventSynchronize
#define gpuEventElapsedTime hipEventElapsedTime
#define gpuEventCreateWithFlags hipEventCreateWithFlags
#define gpuEventDisableTiming hipEventDisableTiming
#define gpuStreamWaitEvent hipStreamWaitEvent
#define gpuStreamCreateWithPriority hipStreamCreateWithPriority
#define gpuStreamNonBlocking hipStreamNonBlocking
#define gpuDeviceGetStreamPriorityRange hipDeviceGetStreamPriorityRange
// A thread's short pause in a device-side wait loop (s_sleep 127: 127 x 64 clocks).
#define gpuSleep() __builtin_amdgcn_s_sleep(127)
// Fine-grained ("coherent") host memory is not cached in the GPU's L2; coarse-grained
// ("non-coherent") is. Weights are written once before any kernel reads them, so both are correct;
// which one reads faster is a measurement (HostTier(coherent=...)).
#define gpuHostAlloc hipHostMalloc
#define gpuFreeHost hipHostFree
#define gpuHostGetDevicePointer hipHostGetDevicePointer
#define gpuHostAllocMapped hipHostMallocMapped
#define gpuHostAllocPortable hipHostMallocPortable
#define gpuHostAllocCoherent hipHostMallocCoherent
#define gpuHostAllocNonCoherent hipHostMallocNonCoherent
#define gpuHostAllocWriteCombined hipHostMallocWriteCombined
#define gpuHostRegister hipHostRegister
#define gpuHostUnregister hipHostUnregister
#define gpuHostRegisterMapped hipHostRegisterMapped
#define gpuHostRegisterPortable hipHostRegisterPortable
#define gpuMallocManaged hipMallocManaged
#define gpuMemAttachGlobal hipMemAttachGlobal

#define gpuShflXor(v, o) __shfl_xor((v), (o), 32)
#define gpuDevAttrMaxSharedMemoryPerBlockOptin hipDeviceAttributeMaxSharedMemoryPerBlock
// c + the dot product of a's and b's four signed bytes (written out: the dot4 instructions differ
// between AMD generations).
__device__ __forceinline__ int gpuDp4a(int a, int b, int c) {
  return c + static_cast<int>(static_cast<signed char>(a)) * static_cast<signed char>(b) +
         static_cast<int>(static_cast<signed char>(a >> 8)) * static_cast<signed char>(b >> 8) +
         static_cast<int>(static_cast<signed char>(a >> 16)) * static_cast<signed char>(b >> 16) +
         static_cast<int>(static_cast<signed char>(a >> 24)) * static_cast<signed char>(b >> 24);
}
template <typename K>
inline gpuError_t gpuSetMaxDynamicSmem(K kernel, int bytes) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             hipFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
// Shared-memory reads (see the CUDA side): the compiler infers LDS from the pointer here.
typedef const uint8_t* gpuSmemAddr;
__device__ __forceinline__ gpuSmemAddr gpuSmemAt(const void* p) { return static_cast<const uint8_t*>(p); }
__device__ __forceinline__ uint32_t gpuLdsU32(gpuSmemAddr a) { return *reinterpret_cast<const uint32_t*>(a); }
__device__ __forceinline__ uint2 gpuLdsU2(gpuSmemAddr a) { return *reinterpret_cast<const uint2*>(a); }
__device__ __forceinline__ uint4 gpuLdsU4(gpuSmemAddr a) { return *reinterpret_cast<const uint4*>(a); }
__device__ __forceinline__ uint32_t gpuFunnelR(uint32_t lo, uint32_t hi, uint32_t sh) {
  return static_cast<uint32_t>(((static_cast<uint64_t>(hi) << 32) | lo) >> sh);
}
// Orders this wavefront's shared-memory writes before its later reads (lanes run in lock step).
#define gpuSyncWarp()                                        \
  do {                                                       \
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");   \
    __builtin_amdgcn_wave_barrier();                         \
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");   \
  } while (0)

#else
#error "vendor.h needs JAXVT_GPU_CUDA or JAXVT_GPU_HIP"
#endif

#endif  // JAXVT_FFI_CSRC_VENDOR_H_
