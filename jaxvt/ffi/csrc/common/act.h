// Activation rows in a weight format's "vec-dot type": the arithmetic contract of jaxvt's
// quantized matmul in ggml mode (the mode llama.cpp's CPU backend computes).
//
// Before a product with a weight matrix of format F, each activation row x (float32, cols
// elements) is converted to F's vec-dot type, exactly as ggml's `from_float` does:
//
//   F32            -> F32    (x itself)
//   F16            -> F16    (round to nearest even)
//   BF16           -> BF16   (round to nearest even)
//   Q4_0, Q8_0     -> Q8_0   per 32 elements: amax = max|x|, d = amax/127, id = 127/amax (0 if
//                            amax = 0), q = round_half_even(x*id) (float32 product), d stored as
//                            f16
//   Q4_1           -> Q8_1   as Q8_0, plus s = f16(d * sum(q)) (d before its f16 rounding)
//   Q4_K/Q5_K/Q6_K -> Q8_K   per 256 elements: m = the element of largest |x| (first one),
//                            iscale = -127/m, q = min(127, round_half_even(iscale*x)),
//                            d = 1/iscale (float32), bsums = sums of 16 q
//
// The layout here is jaxvt's own (scales widened to float32, which holds every f16 exactly):
//   Q8_0 / Q8_1 block (40 bytes): float d, float s, int8 q[32]
//   Q8_K block (292 bytes):       float d, int16 bsums[16], int8 q[256]
//   F16 / BF16: uint16 bits [cols]; F32: float [cols]
// The integer dot products and their float32 scaling are in kernels_cpu_q8.cc (the order the
// CPU kernels share with ggml's AVX2 build) and kernels_gpu.cu.
#ifndef JAXVT_FFI_CSRC_ACT_H_
#define JAXVT_FFI_CSRC_ACT_H_

#include <cmath>
#include <cstdint>

#include "common/formats.h"

namespace jaxvt {
#if defined(JAXVT_FORMATS_INTERNAL_LINKAGE)
namespace {
#endif

enum VecType : int { kVF32 = 0, kVF16 = 1, kVBF16 = 2, kVQ8_0 = 3, kVQ8_1 = 4, kVQ8_K = 5 };

constexpr int kQ8Bytes = 40;    // Q8_0 / Q8_1 block: float d, float s, int8 q[32]
constexpr int kQ8KBytes = 292;  // Q8_K block: float d, int16 bsums[16], int8 q[256]

JV_HD int vec_type(int f) {
  switch (f) {
    case kF16: return kVF16;
    case kBF16: return kVBF16;
    case kQ4_0: case kQ8_0: return kVQ8_0;
    case kQ4_1: return kVQ8_1;
    case kQ4_K: case kQ5_K: case kQ6_K: return kVQ8_K;
    default: return kVF32;
  }
}

// Bytes of one activation row of `cols` elements in vec-dot type vt.
JV_HD int64_t act_row_bytes(int vt, int64_t cols) {
  switch (vt) {
    case kVF16: case kVBF16: return 2 * cols;
    case kVQ8_0: case kVQ8_1: return cols / 32 * kQ8Bytes;
    case kVQ8_K: return cols / 256 * kQ8KBytes;
    default: return 4 * cols;
  }
}

JV_HD float ld_f32(const uint8_t* p) { return bits_to_float(ld_u32(p)); }
JV_HD void st_f32(uint8_t* p, float v) {
  const uint32_t u = float_to_bits(v);
  p[0] = static_cast<uint8_t>(u);
  p[1] = static_cast<uint8_t>(u >> 8);
  p[2] = static_cast<uint8_t>(u >> 16);
  p[3] = static_cast<uint8_t>(u >> 24);
}

// a*b rounded once, never contracted into a later addition (nvcc fuses by default).
JV_HD float mul_rn(float a, float b) {
#if defined(JV_DEVICE_PASS)
  return __fmul_rn(a, b);
#else
  return a * b;  // host units are compiled with -ffp-contract=off
#endif
}
JV_HD int rne_int(float v) {  // round half to even, |v| < 2^22 (activation quants are <= 127.5)
#if defined(JV_DEVICE_PASS)
  return __float2int_rn(v);
#else
  // Adding 1.5 * 2^23 leaves no fraction bits, so the addition itself rounds (half to even, the
  // default mode); ggml's nearest_int does the same. Unlike nearbyintf, no libm call.
  const float t = v + 12582912.f;
  return static_cast<int>(t - 12582912.f);
#endif
}

// One Q8_0 / Q8_1 block (32 elements of x) into out (kQ8Bytes).
JV_HD void quantize_q8_block(const float* x, uint8_t* out, bool with_sum) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) {
    const float ax = fabsf(x[i]);
    amax = ax > amax ? ax : amax;
  }
  const float d = amax / 127.f;
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  int8_t* q = reinterpret_cast<int8_t*>(out + 8);
  int sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = rne_int(mul_rn(x[i], id));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  st_f32(out, round_half(d));
  st_f32(out + 4, with_sum ? round_half(mul_rn(d, static_cast<float>(sum))) : 0.f);
}

