// ggml's integer arithmetic for the matvec core (matvec.cuh includes it, inside each kernel
// file's anonymous namespace): activation rows quantized to each weight format's vec-dot type in
// shared memory, and the per-unit integer dots. Not a standalone header.
#ifndef JAXVT_FFI_CSRC_MATVEC_Q8_CUH_
#define JAXVT_FFI_CSRC_MATVEC_Q8_CUH_

// ---- ggml's arithmetic: integer dots over quantized activations ----------------------------
//
// Before a product with a weight of quantized format F, each activation row is quantized to F's
// ggml vec-dot type, exactly as ggml's CPU recipes do (and jaxvt.ffi.numerics.quantize_q8 /
// quantize_q8k): Q8_0 (per 32 elements, d = amax / 127 rounded to f16, q = rint(x * 127 / amax))
// for Q4_0 / Q8_0; Q8_1 (Q8_0 plus s = f16(d * sum q)) for Q4_1; Q8_K (per 256 elements: m the
// first element of largest |x|, q = min(127, rint(x * -127 / m)), d = 1 / (-127 / m)) for the K
// formats. A unit's product is then an integer dot (dp4a) scaled in float32:
//   Q4_0 (dw dx) (sum q qx - 8 sum qx)   Q8_0 (dw dx) sum q qx   Q4_1 (dw dx) sum q qx + mw s
//   Q4_K / Q5_K (dx dw) (sc sum q qx) - (dx dmin) (m sum qx)    Q6_K (dx d) (sc0 sum0 + sc1 sum1)
// (sums over the unit's 32 elements, Q6_K's two 16-element halves with q - 32), and a lane adds
// its units in order as the float32 path does, so both tiers give the same bits.
//
// A held quantized row (shared memory, xq_stride bytes; upad = units rounded up to 32):
//   uint4 [upad * 2]   the q bytes: chunk c (16 bytes) of unit g at ((g / 32) * 2 + c) * 32 + g % 32
//   float du[upad]     the unit's d (Q8_0 / Q8_1: its own, f16-rounded; Q8_K: its 256-block's)
//   float ss[upad]     Q8_1's s
//   int s16[2 * upad]  sum of q over each 16-element half of the unit
__host__ __device__ __forceinline__ int64_t xq_upad(int64_t cols) { return (cols / 32 + 31) / 32 * 32; }
__host__ __device__ __forceinline__ int64_t xq_bytes(int64_t cols) { return xq_upad(cols) * 48; }
// Shared memory for one held activation row under ggml's arithmetic: the quantized row, or the
// float32 one where the weights are a float format (room for either).
__host__ __device__ __forceinline__ int64_t ggml_held_row_bytes(int64_t cols) {
  return xq_bytes(cols) > xs_stride(cols) * 16 ? xq_bytes(cols) : xs_stride(cols) * 16;
}

// The vec-dot type a quantized format's activations take: 0 Q8_0, 1 Q8_1, 2 Q8_K.
__device__ __forceinline__ int act_type(int fmt) {
  return fmt == kQ4_1 ? 1 : (fmt == kQ4_K || fmt == kQ5_K || fmt == kQ6_K) ? 2 : 0;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, gpuShflXor(v, o));
  return v;
}
__device__ __forceinline__ int warp_isum(int v, int width = 32) {
#pragma unroll
  for (int o = width / 2; o > 0; o >>= 1) v += gpuShflXor(v, o);
  return v;
}

