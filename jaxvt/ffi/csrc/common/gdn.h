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
// The op works on whole stacks and updates layer `layer` of the state stacks in place: the
// weights are read at layer min(max(layer, 0), L-1) of their stacks, the states at
// min(max(layer, 0), Ls-1) of theirs (an index out of range is clamped, never followed). Two
// phases: (1) per (row, channel): x = silu(conv) into the scratch conv_out, and the layer's conv
// state shifted in place (each channel by one thread, read before written); (2) per (row, value
// head): the recurrent step on the layer's ssm state in place, reading x from conv_out.
//
// Shapes: mixed [b, conv_dim] with conv_dim = 2 nk dk + nv dv ([q | k | v]); z [b, nv dv];
// beta_raw, alpha_raw [b, nv]; a, dt_bias [L, nv]; conv_w [L, conv_dim, K]; norm_w [L, dv];
// conv_state [Ls, b, K-1, conv_dim]; ssm_state [Ls, b, nv, dk, dv]; valid int32 [b];
// layer int32 [] (a device scalar). Results: y [b, nv dv]; the two state stacks (aliased to
// their operands); conv_out [b, conv_dim] (scratch).
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
  int64_t L, Ls;  // layers of the weight stacks and of the state stacks
  bool grouped;  // value head h reads key head h / (nv / nk); else h % nk ("tiled")
  float eps;     // the output RMSNorm's
  float qk_eps;  // the q / k l2norm's
  float q_scale; // dk^-0.5
};

struct Args {
  const float *mixed, *z, *beta_raw, *alpha_raw;
  const float *a, *dt_bias, *conv_w, *norm_w;  // weight stacks
  const int32_t *valid, *layer;                // layer: one int32 in the kernels' memory
  float *conv_state, *ssm_state;               // state stacks, layer `layer` updated in place
  float *y, *conv_out;                         // conv_out [b, conv_dim]: x = silu(conv)
};

// One layer's pointers into the stacks (the index clamped into each stack).
struct Layer {
  const float *a, *dt_bias, *conv_w, *norm_w;
  float *conv_state, *ssm_state;
};

GDN_HD int64_t clamp_index(int64_t i, int64_t n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }

GDN_HD Layer layer_of(const Dims& d, const Args& a) {
  const int64_t l = a.layer[0];
  const int64_t lw = clamp_index(l, d.L), ls = clamp_index(l, d.Ls);
  return Layer{a.a + lw * d.nv,
               a.dt_bias + lw * d.nv,
               a.conv_w + lw * d.conv_dim * d.K,
               a.norm_w + lw * d.dv,
               a.conv_state + ls * d.b * (d.K - 1) * d.conv_dim,
               a.ssm_state + ls * d.b * d.nv * d.dk * d.dv};
}


