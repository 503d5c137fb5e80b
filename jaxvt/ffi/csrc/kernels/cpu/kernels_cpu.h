// CPU kernels of jaxvt: fused dequantize-and-dot over GGUF blocks, dequantization, a thread pool.
//
// Numerics, two contracts (jaxvt/ffi/numerics.py, docs/NUMERICS.md):
// - ggml mode (gemv_q8_rows, the default): activations arrive converted to the weight format's
//   ggml vec-dot type (act.h); integer dot products, float32 scaling in the order of ggml's AVX2
//   build, so the portable and AVX2 paths and llama.cpp's CPU backend give the same bits.
// - f32 mode (gemv_rows): weights are dequantized to float32 exactly as ggml does; dot products
//   accumulate in float32. The AVX2 path factors each unit's scale out of its dot product
//   (d*sum(q*x) - m*sum(x), with sum(x) precomputed per 16/32 elements), so its rounding differs
//   from a plain dequantize-then-dot by float32 accumulation-order effects only.
#ifndef JAXVT_FFI_CSRC_KERNELS_CPU_H_
#define JAXVT_FFI_CSRC_KERNELS_CPU_H_

#include <cstdint>

#include "common/attn.h"
#include "common/gdn.h"
#include "common/norm.h"

namespace jaxvt::cpu {

// A batch of B activation rows for one weight matrix. x[b] points at cols floats; s16[b] / s32[b]
// at cols/16 and cols/32 partial sums of x[b] (see x_sums); y[b] at the output row (rows floats).
struct Batch {
  int64_t n;
  const float* const* x;
  const float* const* s16;
  const float* const* s32;
  float* const* y;
};

// s16[i] = sum x[16i : 16i+16], s32[i] = sum x[32i : 32i+32].
void x_sums(const float* x, int64_t cols, float* s16, float* s32);

// y[b][r] = sum_k W[r, k] * x[b][k] for rows r in [r0, r1) of the matrix at w (format fmt,
// row_bytes rb). Returns false for an unsupported format.
bool gemv_rows(int fmt, const uint8_t* w, int64_t cols, const Batch& batch, int64_t r0, int64_t r1);

// ggml mode (act.h): activation rows already converted to the weight format's vec-dot type.
// a[b] points at act_row_bytes(vec_type(fmt), cols) bytes; y[b] at the output row.
struct QBatch {
  int64_t n;
  const uint8_t* const* a;
  float* const* y;
};

// y[b][r] = the ggml-mode product of weight row r and activation row b, rows [r0, r1). Integer
// dot products per block, float32 scaling in ggml's AVX2 order (kernels_cpu_q8.cc): the
// portable and the AVX2 paths give the same bits.
bool gemv_q8_rows(int fmt, const uint8_t* w, int64_t cols, const QBatch& batch, int64_t r0,
                  int64_t r1);

// Rows [r0, r1) of the matrix at w dequantized to float32 (out: (r1-r0) x cols) or bf16 bits.
bool dequant_rows_f32(int fmt, const uint8_t* w, int64_t cols, int64_t r0, int64_t r1, float* out);
bool dequant_rows_bf16(int fmt, const uint8_t* w, int64_t cols, int64_t r0, int64_t r1,
                       uint16_t* out);

// The grouped-experts contract (qmatmul_grouped), rows [r0, r1) of the matrix at w:
// y[b][r] = sum_k bf16(W[r, k]) * x[b][k], the weights rounded to bf16 (nearest even) and each
// x[b] already bf16-valued floats, so every product is exact in float32; the sum runs in k order
// in float32.
bool gemm_bf16_rows(int fmt, const uint8_t* w, int64_t cols, int64_t n, const float* const* x,
                    float* const* y, int64_t r0, int64_t r1);

// The MoE router (route.h): logits [T, E] -> ids [T, k], weights [T, k] (kernels_cpu_route.cc).
void moe_route(const float* logits, int64_t T, int64_t E, int64_t k, bool renormalise,
               int32_t* ids, float* weights);

// The residual add and RMSNorm at a block boundary (norm.h, kernels_cpu_norm.cc).
void add_norm(const norm::Args& a);

// The fused decode steps (gdn.h, kernels_cpu_gdn.cc; attn.h, kernels_cpu_attn.cc).
void gdn_step(const gdn::Dims& d, const gdn::Args& a);
void attn_step(const attn::Dims& d, const attn::Args& a);

// Runs fn(ctx, task) for task in [0, n) on the pool's threads and the caller; returns when all
// are done. Tasks must be independent. Falls back to the calling thread alone when the pool is
// busy with another caller.
using TaskFn = void (*)(void* ctx, int64_t task);
void parallel_for(int64_t n, TaskFn fn, void* ctx);
template <class F>
void parallel_for(int64_t n, F& f) {
  parallel_for(n, [](void* c, int64_t t) { (*static_cast<F*>(c))(t); }, &f);
}

int num_threads();           // threads used by parallel_for (the caller included)
void set_num_threads(int n);  // n <= 0: the CPUs this process may run on
const char* isa();            // "avx2" or "generic": the GEMV path chosen at run time
void force_generic(bool on);  // tests: use the portable path even where AVX2 exists

// The AVX2+FMA+F16C implementation (kernels_cpu_avx2.cc); only called when the CPU has them.
namespace avx2 {
bool gemv_rows(int fmt, const uint8_t* w, int64_t cols, const Batch& batch, int64_t r0, int64_t r1);
bool gemv_q8_rows(int fmt, const uint8_t* w, int64_t cols, const QBatch& batch, int64_t r0,
                  int64_t r1);
// The fused DeltaNet step's heads [t0, t1) (kernels_cpu_gdn_avx2.cc, gdn_heads_impl.h).
void gdn_heads_rows(const gdn::Dims& d, const gdn::Args& a, const gdn::Layer& l, int64_t t0,
                    int64_t t1);
}
bool use_avx2();  // the CPU has AVX2+FMA+F16C and the portable path is not forced

}  // namespace jaxvt::cpu

#endif  // JAXVT_FFI_CSRC_KERNELS_CPU_H_
