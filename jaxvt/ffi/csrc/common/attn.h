// One attention decode step (t == 1) between the q/k/v projections and the output projection,
// fused: jaxvt_attn_step (jaxvt/ffi/attn.py; its jnp reference is
// jaxvt.model.layers.attn_step_ref).
//
// For batch row r at position pos = positions[r], layer l = min(max(layer, 0), A-1) of the
// cache stacks (n = min(max(layer, 0), An-1) of the norm stacks):
//   q_h = q's head h (per head [q | gate] when gated), k_kh, v_kh the new key / value heads
//   q_h, k_kh <- rms_norm(x) * norm_w[n]   (when qk_norm: x * (1/sqrt(mean(x^2) + eps)) * w)
//   q_h, k_kh <- rope(x, pos) on the first rope_dim dims (pairs (i, i + rope_dim/2), or
//                (2i, 2i+1) when interleaved; angle pos * inv_freq[i]), q_h times scale
//   k_cache[l, r, pos, kh] = k_kh, v_cache[l, r, pos, kh] = v_kh   where 0 <= pos < S
//   o_h = softmax_s(q_h . k_cache[l, r, s, kh]) v_cache[l, r, s, kh] over s < min(kv_len, pos+1)
//   o_h *= sigmoid(gate_h)   (gated)
// with kh = h / G, G = H / K. Everything is float32. The positions are split into chunks of
// `chunk`: phase 1, per (split, kv head, row), computes the split's scores for the G query heads
// of the kv head, their max m, the sum l of exp(score - m) and the exp-weighted sum of v rows, the
// partials (no normalisation); phase 2, per (query head, row), combines the splits:
// M = max m_j, o = sum_j exp(m_j - M) o_j / sum_j exp(m_j - M) l_j, each sum in kWays interleaved
// parts added in part order (below). Every sum has a fixed order (no atomics): the result does not
// depend on timing.
//
// The new key / value are written by the one phase-1 block whose chunk holds pos (split 0 where
// pos >= kv_len), before it reads its chunk; no other block reads position pos, so no block reads
// what another writes. Only splits below ceil(min(kv_len, pos+1) / chunk) hold partials; the
// combine reads only those. A row with a negative position writes nothing and sees nothing (its o
// is 0/0, as the reference's softmax over no position).
//
// Shapes: q [b, H*2D] (gated) or [b, H*D]; k [b, K*D]; v [b, K*Dv]; q_norm, k_norm [An, D];
// inv_freq [max(rope_dim/2, 1)]; k_cache [A, b, S, K, D]; v_cache [A, b, S, K, Dv] (aliased to
// their results); layer int32 []; positions int32 [b]. Results: o [b, H*Dv]; the two stacks;
// part [b * K * splits * G * (Dv+2)] (flat scratch: per row, kv head, split and query head of
// the group, o then m then l).
#ifndef JAXVT_FFI_CSRC_ATTN_H_
#define JAXVT_FFI_CSRC_ATTN_H_

#include <cmath>
#include <cstdint>

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#endif
#if defined(__CUDACC__) || defined(__HIPCC__)
#define ATTN_HD __host__ __device__ __forceinline__
#else
#define ATTN_HD inline
#endif

