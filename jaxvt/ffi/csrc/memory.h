// Host-tier memory and bandwidth probes, as module.cc sees them. The GPU implementation is
// memory_gpu.cu (CUDA or HIP); module.cc has the CPU one (aligned plain memory, memcpy numbers).
#ifndef JAXVT_FFI_CSRC_MEMORY_H_
#define JAXVT_FFI_CSRC_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace jaxvt::gpu_mem {

int device_count();  // 0 when the runtime finds no device (or fails to start)
int sm_count();      // multiprocessors of the current device

// Pinned, device-mapped host memory. Returns false (and *err) on failure, having freed anything
// it allocated. coherent: HIP fine-grained (bypasses the GPU L2) vs coarse-grained memory; CUDA
// pinned memory is coherent either way.
bool host_alloc(size_t nbytes, bool coherent, uintptr_t* host, uintptr_t* device, std::string* err);
void host_free(uintptr_t host);

// Managed memory; false with *err empty when the device cannot use it concurrently.
bool managed_alloc(size_t nbytes, uintptr_t* ptr, std::string* err);
void managed_free(uintptr_t ptr);

// GB/s (1e9 bytes/s). Negative on failure, with *err set.
double measure_dma_h2d(size_t nbytes, int iters, std::string* err);
// blocks: the streaming kernel's grid (<= 0: four per multiprocessor).
double measure_zero_copy_read(size_t nbytes, int iters, bool coherent, int64_t blocks,
                              std::string* err);
// Probe of the matvec kernel, by grid size (grid_cap <= 0: the kernel's default): `copies` matrices (pinned host tier, or device tier) read in turn (so no
// launch finds its matrix in the GPU's L2), timed with events around `iters` launches.
double measure_host_gemv(int fmt, int64_t rows, int64_t cols, int64_t row_bytes, int64_t batch,
                         int copies, int iters, int64_t grid_cap, bool device_tier,
                         std::string* err);
// First and repeated device read of host-written managed memory; false if unsupported.
bool measure_managed(size_t nbytes, double* first, double* repeat, std::string* err);

}  // namespace jaxvt::gpu_mem

#endif  // JAXVT_FFI_CSRC_MEMORY_H_
