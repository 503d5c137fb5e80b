// One Gated DeltaNet decode step (t == 1) between the input and output projections, fused:
// jaxvt_gdn_step (jaxvt/ffi/gdn.py; its jnp reference is jaxvt.model.deltanet.gdn_step_ref).
//
// For batch row r and value head h (key head kh = h % nk "tiled", or h / (nv / nk) "grouped"):
//   beta = sigmoid(beta_raw),  g = a * softplus(alpha_raw + dt_bias)   (both 0 where !valid)
//   x    = silu(causal conv of [conv_state; mixed] with the conv kernel)   per channel
//   q, k = l2norm(x's q / k channels of key head kh) (q times dk^-0.5), v = x's head-h channels
//   S'   = S * exp(g);  delta = beta (v - S'^T k);  S'' = S' + k delta^T;  o = S''^T q
//   y    = o * rsqrt(mean(o^2) + eps) * norm_w * silu(z)
// The new conv state is the last K-1 inputs ([conv_state; mixed] shifted by one where valid, the
// old state where not). Everything is float32; every sum runs in a fixed order (no atomics), so
// the results do not depend on timing.
//
// Shapes: mixed [b, conv_dim] with conv_dim = 2 nk dk + nv dv ([q | k | v]); z [b, nv dv];
// beta_raw, alpha_raw [b, nv]; a, dt_bias [nv]; conv_w [conv_dim, K]; norm_w [dv];
// conv_state [b, K-1, conv_dim]; ssm_state [b, nv, dk, dv]; valid int32 [b].
#ifndef JAXVT_FFI_CSRC_GDN_H_
#define JAXVT_FFI_CSRC_GDN_H_

#include <cmath>
#include <cstdint>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#endif
#if defined(__CUDACC__) || defined(__HIPCC__)
#define GDN_HD __host__ __device__ __forceinline__
#else
#define GDN_HD inline
#endif