namespace jaxvt::attn {

constexpr int64_t kMaxDim = 256;    // D and Dv at most (a GPU block's threads, shared arrays)
constexpr int64_t kMaxGroup = 16;   // G = H / K at most (the GPU's accumulators)
constexpr int64_t kMaxChunk = 256;  // positions of one split at most (the GPU's score array)

struct Dims {
  int64_t b, H, K, G, D, Dv;
  int64_t A, An, S;  // layers of the cache stacks and of the norm stacks; cache positions
  int64_t kv_len, rope_dim, chunk, splits;
  bool gate, qk_norm, interleaved;
  float eps, scale;  // the q / k RMSNorm's epsilon; q's scale (D^-0.5)
};

struct Args {
  const float *q, *k, *v, *q_norm, *k_norm, *inv_freq;
  const int32_t *layer, *positions;  // device memory on a GPU
  float *k_cache, *v_cache;          // stacks, layer `layer` updated in place
  float *o, *part;
};

ATTN_HD int64_t clamp_index(int64_t i, int64_t n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }

// Positions row r sees: s < visible(d, pos).
ATTN_HD int64_t visible(const Dims& d, int64_t pos) {
  const int64_t n = pos + 1 < d.kv_len ? pos + 1 : d.kv_len;
  return n < 0 ? 0 : n;
}

// Splits holding partials for a row that sees n positions.
ATTN_HD int64_t active_splits(const Dims& d, int64_t n) { return (n + d.chunk - 1) / d.chunk; }

// Whether split j writes row r's new key and value (pos in the cache, and in j's chunk or,
// beyond kv_len, j == 0).
ATTN_HD bool writes(const Dims& d, int64_t pos, int64_t j) {
  if (pos < 0 || pos >= d.S) return false;
  return pos < d.kv_len ? pos / d.chunk == j : j == 0;
}

// Offsets into the stacks and the inputs.
ATTN_HD int64_t cache_row(const Dims& d, int64_t l, int64_t r, int64_t s, int64_t kh, int64_t n) {
  return (((l * d.b + r) * d.S + s) * d.K + kh) * n;  // n: D for k_cache, Dv for v_cache
}
ATTN_HD int64_t q_head(const Dims& d, int64_t r, int64_t h) {
  return r * d.H * (d.gate ? 2 : 1) * d.D + h * (d.gate ? 2 : 1) * d.D;
}
ATTN_HD int64_t part_of(const Dims& d, int64_t r, int64_t kh, int64_t j, int64_t g) {
  return (((r * d.K + kh) * d.splits + j) * d.G + g) * (d.Dv + 2);
}

// RMSNorm's factor from a sum of squares of D values.
ATTN_HD float rms_factor(const Dims& d, float sum_squares) {
  return 1.0f / sqrtf(sum_squares / static_cast<float>(d.D) + d.eps);
}

// Element i of x (one head, D values) after RoPE at position pos.
ATTN_HD float rope_at(const Dims& d, const float* inv_freq, const float* x, int64_t i, float pos) {
  if (i >= d.rope_dim) return x[i];
  const int64_t half = d.rope_dim / 2;
  int64_t f, p;
  bool first;
  if (d.interleaved) {
    f = i / 2;
    first = i % 2 == 0;
    p = first ? i + 1 : i - 1;
  } else {
    first = i < half;
    f = first ? i : i - half;
    p = first ? i + half : i - half;
  }
  const float ang = pos * inv_freq[f];
  const float c = cosf(ang), s = sinf(ang);
  return first ? x[i] * c - x[p] * s : x[i] * c + x[p] * s;
}

ATTN_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Phase 2 (the combine) for query head h of row r, which sees n positions, in kWays interleaved
// parts: M = the largest m_j; part w sums the splits j = w (mod kWays) in order,
// L_w = sum_j exp(m_j - M) l_j and o_w = sum_j exp(m_j - M) o_j (column c); then
// o = (o_0 + ... + o_{kWays-1}) / (L_0 + ... + L_{kWays-1}), times sigmoid(gate) when gated.
// (A GPU block gives each part to a warp.)
constexpr int kWays = 8;

// The largest m_j over the splits j = w0, w0 + step, ... (a max is exact in any order).
ATTN_HD float combine_max(const Dims& d, const Args& a, int64_t r, int64_t h, int64_t n,
                          int w0 = 0, int step = 1) {
  const int64_t kh = h / d.G, g = h % d.G, nj = active_splits(d, n);
  float M = -INFINITY;
  for (int64_t j = w0; j < nj; j += step) M = fmaxf(M, a.part[part_of(d, r, kh, j, g) + d.Dv]);
  return M;
}

// Part w's (L_w, o_w) for column c.
ATTN_HD void combine_part(const Dims& d, const Args& a, int64_t r, int64_t h, int64_t c,
                          int64_t n, float M, int w, float* L, float* o) {
  const int64_t kh = h / d.G, g = h % d.G, nj = active_splits(d, n);
  float l = 0.0f, s = 0.0f;
  for (int64_t j = w; j < nj; j += kWays) {
    const float* p = a.part + part_of(d, r, kh, j, g);
    const float e = expf(p[d.Dv] - M);
    l += p[d.Dv + 1] * e;
    s += p[c] * e;
  }
  *L = l;
  *o = s;
}

// o from the parts' sums, added in part order.
ATTN_HD float combine_out(const Dims& d, const Args& a, int64_t r, int64_t h, int64_t c,
                          const float* L, const float* o) {
  float l = 0.0f, s = 0.0f;
  for (int w = 0; w < kWays; ++w) {
    l += L[w];
    s += o[w];
  }
  s = s / l;
  if (d.gate) s = s * sigmoid(a.q[q_head(d, r, h) + d.D + c]);
  return s;
}

// Checks the operand shapes (each a span of dimensions) and fills d; nullptr or the error.
template <typename D>
const char* dims_of(const D& q, const D& k, const D& v, const D& q_norm, const D& k_norm,
                    const D& inv_freq, const D& k_cache, const D& v_cache, const D& layer,
                    const D& positions, const D& part, int64_t kv_len, int64_t rope_dim,
                    int64_t chunk, bool gate, Dims* d) {
  if (q.size() != 2 || k.size() != 2 || v.size() != 2 || k_cache.size() != 5 ||
      v_cache.size() != 5 || q_norm.size() != 2 || k_norm.size() != 2 || inv_freq.size() != 1 ||
      layer.size() != 0 || positions.size() != 1 || part.size() != 1)
    return "jaxvt_attn_step: bad operand ranks";
  d->A = k_cache[0];
  d->b = k_cache[1];
  d->S = k_cache[2];
  d->K = k_cache[3];
  d->D = k_cache[4];
  d->Dv = v_cache[4];
  d->An = q_norm[0];
  d->gate = gate;
  d->kv_len = kv_len;
  d->rope_dim = rope_dim;
  d->chunk = chunk;
  const int64_t per = (gate ? 2 : 1) * d->D;
  if (d->A < 1 || d->K < 1 || d->D < 1 || d->Dv < 1 || d->D > kMaxDim || d->Dv > kMaxDim ||
      d->An < 1 || q[1] % per || q[1] / per % d->K)
    return "jaxvt_attn_step: needs D, Dv in 1..256, H a multiple of K and layers in each stack";
  d->H = q[1] / per;
  d->G = d->H / d->K;
  if (d->G > kMaxGroup || (gate && d->D != d->Dv) || rope_dim < 0 || rope_dim > d->D ||
      rope_dim % 2 || kv_len < 1 || kv_len > d->S || chunk < 1 || chunk > kMaxChunk)
    return "jaxvt_attn_step: needs H / K at most 16, D == Dv when gated, an even rope_dim of at "
           "most D, 1 <= kv_len <= S and a chunk of 1..256 positions";
  d->splits = (kv_len + chunk - 1) / chunk;
  auto is = [](const D& x, int64_t n0, int64_t n1) { return x[0] == n0 && x[1] == n1; };
  if (q[0] != d->b || !is(k, d->b, d->K * d->D) || !is(v, d->b, d->K * d->Dv) ||
      !is(q_norm, d->An, d->D) || !is(k_norm, d->An, d->D) ||
      inv_freq[0] != (rope_dim / 2 > 1 ? rope_dim / 2 : 1) || v_cache[0] != d->A ||
      v_cache[1] != d->b || v_cache[2] != d->S || v_cache[3] != d->K || positions[0] != d->b ||
      part[0] != d->b * d->K * d->splits * d->G * (d->Dv + 2))
    return "jaxvt_attn_step: operand shapes do not agree";
  return nullptr;
}

// The handlers' common part: d and args from XLA FFI buffers (F: Buffer<F32>, V: Buffer<S32>,
// R: ResultBuffer<F32>). The kernels read and write the stacks' results (aliased to the operands;
// where XLA did not alias them the handler copies the operands in first: *copy_k / *copy_v say
// so). nullptr or the error.
template <typename F, typename V, typename R>
const char* prepare(const F& q, const F& k, const F& v, const F& q_norm, const F& k_norm,
                    const F& inv_freq, const F& k_cache, const F& v_cache, const V& layer,
                    const V& positions, R& o, R& k_res, R& v_res, R& part, int64_t kv_len,
                    int64_t rope_dim, int64_t chunk, bool gate, bool qk_norm, bool interleaved,
                    float eps, float scale, Dims* d, Args* args, bool* copy_k, bool* copy_v) {
  if (const char* e = dims_of(q.dimensions(), k.dimensions(), v.dimensions(),
                              q_norm.dimensions(), k_norm.dimensions(), inv_freq.dimensions(),
                              k_cache.dimensions(), v_cache.dimensions(), layer.dimensions(),
                              positions.dimensions(), part->dimensions(), kv_len, rope_dim, chunk,
                              gate, d))
    return e;
  if (o->dimensions().size() != 2 || o->dimensions()[0] != d->b ||
      o->dimensions()[1] != d->H * d->Dv)
    return "jaxvt_attn_step: o must be [b, H*Dv]";
  d->qk_norm = qk_norm;
  d->interleaved = interleaved;
  d->eps = eps;
  d->scale = scale;
  *args = Args{q.typed_data(),      k.typed_data(),         v.typed_data(),
               q_norm.typed_data(), k_norm.typed_data(),    inv_freq.typed_data(),
               layer.typed_data(),  positions.typed_data(), k_res->typed_data(),
               v_res->typed_data(), o->typed_data(),        part->typed_data()};
  *copy_k = k_res->typed_data() != k_cache.typed_data();
  *copy_v = v_res->typed_data() != v_cache.typed_data();
  return nullptr;
}

}  // namespace jaxvt::attn

#endif  // JAXVT_FFI_CSRC_ATTN_H_
