// Launch sizing shared by the matvec kernels (kernels_gpu.cu, kernels_gpu_experts.cu): grids of
// one wave of resident blocks, the opt-in shared-memory limit. Included by matvec.cuh, inside each
// kernel file's anonymous namespace. Not a standalone header.
#ifndef JAXVT_FFI_CSRC_MATVEC_LAUNCH_CUH_
#define JAXVT_FFI_CSRC_MATVEC_LAUNCH_CUH_

// Blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) resident at once
// on the device: a grid of this size runs in one wave, each warp looping over its share of the
// pieces (no partial last wave).
template <typename K>
int64_t resident_blocks(K kernel, int threads = kThreads, size_t smem = 0) {
  int per_sm = 0;
  if (gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != gpuSuccess ||
      per_sm < 1) {
    (void)gpuGetLastError();
    per_sm = 1;
  }
  return static_cast<int64_t>(per_sm) * sm_count();
}

// The most shared memory one block may use on this device (the opt-in limit, above the 48 KiB a
// launch gets by default), cached per process.
inline int64_t smem_optin() {
  static const int64_t v = [] {
    int dev = 0, n = 0;
    if (gpuGetDevice(&dev) != gpuSuccess ||
        gpuDeviceGetAttribute(&n, gpuDevAttrMaxSharedMemoryPerBlockOptin, dev) != gpuSuccess ||
        n < 49152) {
      (void)gpuGetLastError();
      n = 49152;
    }
    return static_cast<int64_t>(n);
  }();
  return v;
}

// Opts `kernel` in to dynamic shared memory up to the device's limit less `static_bytes` (call
// once per kernel, from a static initializer); returns the dynamic bytes a launch may then ask.
template <typename K>
int64_t allow_dyn_smem(K kernel, int64_t static_bytes) {
  const int64_t n = smem_optin() - static_bytes;
  if (n <= 0) return 0;
  if (gpuSetMaxDynamicSmem(kernel, static_cast<int>(n)) != gpuSuccess) {
    (void)gpuGetLastError();
    return 49152 - static_bytes > 0 ? 49152 - static_bytes : 0;
  }
  return n;
}

// The bulk-copy stage bytes a ggml-arithmetic matvec launch allocates (matvec_bulk.cuh): the
// Tuning's (-1: kBulkStage) on a CUDA device of compute capability 9.0 or later, else 0 (the
// per-warp windows). Two stages of this plus kBulkSpare bytes, and their barriers (bulk_smem),
// follow the held activation rows.
inline int64_t bulk_stage(const Tuning& t) {
  if (!bulk_engine() || t.bulk == 0) return 0;
  return t.bulk > 0 ? (t.bulk + 15) / 16 * 16 : kBulkStage;
}
// Dynamic shared memory for the stages and their two mbarriers.
inline int64_t bulk_smem(int64_t stage) { return stage > 0 ? 2 * (stage + kBulkSpare) + 16 : 0; }

inline int64_t blocks_for(int64_t warps_wanted, int64_t cap_blocks, int warps_per_block = kWarps) {
  int64_t b = (warps_wanted + warps_per_block - 1) / warps_per_block;
  if (b > cap_blocks) b = cap_blocks;
  return b < 1 ? 1 : b;
}

#endif  // JAXVT_FFI_CSRC_MATVEC_LAUNCH_CUH_
