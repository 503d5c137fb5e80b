// The matvec core's block-level streaming under ggml's arithmetic (matvec.cuh includes it, inside
// each kernel file's anonymous namespace; not a standalone header): whole rows of a quantized
// matrix cross into shared memory through the bulk-copy engine (cp.async.bulk, CUDA sm_90 and
// later), two chunks in flight per block, while the block's threads quantize the activations;
// the warps then take the chunk's rows and dot them with the per-unit code of matvec_q8.cuh.
//
// Why: the per-warp windows of matvec() keep one 2 KiB window in flight per warp and spend most of
// their instructions on moving bytes (loads into registers, stores into the slot, carries, window
// cuts). Measured on an H100 (ncu, a 9 MiB Q4_K matrix): 2.3 bytes per warp instruction, a 25%
// occupancy, and 18% of DRAM bandwidth. Here one thread's bulk copy moves up to a stage of bytes
// with no register traffic, every block has two stages in flight from its first cycle, and the
// warps do only the dots.
//
// Same bits: a row's unit g is lane g % 32's, each lane adds its units in increasing order, and
// the warp reduces in warp_sum's order (write_rows, or write_pair for two rows of at most 16
// units at one activation row), exactly as matvec() does for a row it reads in windows. So a row
// gives the same bits from this path, from matvec()'s windows (a host-tier layer read with the
// expert cache's fill, a HIP build, a device without the engine) and at any grid.
#ifndef JAXVT_FFI_CSRC_MATVEC_BULK_CUH_
#define JAXVT_FFI_CSRC_MATVEC_BULK_CUH_

#if defined(JAXVT_GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JAXVT_BULK_DEVICE 1
#else
#define JAXVT_BULK_DEVICE 0
#endif

// A stage's default size: whole rows plus up to 15 bytes of alignment slop at either end.
constexpr int64_t kBulkStage = 24576;
// Bytes a stage's buffer holds past the stage: lds_raw reads up to one aligned word past the last
// byte a unit wants.
constexpr int64_t kBulkSpare = 16;

#if defined(JAXVT_GPU_CUDA)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

#if JAXVT_BULK_DEVICE
// mbarrier and bulk-copy primitives (PTX ISA: mbarrier, cp.async.bulk).
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Arrives on bar expecting `bytes` of transactions, then copies [src, src + bytes) (16-byte
// aligned, a multiple of 16) to dst in shared memory, completing them on bar.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("{ .reg .b64 s; mbarrier.arrive.expect_tx.shared::cta.b64 s, [%0], %1; }"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; "
                 "selp.u32 %0, 1, 0, q; }" : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}
#endif

// Whether matvec_bulk takes a matrix of rows of rb bytes with stages of `stage` bytes: at least one
// whole row a stage.
__host__ __device__ __forceinline__ bool bulk_fits(int64_t stage, int64_t rb) {
  return stage > 0 && rb + 32 <= stage;
}