// Quantizes activation rows 0..nb-1 of R into xq (all threads of the block; ends with a barrier).
template <int BT>
__device__ void hold_xq(uint8_t* xq, const Rows<BT>& R, int nb, int act) {
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int nu = static_cast<int>(R.cols / 32), upad = static_cast<int>(xq_upad(R.cols)),
            st = static_cast<int>(xq_bytes(R.cols));  // 32-bit index arithmetic
  if (act < 2) {  // Q8_0 / Q8_1: a warp per 32-element block, a lane per element
    for (int t = wib; t < nb * nu; t += nw) {
      const int b = static_cast<int>(t / nu);
      const int g = t % nu;
      uint8_t* row = xq + b * st;
      const float v = R.u ? swiglu1(R.xrow(b)[g * 32 + lane], R.urow(b)[g * 32 + lane])
                          : R.xrow(b)[g * 32 + lane];
      const float amax = warp_max(fabsf(v));
      const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
      const int q = static_cast<int>(rintf(v * id));
      row[(((g >> 5) * 2 + (lane >> 4)) * 32 + (g & 31)) * 16 + (lane & 15)] = static_cast<uint8_t>(q);
      const int half = warp_isum(q, 16), total = half + gpuShflXor(half, 16);
      float* du = reinterpret_cast<float*>(row + upad * 32);
      int* s16 = reinterpret_cast<int*>(du + 2 * upad);
      if (lane == 0) {
        du[g] = round_half(d);
        du[upad + g] = round_half(d * static_cast<float>(total));
        s16[2 * g] = half;
      }
      if (lane == 16) s16[2 * g + 1] = half;
    }
  } else {  // Q8_K: a warp per 256-element block, 8 consecutive elements per lane
    for (int t = wib; t < nb * (nu / 8); t += nw) {
      const int b = static_cast<int>(t / (nu / 8));
      const int kb = t % (nu / 8);
      uint8_t* row = xq + b * st;
      const float4* src = reinterpret_cast<const float4*>(R.xrow(b) + kb * 256 + 8 * lane);
      float4 p0 = src[0], p1 = src[1];
      if (R.u) {
        const float4* us = reinterpret_cast<const float4*>(R.urow(b) + kb * 256 + 8 * lane);
        p0 = swiglu4(p0, us[0]);
        p1 = swiglu4(p1, us[1]);
      }
      const float v[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
      float best = -1.f, m = 0.f;
      int idx = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (fabsf(v[e]) > best) best = fabsf(v[e]), m = v[e], idx = 8 * lane + e;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {  // the first element of largest |x|
        const float ob = gpuShflXor(best, o), om = gpuShflXor(m, o);
        const int oi = gpuShflXor(idx, o);
        if (ob > best || (ob == best && oi < idx)) best = ob, m = om, idx = oi;
      }
      const float iscale = m != 0.f ? -127.f / m : 0.f;
      const float d = m != 0.f ? 1.f / iscale : 0.f;
      uint32_t lo = 0, hi = 0;
      int sum = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int q = static_cast<int>(fminf(127.f, rintf(iscale * v[e])));
        sum += q;
        const uint32_t byte = static_cast<uint32_t>(q) & 0xFFu;
        if (e < 4) lo |= byte << (8 * e); else hi |= byte << (8 * (e - 4));
      }
      const int g = kb * 8 + lane / 4, off = (lane & 3) * 8;  // unit, first element in it
      *reinterpret_cast<uint2*>(row + (((g >> 5) * 2 + off / 16) * 32 + (g & 31)) * 16 + off % 16) =
          make_uint2(lo, hi);
      const int pair = sum + gpuShflXor(sum, 1);  // 16 elements: this lane and its neighbour
      float* du = reinterpret_cast<float*>(row + upad * 32);
      int* s16 = reinterpret_cast<int*>(du + 2 * upad);
      if ((lane & 1) == 0) s16[2 * g + ((lane & 3) >> 1)] = pair;
      if (lane < 8) du[kb * 8 + lane] = d;
    }
  }
  __syncthreads();
}

// ---- reading a window's blocks from shared memory ----------------------------------------------
//
// A unit's bytes sit in the warp's shared-memory window at the alignment they have in memory
// (matvec's windows start at 16-byte boundaries), which for Q4_0 / Q4_1 / Q8_0 / Q6_K blocks is only
// 2 bytes. N words from any address: N + 1 aligned 32-bit reads and a funnel shift each (no
// branch, so lanes at different alignments do not diverge); the word past the last wanted byte
// stays inside the warp's slot (one spare uint4 past every window). A16: the k-block is 16-byte
// aligned (Q4_K / Q5_K blocks of a 16-byte aligned matrix), so 16 bytes are one 128-bit read.
// lds_raw: the N + 1 aligned words around [p, p + 4N); returns the bit shift of p in the first.
// Word i of the span is then gpuFunnelR(r[i], r[i + 1], shift), and a field at bit b of every byte
// (a nibble, a 2-bit pair) is gpuFunnelR(r[i], r[i + 1], shift + b) under the field's byte mask:
// the shift and the extraction in one instruction (the bits a wider shift brings in at the top
// fall outside the mask).
template <int N>
__device__ __forceinline__ uint32_t lds_raw(const uint8_t* p, uint32_t (&r)[N + 1]) {
  const uint32_t mis = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 3u);
  const gpuSmemAddr a = gpuSmemAt(p) - mis;
#pragma unroll
  for (int i = 0; i <= N; ++i) r[i] = gpuLdsU32(a + 4 * i);
  return 8u * mis;
}

template <int N>
__device__ __forceinline__ void lds_words(const uint8_t* p, uint32_t (&w)[N]) {
  uint32_t r[N + 1];
  const uint32_t sh = lds_raw<N>(p, r);
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = gpuFunnelR(r[i], r[i + 1], sh);
}