GDN_HD int64_t key_head(const Dims& d, int64_t h) {
  return d.grouped ? h / (d.nv / d.nk) : h % d.nk;
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

// Phase 1 for row r's channel c (state_r: the row's conv state [K-1, conv_dim] in the layer):
// returns x = silu(conv) and shifts the channel's state in place where valid (entry j + 1 is
// read before entry j + 1 is written: j runs upwards).
GDN_HD float conv_shift(const Dims& d, const float* mixed_r, float* state_r, const float* w,
                        int64_t c, bool valid) {
  const float x = silu(conv(d, mixed_r, state_r, w, c));
  if (valid)
    for (int64_t j = 0; j + 1 < d.K; ++j)
      state_r[j * d.conv_dim + c] = j + 2 < d.K ? state_r[(j + 1) * d.conv_dim + c] : mixed_r[c];
  return x;
}

// Checks the operand shapes (each a span of dimensions) and fills d; nullptr or the error.
template <typename D>
const char* dims_of(const D& mixed, const D& z, const D& beta, const D& alpha, const D& a,
                    const D& dt_bias, const D& conv_w, const D& norm_w, const D& conv_state,
                    const D& ssm_state, const D& valid, const D& layer, int64_t nk, Dims* d) {
  if (mixed.size() != 2 || ssm_state.size() != 5 || conv_w.size() != 3 ||
      conv_state.size() != 4 || layer.size() != 0)
    return "jaxvt_gdn_step: bad operand ranks";
  d->b = mixed[0];
  d->conv_dim = mixed[1];
  d->Ls = ssm_state[0];
  d->nv = ssm_state[2];
  d->dk = ssm_state[3];
  d->dv = ssm_state[4];
  d->L = conv_w[0];
  d->K = conv_w[2];
  d->nk = nk;
  if (nk < 1 || d->nv % nk || d->dk < 1 || d->dv < 1 || d->dk > kMaxDim || d->dv > kMaxDim ||
      d->K < 1 || d->L < 1 || d->Ls < 1 || d->conv_dim != 2 * nk * d->dk + d->nv * d->dv)
    return "jaxvt_gdn_step: needs nv a multiple of nk, dk and dv in 1..256, "
           "conv_dim = 2 nk dk + nv dv and a layer in each stack";
  auto is = [](const D& x, int64_t n0, int64_t n1) {
    return x.size() == 2 && x[0] == n0 && x[1] == n1;
  };
  auto is1 = [](const D& x, int64_t n0) { return x.size() == 1 && x[0] == n0; };
  if (ssm_state[1] != d->b || !is(z, d->b, d->nv * d->dv) || !is(beta, d->b, d->nv) ||
      !is(alpha, d->b, d->nv) || !is(a, d->L, d->nv) || !is(dt_bias, d->L, d->nv) ||
      conv_w[1] != d->conv_dim || !is(norm_w, d->L, d->dv) || conv_state[0] != d->Ls ||
      conv_state[1] != d->b || conv_state[2] != d->K - 1 || conv_state[3] != d->conv_dim ||
      !is1(valid, d->b))
    return "jaxvt_gdn_step: operand shapes do not agree";
  return nullptr;
}

// The handlers' common part: d and args from XLA FFI buffers (F: Buffer<F32>, V: Buffer<S32>,
// R: ResultBuffer<F32>). The kernels read and write the state stacks' results (aliased to the
// operands; where XLA did not alias them the handler copies the operands in first: *copy_conv /
// *copy_ssm say so). nullptr or the error.
template <typename F, typename V, typename R>
const char* prepare(const F& mixed, const F& z, const F& beta, const F& alpha, const F& a,
                    const F& dt_bias, const F& conv_w, const F& norm_w, const F& conv_state,
                    const F& ssm_state, const V& valid, const V& layer, R& y, R& conv_res,
                    R& ssm_res, R& conv_out, int64_t nk, int64_t grouped, float eps,
                    float qk_eps, Dims* d, Args* args, bool* copy_conv, bool* copy_ssm) {
  if (const char* e = dims_of(mixed.dimensions(), z.dimensions(), beta.dimensions(),
                              alpha.dimensions(), a.dimensions(), dt_bias.dimensions(),
                              conv_w.dimensions(), norm_w.dimensions(), conv_state.dimensions(),
                              ssm_state.dimensions(), valid.dimensions(), layer.dimensions(), nk,
                              d))
    return e;
  d->grouped = grouped != 0;
  d->eps = eps;
  d->qk_eps = qk_eps;
  d->q_scale = static_cast<float>(std::pow(static_cast<double>(d->dk), -0.5));  // Python's dk**-0.5
  *args = Args{mixed.typed_data(),   z.typed_data(),       beta.typed_data(),
               alpha.typed_data(),   a.typed_data(),       dt_bias.typed_data(),
               conv_w.typed_data(),  norm_w.typed_data(),  valid.typed_data(),
               layer.typed_data(),   conv_res->typed_data(), ssm_res->typed_data(),
               y->typed_data(),      conv_out->typed_data()};
  *copy_conv = conv_res->typed_data() != conv_state.typed_data();
  *copy_ssm = ssm_res->typed_data() != ssm_state.typed_data();
  return nullptr;
}

}  // namespace jaxvt::gdn

#endif  // JAXVT_FFI_CSRC_GDN_H_