// Rows [0, rows) of the quantized matrix at base (format F, A16 as in matvec()), by the whole
// block (every thread calls it; blk of nblk: the block's place among the blocks on this matrix;
// defined only where the engine is, the only place matvec() calls it).
// Chunks of whole rows go round-robin over the blocks, so the grid sweeps the matrix front to
// back; R.bulk_smem holds two stages of R.bulk + kBulkSpare bytes, then their two barriers.
// pro(R) is matvec()'s prologue, called once by every thread after the first copies are
// requested (it holds the activations and ends with a barrier, which also publishes the
// barriers' initialization).
#if JAXVT_BULK_DEVICE
template <int F, int BT, bool A16, class Pro>
__device__ __forceinline__ void matvec_bulk(const uint8_t* base, Rows<BT>& R, int64_t rows,
                                            int64_t cols, int64_t blk, int64_t nblk,
                                            const Pro& pro) {
  using T = Traits<F>;
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, nw = blockDim.x >> 5;
  // The chunking in 32-bit unsigned arithmetic (a matrix's rows, a row's bytes, a stage and the
  // grid all fit): a 64-bit division is a called routine, on the path to the first copy.
  const uint32_t nkb = static_cast<uint32_t>(cols / T::kKbe), rb = nkb * T::kKbb;
  const int nunits = static_cast<int>(nkb * T::kUpk);
  const uint32_t nrows = static_cast<uint32_t>(rows), ub = static_cast<uint32_t>(blk),
                 un = static_cast<uint32_t>(nblk);
  uint32_t rpc = static_cast<uint32_t>(R.bulk - 32) / rb;  // rows a chunk
  const uint32_t spread = (nrows + un - 1) / un;           // small matrices: every block gets rows
  if (rpc > spread) rpc = spread;
  const uint32_t nch = (nrows + rpc - 1) / rpc;
  const int64_t mine = ub < nch ? (nch - 1 - ub) / un + 1 : 0;
  const int64_t sstride = R.bulk + kBulkSpare;
  // the two stages' barriers follow them (no static shared memory: a kernel that had some could
  // not opt in to the device's whole dynamic limit, matvec_launch.cuh's allow_dyn_smem)
  uint64_t* bar = reinterpret_cast<uint64_t*>(R.bulk_smem + 2 * sstride);
  auto stage_buf = [&](int st) { return R.bulk_smem + st * sstride; };
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(base);
  auto fetch = [&](int st, int64_t j) {  // thread 0: chunk j of the block's into stage st
    const uint64_t c = ub + static_cast<uint64_t>(j) * un, r0 = c * rpc;
    const uint64_t r1 = r0 + rpc < nrows ? r0 + rpc : nrows;
    const uintptr_t a = (b0 + static_cast<uintptr_t>(r0 * rb)) & ~uintptr_t{15};
    const uintptr_t e = (b0 + static_cast<uintptr_t>(r1 * rb) + 15) & ~uintptr_t{15};
    bulk_g2s(stage_buf(st), reinterpret_cast<const void*>(a), static_cast<uint32_t>(e - a), &bar[st]);
  };
  if (threadIdx.x == 0) {
    mbar_init(&bar[0]);
    mbar_init(&bar[1]);
    mbar_init_fence();
    if (mine > 0) fetch(0, 0);
    if (mine > 1) fetch(1, 1);
  }
  MV_PHASE(2);  // the first copies requested
  pro(R);
  MV_PHASE(3);  // the activations held
  const bool pairs = BT == 1 && nunits <= 16;
  for (int64_t j = 0; j < mine; ++j) {
    const int st = static_cast<int>(j & 1);
    mbar_wait(&bar[st], static_cast<uint32_t>((j >> 1) & 1));
    if (j == 0) MV_PHASE(4);  // the first chunk in
    const int64_t r0 = (blk + j * nblk) * static_cast<int64_t>(rpc);
    const int64_t nr = rows - r0 < rpc ? rows - r0 : rpc;
    const uint8_t* p = stage_buf(st) + ((b0 + static_cast<uintptr_t>(r0 * rb)) & 15);
    float acc[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[b] = 0.f;
    if constexpr (BT == 1) {
      if (pairs) {  // two rows a warp, one a half warp (accumulate_q8_pair)
        for (int64_t i = 2 * wib; i < nr; i += 2 * nw) {
          if (i + 1 < nr) {
            accumulate_q8_pair<F, A16>(p + i * rb, nunits, rb, R, acc, lane);
            write_pair(acc, R, r0 + i, lane);
          } else {
            accumulate_q8<F, A16, 1>(p + i * rb, nunits, 0, R, acc, lane);
            write_rows<1>(acc, R, r0 + i, lane);
          }
        }
      }
    }
    if (!pairs) {
      for (int64_t i = wib; i < nr; i += nw) {
        accumulate_q8<F, A16, BT>(p + i * rb, nunits, 0, R, acc, lane);
        write_rows<BT>(acc, R, r0 + i, lane);
      }
    }
    if (j == 0) MV_PHASE(5);  // thread 0's warp done with it
    __syncthreads();  // every warp is done with the stage before it is refilled
    if (threadIdx.x == 0 && j + 2 < mine) fetch(st, j + 2);
  }
}
#endif  // JAXVT_BULK_DEVICE

#endif  // JAXVT_FFI_CSRC_MATVEC_BULK_CUH_