// Bytes [p, p + 32) as 8 words.
template <bool A16>
__device__ __forceinline__ void lds_32b(const uint8_t* p, uint32_t (&w)[8]) {
  if constexpr (A16) {
    const gpuSmemAddr a = gpuSmemAt(p);
    const uint4 lo = gpuLdsU4(a), hi = gpuLdsU4(a + 16);
    w[0] = lo.x, w[1] = lo.y, w[2] = lo.z, w[3] = lo.w, w[4] = hi.x, w[5] = hi.y, w[6] = hi.z, w[7] = hi.w;
  } else {
    lds_words<8>(p, w);
  }
}

__device__ __forceinline__ uint32_t lds_word(const uint8_t* p) {
  uint32_t w[1];
  lds_words<1>(p, w);
  return w[0];
}

__device__ __forceinline__ float half_lo(uint32_t w) { return half_to_float(static_cast<uint16_t>(w & 0xFFFFu)); }

// A weight unit read from shared memory and unpacked once, for every activation row it meets:
// q[i] holds the unit's elements 4i..4i+3 as the int8 lanes dp4a multiplies with the activation's
// word i (Q6_K: before its -32 offset, applied with the activation sums), plus its scales.
struct QUnit {
  int q[8];
  float d, m;  // the weight's scale, and Q4_1's min / the K formats' dmin
  int sc, mn;  // Q4_K / Q5_K: scale and min; Q6_K: the two int8 scales
};

// The unit u of the k-block at kb (shared memory) under ggml's recipes; only the way the bytes are
// read depends on A16, so both give the same unit.
template <int F, bool A16>
__device__ __forceinline__ QUnit load_unit_q8(const uint8_t* kb, int u) {
  QUnit w;
  w.m = 0.f;
  w.sc = w.mn = 0;
  if constexpr (F == kQ4_0 || F == kQ4_1) {
    uint32_t r[5];
    const uint32_t sh = lds_raw<4>(kb + (F == kQ4_0 ? 2 : 4), r);
    const uint32_t hdr = lds_word(kb);  // d (and Q4_1's m)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w.q[i] = static_cast<int>(gpuFunnelR(r[i], r[i + 1], sh) & 0x0F0F0F0Fu);
      w.q[4 + i] = static_cast<int>(gpuFunnelR(r[i], r[i + 1], sh + 4) & 0x0F0F0F0Fu);
    }
    w.d = half_lo(hdr);
    if constexpr (F == kQ4_1) w.m = half_lo(hdr >> 16);
  } else if constexpr (F == kQ8_0) {
    uint32_t qs[8];
    lds_words<8>(kb + 2, qs);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i] = static_cast<int>(qs[i]);
    w.d = half_lo(lds_word(kb));
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    // The header: d, dmin (word 0), then the 12 packed scale bytes (words 1-3); sub-block u's
    // scale and min come from bytes u % 4, + 4, + 8 of the scales (k4_scale_min_bytes).
    uint32_t h[4];
    if constexpr (A16) {
      const uint4 v = gpuLdsU4(gpuSmemAt(kb));
      h[0] = v.x, h[1] = v.y, h[2] = v.z, h[3] = v.w;
    } else {
      lds_words<4>(kb, h);
    }
    const uint32_t bs = 8u * static_cast<uint32_t>(u & 3);
    k4_scale_min_bytes(static_cast<int>((h[1] >> bs) & 0xFFu), static_cast<int>((h[2] >> bs) & 0xFFu),
                       static_cast<int>((h[3] >> bs) & 0xFFu), u, &w.sc, &w.mn);
    uint32_t qs[8];
    lds_32b<A16>(kb + (F == kQ5_K ? 48 : 16) + 32 * (u >> 1), qs);
    const int sh = (u & 1) * 4;
    uint32_t qh[8];
    if constexpr (F == kQ5_K) lds_32b<A16>(kb + 16, qh);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t q = (qs[i] >> sh) & 0x0F0F0F0Fu;
      if constexpr (F == kQ5_K) q |= ((qh[i] >> u) & 0x01010101u) << 4;
      w.q[i] = static_cast<int>(q);
    }
    w.d = half_lo(h[0]);
    w.m = half_lo(h[0] >> 16);
  } else {  // Q6_K
    const int hf = u >> 2, qq = u & 3;
    uint32_t ql[9], qh[9];  // ql and qh share the k-block's alignment
    const uint32_t sh = lds_raw<8>(kb + 64 * hf + 32 * (qq & 1), ql);
    lds_raw<8>(kb + 128 + 32 * hf, qh);
    const uint32_t scw = lds_word(kb + 192 + 8 * hf + 2 * qq);  // its two int8 scales
    const uint32_t lsh = sh + (qq >> 1) * 4, hsh = sh + 2 * qq;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      w.q[i] = static_cast<int>((gpuFunnelR(ql[i], ql[i + 1], lsh) & 0x0F0F0F0Fu) |
                                ((gpuFunnelR(qh[i], qh[i + 1], hsh) & 0x03030303u) << 4));
    w.sc = static_cast<int>(static_cast<int8_t>(scw & 0xFFu));
    w.mn = static_cast<int>(static_cast<int8_t>((scw >> 8) & 0xFFu));
    w.d = half_lo(lds_word(kb + 208));
  }
  return w;
}

