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
  const int64_t nu = R.cols / 32, upad = xq_upad(R.cols), st = xq_bytes(R.cols);
  if (act < 2) {  // Q8_0 / Q8_1: a warp per 32-element block, a lane per element
    for (int64_t t = wib; t < nb * nu; t += nw) {
      const int b = static_cast<int>(t / nu);
      const int64_t g = t % nu;
      uint8_t* row = xq + b * st;
      const float v = R.xrow(b)[g * 32 + lane];
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
    for (int64_t t = wib; t < nb * (nu / 8); t += nw) {
      const int b = static_cast<int>(t / (nu / 8));
      const int64_t kb = t % (nu / 8);
      uint8_t* row = xq + b * st;
      const float4* src = reinterpret_cast<const float4*>(R.xrow(b) + kb * 256 + 8 * lane);
      const float4 p0 = src[0], p1 = src[1];
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
      const int64_t g = kb * 8 + lane / 4, off = (lane & 3) * 8;  // unit, first element in it
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

// A unit's float32 product under ggml's arithmetic (formula table above); kb is its k-block.
template <int F>
__device__ __forceinline__ float unit_dot_q8(const uint8_t* kb, int u, const int (&qx)[8], float dx,
                                             float sx, int s0, int s1) {
  int isum = 0;
  if constexpr (F == kQ4_0 || F == kQ4_1) {
    const uint8_t* qs = kb + (F == kQ4_0 ? 2 : 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = ld_u32(qs + 4 * i);
      isum = gpuDp4a(static_cast<int>(w & 0x0F0F0F0Fu), qx[i], isum);
      isum = gpuDp4a(static_cast<int>((w >> 4) & 0x0F0F0F0Fu), qx[4 + i], isum);
    }
    const float dw = ld_half(kb);
    if constexpr (F == kQ4_0) return (dw * dx) * static_cast<float>(isum - 8 * (s0 + s1));
    return (dw * dx) * static_cast<float>(isum) + ld_half(kb + 2) * sx;
  } else if constexpr (F == kQ8_0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) isum = gpuDp4a(static_cast<int>(ld_u32(kb + 2 + 4 * i)), qx[i], isum);
    return (ld_half(kb) * dx) * static_cast<float>(isum);
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    int sc, mn;
    k4_scale_min(kb + 4, u, &sc, &mn);
    const uint8_t* qs = kb + (F == kQ5_K ? 48 : 16) + 32 * (u >> 1);
    const int sh = (u & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t q = (ld_u32(qs + 4 * i) >> sh) & 0x0F0F0F0Fu;
      if constexpr (F == kQ5_K) q |= ((ld_u32(kb + 16 + 4 * i) >> u) & 0x01010101u) << 4;
      isum = gpuDp4a(static_cast<int>(q), qx[i], isum);
    }
    return (dx * ld_half(kb)) * static_cast<float>(sc * isum) -
           (dx * ld_half(kb + 2)) * static_cast<float>(mn * (s0 + s1));
  } else {  // Q6_K
    const int h = u >> 2, qq = u & 3;
    const uint8_t* ql = kb + 64 * h + 32 * (qq & 1);
    const uint8_t* qh = kb + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(kb + 192 + 8 * h + 2 * qq);
    const int lsh = (qq >> 1) * 4, hsh = 2 * qq;
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t q = ((ld_u32(ql + 4 * i) >> lsh) & 0x0F0F0F0Fu) |
                         (((ld_u32(qh + 4 * i) >> hsh) & 0x03030303u) << 4);
      if (i < 4) lo = gpuDp4a(static_cast<int>(q), qx[i], lo);
      else hi = gpuDp4a(static_cast<int>(q), qx[i], hi);
    }
    const int total = static_cast<int>(sc[0]) * (lo - 32 * s0) + static_cast<int>(sc[1]) * (hi - 32 * s1);
    return (dx * ld_half(kb + 208)) * static_cast<float>(total);
  }
}

// The product of a row's unit g (unit u of the k-block at kb) with held quantized row b.
template <int F, int BT>
__device__ __forceinline__ float unit_q8(const uint8_t* kb, int u, int64_t g, const Rows<BT>& R,
                                         int b) {
  const uint8_t* row = R.xq + b * R.xq_stride;
  const uint4* q4 = reinterpret_cast<const uint4*>(row) + (g >> 5) * 64 + (g & 31);
  const uint4 a = q4[0], c = q4[32];
  const int qx[8] = {static_cast<int>(a.x), static_cast<int>(a.y), static_cast<int>(a.z),
                     static_cast<int>(a.w), static_cast<int>(c.x), static_cast<int>(c.y),
                     static_cast<int>(c.z), static_cast<int>(c.w)};
  const float* du = reinterpret_cast<const float*>(row + R.xq_upad * 32);
  const int* s16 = reinterpret_cast<const int*>(du + 2 * R.xq_upad);
  return unit_dot_q8<F>(kb, u, qx, du[g], du[R.xq_upad + g], s16[2 * g], s16[2 * g + 1]);
}

// accumulate() under ggml's arithmetic for quantized formats, over the rows R.xq.
template <int F, int BT>
__device__ __forceinline__ void accumulate_q8(const uint8_t* p, int nunits, int64_t k0,
                                              const Rows<BT>& R, float (&acc)[BT], int lane) {
  using T = Traits<F>;
  for (int u = (lane - static_cast<int>((k0 >> 5) & 31)) & 31; u < nunits; u += 32) {
    const uint8_t* kb = p + (u / T::kUpk) * T::kKbb;
#pragma unroll
    for (int b = 0; b < BT; ++b)
      if (b < R.nb) acc[b] += unit_q8<F, BT>(kb, u % T::kUpk, (k0 >> 5) + u, R, b);
  }
}

// Two whole consecutive rows of at most 16 units each (rb bytes apart), one activation row: lanes
// 0-15 take the first row's units and lanes 16-31 the second's, unit g of either on lane g of its
// half, where accumulate_q8 puts it on lane g (and leaves lanes 16-31 idle). With write_pair's
// half-warp sums each row gets the bits of accumulate_q8 + write_rows, for half the instructions.
template <int F>
__device__ __forceinline__ void accumulate_q8_pair(const uint8_t* p, int nunits, int64_t rb,
                                                   const Rows<1>& R, float (&acc)[1], int lane) {
  using T = Traits<F>;
  const int u = lane & 15;
  if (u < nunits)
    acc[0] += unit_q8<F, 1>(p + (lane >> 4) * rb + (u / T::kUpk) * T::kKbb, u % T::kUpk, u, R, 0);
}

#endif  // JAXVT_FFI_CSRC_MATVEC_Q8_CUH_
