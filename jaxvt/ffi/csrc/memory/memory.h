// Host-tier memory, as module.cc sees it. The GPU implementation is memory_gpu.cu (CUDA or HIP);
// module.cc has the CPU one (aligned plain memory).
#ifndef JAXVT_FFI_CSRC_MEMORY_H_
#define JAXVT_FFI_CSRC_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jaxvt::gpu_mem {

int device_count();  // 0 when the runtime finds no device (or fails to start)
int sm_count();      // multiprocessors of the current device

// How host-tier memory is allocated (HostTier(kind=...); a benchmark switches it):
//   kPinned         gpuHostAlloc(Mapped | Portable [| coherence flag on HIP])
//   kWriteCombined  the same | WriteCombined: not snooped by device reads, write-combined (and very
//                   slow to read) on the CPU; weights are written once and never read back there
//   kHugePages      anonymous memory on 2 MiB boundaries with MADV_HUGEPAGE, touched, then pinned
//                   and mapped with gpuHostRegister(Mapped | Portable): fewer, larger pages for the
//                   device to translate
enum HostKind : int { kPinned = 0, kWriteCombined = 1, kHugePages = 2 };

// Pinned, device-mapped host memory. Returns false (and *err) on failure, having freed anything
// it allocated. coherent: HIP fine-grained (bypasses the GPU L2) vs coarse-grained memory; CUDA
// pinned memory is coherent either way. host_free knows how each address was allocated.
bool host_alloc(size_t nbytes, bool coherent, int kind, uintptr_t* host, uintptr_t* device,
                std::string* err);
void host_free(uintptr_t host);

// Managed memory; false with *err empty when the device cannot use it concurrently.
bool managed_alloc(size_t nbytes, uintptr_t* ptr, std::string* err);
void managed_free(uintptr_t ptr);

// Copies nbytes from host memory at src (pinned: a DMA at the link's rate) to device memory at
// dst on GPU `device`, on a stream of its own, and returns once the bytes are there; false (and
// *err) on failure. For the loader, which writes weights into device arrays nothing else touches
// while it does.
bool copy_h2d(uintptr_t dst, uintptr_t src, size_t nbytes, int device, std::string* err);

// Whether [device_addr, device_addr + nbytes) lies inside one live host_alloc allocation (by its
// device address).
bool host_range_live(uintptr_t device_addr, size_t nbytes);

// Prefetch (handlers/gpu_prefetch.cu, prefetch.h): the host tier's record of each layer's address
// in a QWeight's table (0 for a device-tier layer), by the table's device address, kept beside
// its record of live allocations, so that a fetch the host can address is a
// DMA (the copy engine: no multiprocessor taken from the layers computing beside it) instead of a
// copy kernel. Checked before use (the source must be a live host_alloc range, and on the device
// the table must hold that address), so a stale entry only costs the DMA's speed.
// addrs: L addresses, then L formats (fmts[l], host bit included).
void prefetch_register(uintptr_t table, std::vector<uint64_t> addrs);
void prefetch_unregister(uintptr_t table);
// Whether `table` is registered; if so, layer l's entry: *addr (0 for a device-tier layer) and
// *fmt (fmts[l], host bit included), both 0 where l is out of range.
bool prefetch_layer(uintptr_t table, int64_t l, uint64_t* addr, int32_t* fmt);

}  // namespace jaxvt::gpu_mem

#endif  // JAXVT_FFI_CSRC_MEMORY_H_