// A unit's float32 product with one activation row under ggml's arithmetic (formula table
// above): integer dots, then the recipe's float32 expression.
template <int F>
__device__ __forceinline__ float dot_unit_q8(const QUnit& w, const int (&qx)[8], float dx,
                                             float sx, int s0, int s1) {
  if constexpr (F == kQ6_K) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) lo = gpuDp4a(w.q[i], qx[i], lo);
#pragma unroll
    for (int i = 4; i < 8; ++i) hi = gpuDp4a(w.q[i], qx[i], hi);
    const int total = w.sc * (lo - 32 * s0) + w.mn * (hi - 32 * s1);
    return (dx * w.d) * static_cast<float>(total);
  } else {
    int isum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) isum = gpuDp4a(w.q[i], qx[i], isum);
    if constexpr (F == kQ4_0) return (w.d * dx) * static_cast<float>(isum - 8 * (s0 + s1));
    if constexpr (F == kQ4_1) return (w.d * dx) * static_cast<float>(isum) + w.m * sx;
    if constexpr (F == kQ8_0) return (w.d * dx) * static_cast<float>(isum);
    return (dx * w.d) * static_cast<float>(w.sc * isum) -
           (dx * w.m) * static_cast<float>(w.mn * (s0 + s1));
  }
}

// The product of unit w (the row's unit g) with held quantized row b.
template <int F, int BT>
__device__ __forceinline__ float unit_row_q8(const QUnit& w, int g, const Rows<BT>& R, int b) {
  const gpuSmemAddr row = gpuSmemAt(R.xq) + static_cast<int>(b * R.xq_stride);
  const gpuSmemAddr q4 = row + 16 * ((g >> 5) * 64 + (g & 31));
  const uint4 a = gpuLdsU4(q4), c = gpuLdsU4(q4 + 32 * 16);
  const int qx[8] = {static_cast<int>(a.x), static_cast<int>(a.y), static_cast<int>(a.z),
                     static_cast<int>(a.w), static_cast<int>(c.x), static_cast<int>(c.y),
                     static_cast<int>(c.z), static_cast<int>(c.w)};
  const int upad = static_cast<int>(R.xq_upad);
  const gpuSmemAddr du = row + upad * 32;
  const float dx = __uint_as_float(gpuLdsU32(du + 4 * g));
  const float sx = F == kQ4_1 ? __uint_as_float(gpuLdsU32(du + 4 * (upad + g))) : 0.f;
  const uint2 s16 = gpuLdsU2(du + 8 * upad + 8 * g);
  return dot_unit_q8<F>(w, qx, dx, sx, static_cast<int>(s16.x), static_cast<int>(s16.y));
}

// accumulate() under ggml's arithmetic for quantized formats, over the rows R.xq: each of the
// lane's units is read and unpacked once and dotted with every row.
template <int F, bool A16, int BT>
__device__ __forceinline__ void accumulate_q8(const uint8_t* p, int nunits, int64_t k0,
                                              const Rows<BT>& R, float (&acc)[BT], int lane) {
  using T = Traits<F>;
  const int g0 = static_cast<int>(k0 >> 5);
#pragma unroll kMvUnroll
  for (int u = (lane - (g0 & 31)) & 31; u < nunits; u += 32) {
    const QUnit w = load_unit_q8<F, A16>(p + (u / T::kUpk) * T::kKbb, u % T::kUpk);
#pragma unroll
    for (int b = 0; b < BT; ++b)
      if (b < R.nb) acc[b] += unit_row_q8<F, BT>(w, g0 + u, R, b);
  }
}

// Two whole consecutive rows of at most 16 units each (rb bytes apart), one activation row: lanes
// 0-15 take the first row's units and lanes 16-31 the second's, unit g of either on lane g of its
// half, where accumulate_q8 puts it on lane g (and leaves lanes 16-31 idle). With write_pair's
// half-warp sums each row gets the bits of accumulate_q8 + write_rows, for half the instructions.
template <int F, bool A16>
__device__ __forceinline__ void accumulate_q8_pair(const uint8_t* p, int nunits, int64_t rb,
                                                   const Rows<1>& R, float (&acc)[1], int lane) {
  using T = Traits<F>;
  const int u = lane & 15;
  if (u < nunits)
    acc[0] += unit_row_q8<F, 1>(
        load_unit_q8<F, A16>(p + (lane >> 4) * rb + (u / T::kUpk) * T::kKbb, u % T::kUpk), u, R, 0);
}

#endif  // JAXVT_FFI_CSRC_MATVEC_Q8_CUH_