// One Q8_K block (256 elements of x) into out (kQ8KBytes), as ggml's quantize_row_q8_K_ref.
JV_HD void quantize_q8k_block(const float* x, uint8_t* out) {
  float amax = 0.f, mx = 0.f;
  for (int j = 0; j < 256; ++j) {
    const float ax = fabsf(x[j]);
    if (ax > amax) {
      amax = ax;
      mx = x[j];
    }
  }
  int8_t* q = reinterpret_cast<int8_t*>(out + 36);
  int16_t bs[16];
  if (amax == 0.f) {
    st_f32(out, 0.f);
    for (int j = 0; j < 256; ++j) q[j] = 0;
    for (int j = 0; j < 16; ++j) bs[j] = 0;
  } else {
    const float iscale = -127.f / mx;
    for (int j = 0; j < 256; ++j) {
      const int v = rne_int(mul_rn(iscale, x[j]));
      q[j] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += q[16 * j + i];
      bs[j] = static_cast<int16_t>(s);
    }
    st_f32(out, 1.f / iscale);
  }
  for (int j = 0; j < 16; ++j) {
    out[4 + 2 * j] = static_cast<uint8_t>(static_cast<uint16_t>(bs[j]));
    out[5 + 2 * j] = static_cast<uint8_t>(static_cast<uint16_t>(bs[j]) >> 8);
  }
}

// Elements [i0, i1) of row x (i0, i1 multiples of the type's block) into the row buffer a.
JV_HD void quantize_act(int vt, const float* x, int64_t i0, int64_t i1, uint8_t* a) {
  switch (vt) {
    case kVQ8_0: case kVQ8_1:
      for (int64_t i = i0; i < i1; i += 32)
        quantize_q8_block(x + i, a + i / 32 * kQ8Bytes, vt == kVQ8_1);
      return;
    case kVQ8_K:
      for (int64_t i = i0; i < i1; i += 256) quantize_q8k_block(x + i, a + i / 256 * kQ8KBytes);
      return;
    case kVF16:
      for (int64_t i = i0; i < i1; ++i) {
        const uint16_t h = float_to_half(x[i]);
        a[2 * i] = static_cast<uint8_t>(h);
        a[2 * i + 1] = static_cast<uint8_t>(h >> 8);
      }
      return;
    case kVBF16:
      for (int64_t i = i0; i < i1; ++i) {
        const uint16_t h = float_to_bf16(x[i]);
        a[2 * i] = static_cast<uint8_t>(h);
        a[2 * i + 1] = static_cast<uint8_t>(h >> 8);
      }
      return;
    default:
      for (int64_t i = i0; i < i1; ++i) st_f32(a + 4 * i, x[i]);
      return;
  }
}

#if defined(JAXVT_FORMATS_INTERNAL_LINKAGE)
}  // namespace
#endif
}  // namespace jaxvt

#endif  // JAXVT_FFI_CSRC_ACT_H_