namespace jaxvt::gdn {

constexpr int64_t kMaxDim = 256;  // dk and dv at most this (the GPU kernel's shared arrays)

struct Dims {
  int64_t b, nk, nv, dk, dv, K, conv_dim;
  bool grouped;  // value head h reads key head h / (nv / nk); else h % nk ("tiled")
  float eps;     // the output RMSNorm's
  float qk_eps;  // the q / k l2norm's
  float q_scale; // dk^-0.5
};

struct Args {
  const float *mixed, *z, *beta_raw, *alpha_raw, *a, *dt_bias, *conv_w, *norm_w, *conv_state,
      *ssm_state;
  const int32_t* valid;
  float *y, *conv_out, *ssm_out;  // ssm_out may be ssm_state (updated in place)
};

GDN_HD int64_t key_head(const Dims& d, int64_t h) {
  return d.grouped ? h / (d.nv / d.nk) : h % d.nk;
}

// Whether value head h writes its key head's q / k channels of the new conv state (exactly one
// value head per key head does).
GDN_HD bool owns_qk(const Dims& d, int64_t h) {
  return d.grouped ? h % (d.nv / d.nk) == 0 : h < d.nk;
}

// Channel of the head's i-th input: i < dk its q, i < 2 dk its k, else its v channels.
GDN_HD int64_t channel(const Dims& d, int64_t h, int64_t kh, int64_t i) {
  if (i < d.dk) return kh * d.dk + i;
  if (i < 2 * d.dk) return d.nk * d.dk + kh * d.dk + (i - d.dk);
  return 2 * d.nk * d.dk + h * d.dv + (i - 2 * d.dk);
}

GDN_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
GDN_HD float silu(float x) { return x * sigmoid(x); }
GDN_HD float softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// The conv output (before silu) of channel c: sum_j xs[j] w[c, j] over [conv_state; mixed].
GDN_HD float conv(const Dims& d, const float* mixed_r, const float* state_r, const float* w,
                  int64_t c) {
  float y = 0.0f;
  for (int64_t j = 0; j + 1 < d.K; ++j) y += state_r[j * d.conv_dim + c] * w[c * d.K + j];
  return y + mixed_r[c] * w[c * d.K + d.K - 1];
}

// Writes channel c of the new conv state (row r's K-1 entries).
GDN_HD void shift_state(const Dims& d, const float* mixed_r, const float* state_r, float* out_r,
                        int64_t c, bool valid) {
  for (int64_t j = 0; j + 1 < d.K; ++j) {
    const int64_t src = valid ? j + 1 : j;  // row src of [conv_state; mixed]
    out_r[j * d.conv_dim + c] = src + 1 < d.K ? state_r[src * d.conv_dim + c] : mixed_r[c];
  }
}

// Checks the operand shapes (each a span of dimensions) and fills d; nullptr or the error.
template <typename D>
const char* dims_of(const D& mixed, const D& z, const D& beta, const D& alpha, const D& a,
                    const D& dt_bias, const D& conv_w, const D& norm_w, const D& conv_state,
                    const D& ssm_state, const D& valid, int64_t nk, Dims* d) {
  if (mixed.size() != 2 || ssm_state.size() != 4 || conv_w.size() != 2 || conv_state.size() != 3)
    return "jaxvt_gdn_step: bad operand ranks";
  d->b = mixed[0];
  d->conv_dim = mixed[1];
  d->nv = ssm_state[1];
  d->dk = ssm_state[2];
  d->dv = ssm_state[3];
  d->K = conv_w[1];
  d->nk = nk;
  if (nk < 1 || d->nv % nk || d->dk < 1 || d->dv < 1 || d->dk > kMaxDim || d->dv > kMaxDim ||
      d->K < 1 || d->conv_dim != 2 * nk * d->dk + d->nv * d->dv)
    return "jaxvt_gdn_step: needs nv a multiple of nk, dk and dv in 1..256, and "
           "conv_dim = 2 nk dk + nv dv";
  auto is = [](const D& x, int64_t n0, int64_t n1) {
    return x.size() == 2 && x[0] == n0 && x[1] == n1;
  };
  auto is1 = [](const D& x, int64_t n0) { return x.size() == 1 && x[0] == n0; };
  if (ssm_state[0] != d->b || !is(z, d->b, d->nv * d->dv) || !is(beta, d->b, d->nv) ||
      !is(alpha, d->b, d->nv) || !is1(a, d->nv) || !is1(dt_bias, d->nv) ||
      conv_w[0] != d->conv_dim || !is1(norm_w, d->dv) || conv_state[0] != d->b ||
      conv_state[1] != d->K - 1 || conv_state[2] != d->conv_dim || !is1(valid, d->b))
    return "jaxvt_gdn_step: operand shapes do not agree";
  return nullptr;
}

// The handlers' common part: d and args from XLA FFI buffers (F: Buffer<F32>, V: Buffer<S32>,
// R: ResultBuffer<F32>); nullptr or the error.
template <typename F, typename V, typename R>
const char* prepare(const F& mixed, const F& z, const F& beta, const F& alpha, const F& a,
                    const F& dt_bias, const F& conv_w, const F& norm_w, const F& conv_state,
                    const F& ssm_state, const V& valid, R& y, R& conv_out, R& ssm_out, int64_t nk,
                    int64_t grouped, float eps, float qk_eps, Dims* d, Args* args) {
  if (const char* e = dims_of(mixed.dimensions(), z.dimensions(), beta.dimensions(),
                              alpha.dimensions(), a.dimensions(), dt_bias.dimensions(),
                              conv_w.dimensions(), norm_w.dimensions(), conv_state.dimensions(),
                              ssm_state.dimensions(), valid.dimensions(), nk, d))
    return e;
  d->grouped = grouped != 0;
  d->eps = eps;
  d->qk_eps = qk_eps;
  d->q_scale = static_cast<float>(std::pow(static_cast<double>(d->dk), -0.5));  // Python's dk**-0.5
  *args = Args{mixed.typed_data(),     z.typed_data(),      beta.typed_data(),
               alpha.typed_data(),     a.typed_data(),      dt_bias.typed_data(),
               conv_w.typed_data(),    norm_w.typed_data(), conv_state.typed_data(),
               ssm_state.typed_data(), valid.typed_data(),  y->typed_data(),
               conv_out->typed_data(), ssm_out->typed_data()};
  return nullptr;
}

}  // namespace jaxvt::gdn

namespace jaxvt::cpu {
void gdn_step(const gdn::Dims& d, const gdn::Args& a);
}  // namespace jaxvt::cpu

#if defined(JAXVT_GPU_CUDA) || defined(JAXVT_GPU_HIP)  // the GPU sources only
#include "vendor.h"
namespace jaxvt::gpu {
gpuError_t launch_gdn_step(gpuStream_t s, const gdn::Dims& d, const gdn::Args& a);
}  // namespace jaxvt::gpu
#endif

#endif  // JAXVT_FFI_CSRC_GDN_H_
