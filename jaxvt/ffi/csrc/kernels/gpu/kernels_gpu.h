// Launchers of jaxvt's GPU kernels (kernels_gpu.cu, kernels_gpu_experts.cu,
// kernels_gpu_grouped.cu, kernels_gpu_route.cu). Compiled by nvcc or hipcc only.
//
// Every per-step choice (which layer, its format, its tier and address, which experts) is read by
// the kernels from device-visible memory; launch geometry depends only on static shapes and the
// device, so the launches are safe to capture into CUDA graphs / XLA command buffers.
#ifndef JAXVT_FFI_CSRC_KERNELS_GPU_H_
#define JAXVT_FFI_CSRC_KERNELS_GPU_H_

#include <cstdint>

#include "common/attn.h"
#include "common/gdn.h"
#include "common/norm.h"
#include "common/vendor.h"

namespace jaxvt::gpu {

// A QWeight as the kernels see it (all pointers are device-visible).
struct WeightArgs {
  const uint8_t* data;    // device-tier stack [n, stride]
  int64_t stride;
  const uint32_t* table;  // [L, 2]
  const int32_t* fmts;    // [L]
  int64_t n_layers;
  const int32_t* layer;   // [] (device scalar)
  // A decode expert ring (prefetch.h, XHeader) holding some experts of some layer, or nullptr:
  // the per-slot experts kernels read an expert the ring holds for this layer from it.
  const uint8_t* ring = nullptr;
  // The expert cache (common/expert_cache.h): the call's decisions where[slot] and this stack's
  // cache table (uint32 [L, 2]: the address of the layer's partition, 0 where not cached), each
  // slot `cslot` bytes. The per-slot experts kernels read hits from the cache and write fills.
  const int32_t* where = nullptr;
  const uint32_t* ctab = nullptr;
  int64_t cslot = 0;
  // swiglu's up operand, laid out as the product's x, or nullptr: where set, the product's input
  // is swiglu(x, up) = (x / (1 + exp(0 - x))) * up, formed as the kernel holds its activation
  // rows (ggml's arithmetic only, whose launches always hold them; qmatmul and the experts).
  const float* up = nullptr;
};

// Routed-expert calls of at most this many slots take the per-slot kernel (decode and short
// prompts; on a GPU the product rule sends calls of layers.GROUPED_SLOTS slots and more to the
// grouped kernel).
constexpr int64_t kExpertsSlotMax = 1023;

// How the launches size their grids and pick the experts kernel. The handlers launch with the
// defaults; the debug module's probes pass others (debug/probes_gpu.cu). The rows' arithmetic
// does not depend on any of them.
struct Tuning {
  int64_t grid_cap = 0;  // > 0: qmatmul launches take at most this many blocks
  int64_t waves = 1;     // matvec and per-slot experts grids: this many waves of resident blocks
  int64_t slot_max = kExpertsSlotMax;
  // ggml-arithmetic matvecs on CUDA sm_90+: bytes of each of a block's two bulk-copy stages
  // (matvec_bulk.cuh); -1 the default, 0 the per-warp windows instead (same bits either way)
  int64_t bulk = -1;
};

// y[b, r] = sum_k W[r, k] x[b, k]; x [B, cols], y [B, rows]; float32 (docs/NUMERICS.md "f32"),
// or with ggml: ggml's arithmetic (activations quantized to the format's vec-dot type, integer
// dots; "q8" / "ggml").
gpuError_t launch_qmatmul(gpuStream_t s, const WeightArgs& w, const float* x, int64_t batch, float* y,
                          int64_t rows, int64_t cols, bool ggml = false, const Tuning& t = {});
// y[slot, r] = sum_k W_e[r, k] x_slot[k], e = ids[slot]; x [T, cols] (x_per_slot = false, token of
// slot = slot / k) or [T*k, cols]; y [T*k, rows]. Each routed expert is read once per 16 slots.
gpuError_t launch_qmatmul_experts(gpuStream_t s, const WeightArgs& w, const float* x, bool x_per_slot,
                                  const int32_t* ids, int64_t slots, int64_t k, float* y,
                                  int64_t rows, int64_t cols, int64_t experts, bool ggml = false,
                                  const Tuning& t = {});
// Several matrices (n <= kMaxMulti, each W_i [rows[i], cols], each at the same layer index, each
// in its own tier and format) times the same x [B, cols]: y[i] [B, rows[i]]; one launch, the same
// bits as n launch_qmatmul calls.
constexpr int kMaxMulti = 4;
gpuError_t launch_qmatmul_multi(gpuStream_t s, int n, const WeightArgs* w, float* const* y,
                                const int64_t* rows, const float* x, int64_t batch, int64_t cols,
                                bool ggml, const Tuning& t = {});
// launch_qmatmul_experts for two stacks of the same shape (a MoE's gate and up) in one launch.
gpuError_t launch_qmatmul_experts2(gpuStream_t s, const WeightArgs& w0, const WeightArgs& w1,
                                   const float* x, bool x_per_slot, const int32_t* ids,
                                   int64_t slots, int64_t k, float* y0, float* y1, int64_t rows,
                                   int64_t cols, int64_t experts, bool ggml,
                                   const Tuning& t = {});
// Grouped routed experts (kernels_gpu_grouped.cu): y[order[p], r] = sum_k bf16(W_e[r, k]) *
// x[order[p] / x_div, k] for the sorted positions p in [offsets[e], offsets[e+1]) of each expert e
// (experts = 0: one plain matrix); positions >= offsets[max(experts, 1)] give zero rows. x is bf16
// [slots / x_div, cols], order int32 [slots], offsets int32 [max(experts, 1) + 1], y [slots, rows];
// float32 accumulation on tensor cores (CUDA sm_80+) or FMAs. Each routed expert's bytes are read
// once per tile of 32 slots.
gpuError_t launch_qmatmul_grouped(gpuStream_t s, const WeightArgs& w, const uint16_t* x,
                                  int64_t x_div, const int32_t* order, const int32_t* offsets,
                                  int64_t slots, float* y, int64_t rows, int64_t cols,
                                  int64_t experts);
// out[i, :] = W[ids[i], :] as float32.
gpuError_t launch_qembed(gpuStream_t s, const WeightArgs& w, const int32_t* ids, int64_t n, float* out,
                         int64_t rows, int64_t cols);
// out = the whole layer (experts x rows x cols, experts >= 1) as bf16 bits.
gpuError_t launch_qdequant(gpuStream_t s, const WeightArgs& w, uint16_t* out, int64_t rows,
                           int64_t cols, int64_t experts);

// The expert cache's decision for one call (common/expert_cache.h): ids [n] (n <= 1024), the
// layer (device scalar), stab uint32 [L, 2] (each cached layer's state block) -> where [n].
gpuError_t launch_expert_cache_assign(gpuStream_t s, const int32_t* ids, int64_t n,
                                      const int32_t* layer, const uint32_t* stab,
                                      int64_t n_layers, int32_t* where);

// The MoE router (route.h, kernels_gpu_route.cu): logits [T, E] -> ids [T, k], weights [T, k];
// E <= route::kMaxExperts, 1 <= k <= E.
gpuError_t launch_moe_route(gpuStream_t s, const float* logits, int64_t T, int64_t E, int64_t k,
                            bool renormalise, int32_t* ids, float* weights);

// The residual add and RMSNorm at a block boundary (norm.h, kernels_gpu_norm.cu); a.ggml is
// the CPU's only (gpuErrorNotSupported).
gpuError_t launch_add_norm(gpuStream_t s, const norm::Args& a);

// The fused decode steps (gdn.h, kernels_gpu_gdn.cu; attn.h, kernels_gpu_attn.cu).
gpuError_t launch_gdn_step(gpuStream_t s, const gdn::Dims& d, const gdn::Args& a);
gpuError_t launch_attn_step(gpuStream_t s, const attn::Dims& d, const attn::Args& a);

// Probe kernel: asks for layer *w.layer of a stack (rows x cols of the layer's format, device
// tier) to be pulled into the L2 cache (CUDA sm_90+: cp.async.bulk.prefetch.L2; elsewhere, or for
// a host-tier layer, nothing is launched). For measurement only (debug/probes_gpu.cu): a launch
// lasts about as long as its bytes take to arrive, so on one stream it adds its time to the
// work after it (docs/BENCHMARKS.md).
gpuError_t launch_l2_prefetch(gpuStream_t s, const WeightArgs& w, int64_t rows, int64_t cols);

// Probe kernel: reads n16 uint4 from p with a grid-stride loop (result folded into *sink);
// blocks <= 0: four per multiprocessor.
// bulk: read through the bulk-copy engine instead of SM loads (cp.async.bulk into shared memory,
// CUDA sm_90 and later; gpuErrorNotSupported elsewhere); n16 * 16 must be a multiple of 8 KiB.
gpuError_t launch_stream_read(gpuStream_t s, const void* p, int64_t n16, unsigned* sink,
                              int64_t blocks = 0, bool bulk = false);

int sm_count();  // multiprocessors of the current device (cached)
// Whether the current device has the bulk-copy engine (cp.async.bulk: CUDA compute capability
// 9.0 or later; false on HIP), cached per device.
bool bulk_engine();

}  // namespace jaxvt::gpu

#endif  // JAXVT_FFI_CSRC_KERNELS_GPU_H_
