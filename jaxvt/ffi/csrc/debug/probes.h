// The GPU probes of the debug module jaxvt.ffi._jaxvt_debug (probes_gpu.cu): bandwidths of the
// link and of the kernels, measured on buffers of their own, never by the product's ops.
#ifndef JAXVT_FFI_CSRC_DEBUG_PROBES_H_
#define JAXVT_FFI_CSRC_DEBUG_PROBES_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace jaxvt::gpu_mem {

// GB/s (1e9 bytes/s). Negative on failure, with *err set.
// kind: the host memory's HostKind (the source of the copies / the memory read).
double measure_dma_h2d(size_t nbytes, int iters, int kind, std::string* err);
// blocks: the streaming kernel's grid (<= 0: four per multiprocessor).
// bulk: through the bulk-copy engine (kernels_gpu.h launch_stream_read).
double measure_zero_copy_read(size_t nbytes, int iters, bool coherent, int64_t blocks, int kind,
                              bool bulk, std::string* err);
// The matvec kernel alone, by grid (kernels_gpu.h Tuning: at most grid_cap blocks where > 0,
// else `waves` waves of resident blocks): `copies` matrices (pinned host tier, or device tier)
// read in turn (so no launch finds its matrix in the GPU's L2), timed with events around `iters`
// launches. ggml: ggml's arithmetic (integer dots), else float32; bulk: Tuning::bulk. l2 >= 0:
// each launch i is preceded by an L2 prefetch launch (launch_l2_prefetch) of copy i + l2 (0: its
// own matrix, 1: the next launch's); l2_only: the prefetch launches alone.
double measure_host_gemv(int fmt, int64_t rows, int64_t cols, int64_t row_bytes, int64_t batch,
                         int copies, int iters, int64_t grid_cap, int64_t waves, bool device_tier,
                         int kind, bool ggml, int64_t bulk, int l2, bool l2_only, std::string* err);
// The matvec kernel's output for given weights (rows x cols of format fmt at host address w,
// row_bytes a row) and x (batch x cols float32 at host address x), into y (batch x rows): the
// weights in the device tier (or the pinned host tier), ggml's arithmetic or float32, launched
// with Tuning::bulk = bulk and at most grid_cap blocks (0: the kernel's own grid). For tests
// that compare the kernel's paths bit for bit.
bool matvec_outputs(int fmt, int64_t rows, int64_t cols, int64_t row_bytes, int64_t batch,
                    uintptr_t w, uintptr_t x, uintptr_t y, bool device_tier, bool ggml,
                    int64_t bulk, int64_t grid_cap, std::string* err);
// First and repeated device read of host-written managed memory; false if unsupported.
bool measure_managed(size_t nbytes, double* first, double* repeat, std::string* err);

}  // namespace jaxvt::gpu_mem

#endif  // JAXVT_FFI_CSRC_DEBUG_PROBES_H_
