// ggml-mode pieces of the device kernels (included by kernels_gpu.cu inside its anonymous
// namespace): the activation pre-pass and the per-unit integer dot products.
//
// quantize_act_kernel converts each activation row to the layer format's vec-dot type (act.h,
// the recipes of ggml's from_float, the same bits as the CPU kernels) into the scratch result.
// unit_dot_q8 then dots one 32-element unit of a weight row with a converted activation row:
// __dp4a over 4 bytes at a time (exact int32), scales applied in float32. Per unit:
//   Q4_0: (dw*da) * (isum - 8*sum(qa))     Q4_1: (dw*da) * isum + mw*sa     Q8_0: (dw*da) * isum
//   Q4_K/Q5_K sub-block j: (da*dw) * (sc_j*isum) + (-da*dmin) * (m_j*(bsum_2j + bsum_2j+1))
//   Q6_K: (da*dw) * (sc0*(isum0 - 32*bsum0) + sc1*(isum1 - 32*bsum1))
//   F32/F16/BF16: sum of float32 products with the activation in its (rounded) type
// The integers are exactly the CPU kernels' and the jnp reference's; only the float32 order of the
// sums differs (units, then the warp's shuffle reduction), so results agree to float32 rounding.

__device__ __forceinline__ int dot4(int a, int b, int c) {
#if defined(JAXVT_GPU_CUDA)
  return __dp4a(a, b, c);
#else
  const int8_t* x = reinterpret_cast<const int8_t*>(&a);
  const int8_t* y = reinterpret_cast<const int8_t*>(&b);
  return c + x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
#endif
}
__device__ __forceinline__ int ld_i32(const uint8_t* p) { return static_cast<int>(ld_u32(p)); }
__device__ __forceinline__ int ld_i16(const uint8_t* p) {
  return static_cast<int16_t>(static_cast<uint16_t>(ld_u16(p)));
}

// One thread per block of the vec-dot type (32 elements; 256 for Q8_K), grid-stride over rows.
__global__ void __launch_bounds__(256) quantize_act_kernel(WeightArgs w, const float* x, int64_t n,
                                                           int64_t cols, uint8_t* act,
                                                           int64_t astride) {
  const LayerRef L = resolve_layer(w.data, w.stride, w.table, w.fmts, w.n_layers, *w.layer);
  const int vt = vec_type(L.fmt);
  const int64_t blk = vt == kVQ8_K ? 256 : 32;
  const int64_t per_row = cols / blk, total = n * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, j = i % per_row;
    quantize_act(vt, x + r * cols, j * blk, (j + 1) * blk, act + r * astride);
  }
}

// Unit u (elements 32u' .. of k-block kb, u' = u % units_per_kblock) against activation row ar,
// whose first element is the row's element k (= 32 * global unit index).
template <int F>
__device__ __forceinline__ float unit_dot_q8(const uint8_t* kb, int u, const uint8_t* ar,
                                             int64_t k) {
  if constexpr (F == kQ4_0 || F == kQ4_1 || F == kQ8_0) {
    const uint8_t* ab = ar + (k / 32) * kQ8Bytes;
    const uint8_t* qa = ab + 8;
    const float d = ld_half(kb) * ld_f32(ab);
    int isum = 0;
    if constexpr (F == kQ8_0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) isum = dot4(ld_i32(kb + 2 + 4 * i), ld_i32(qa + 4 * i), isum);
      return d * static_cast<float>(isum);
    } else {
      const uint8_t* qs = kb + (F == kQ4_1 ? 4 : 2);
      int asum = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t v = ld_u32(qs + 4 * i);
        const int a0 = ld_i32(qa + 4 * i), a1 = ld_i32(qa + 16 + 4 * i);
        isum = dot4(static_cast<int>(v & 0x0F0F0F0Fu), a0, isum);
        isum = dot4(static_cast<int>((v >> 4) & 0x0F0F0F0Fu), a1, isum);
        if constexpr (F == kQ4_0) asum = dot4(0x01010101, a1, dot4(0x01010101, a0, asum));
      }
      if constexpr (F == kQ4_0) return d * static_cast<float>(isum - 8 * asum);
      return d * static_cast<float>(isum) + ld_half(kb + 2) * ld_f32(ab + 4);
    }
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    const uint8_t* ab = ar + (k / 256) * kQ8KBytes;
    const uint8_t* qa = ab + 36 + (k % 256);
    int sc, mn;
    k4_scale_min(kb + 4, u, &sc, &mn);
    const uint8_t* qs = kb + (F == kQ5_K ? 48 : 16) + 32 * (u >> 1);
    const int sh = (u & 1) * 4;
    int isum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t v = (ld_u32(qs + 4 * i) >> sh) & 0x0F0F0F0Fu;
      if constexpr (F == kQ5_K) v |= ((ld_u32(kb + 16 + 4 * i) >> u) & 0x01010101u) << 4;
      isum = dot4(static_cast<int>(v), ld_i32(qa + 4 * i), isum);
    }
    const float da = ld_f32(ab);
    const int bsp = ld_i16(ab + 4 + 4 * u) + ld_i16(ab + 6 + 4 * u);
    return (da * ld_half(kb)) * static_cast<float>(sc * isum) +
           (-da * ld_half(kb + 2)) * static_cast<float>(mn * bsp);
  } else if constexpr (F == kQ6_K) {
    const uint8_t* ab = ar + (k / 256) * kQ8KBytes;
    const uint8_t* qa = ab + 36 + (k % 256);
    const int h = u >> 2, qq = u & 3;
    const uint8_t* ql = kb + 64 * h + 32 * (qq & 1);
    const uint8_t* qh = kb + 128 + 32 * h;
    const int lsh = (qq >> 1) * 4, hsh = 2 * qq;
    int is[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = ((ld_u32(ql + 4 * i) >> lsh) & 0x0F0F0F0Fu) |
                         (((ld_u32(qh + 4 * i) >> hsh) & 0x03030303u) << 4);
      is[i >> 2] = dot4(static_cast<int>(v), ld_i32(qa + 4 * i), is[i >> 2]);
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(kb + 192 + 8 * h + 2 * qq);
    const int t = sc[0] * (is[0] - 32 * ld_i16(ab + 4 + 4 * u)) +
                  sc[1] * (is[1] - 32 * ld_i16(ab + 6 + 4 * u));
    return (ld_f32(ab) * ld_half(kb + 208)) * static_cast<float>(t);
  } else {
    float wv[32];
    unit_weights<F>(kb, u, wv);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      float a;
      if constexpr (F == kF32) a = ld_f32(ar + 4 * (k + i));
      else if constexpr (F == kF16)
        a = half_to_float(static_cast<uint16_t>(ld_u16(ar + 2 * (k + i))));
      else a = bf16_to_float(static_cast<uint16_t>(ld_u16(ar + 2 * (k + i))));
      s += wv[i] * a;
    }
    return s;
  }
}
