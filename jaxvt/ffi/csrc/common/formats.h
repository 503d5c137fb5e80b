// GGUF block layouts and the dequantization helpers shared by jaxvt's CPU and GPU kernels.
//
// Everything here is `JV_HD` (host and device) so that kernels_cpu*.cc, kernels_gpu.cu (CUDA and
// HIP) compute the same weights from the same bytes. Weights are produced in float32 exactly as
// ggml / gguf-py dequantize them (`x = d*q` or `(d*sc)*q - dmin*m`, float32 products); every dot
// product built on them accumulates in float32.
//
// Kernels see a matrix row as a run of "k-blocks": the format's own block for the quantized
// formats (32 or 256 elements) and 32 elements for F32/F16/BF16. A k-block is split into units of
// 32 consecutive elements (1 unit for 32-element k-blocks, 8 for the 256-element K-quants); a unit
// is the smallest piece a thread dequantizes on its own. Rows therefore need cols % 32 == 0.
#ifndef JAXVT_FFI_CSRC_FORMATS_H_
#define JAXVT_FFI_CSRC_FORMATS_H_

#include <cstdint>
#include <cstring>

#if defined(__HIPCC__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#elif defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
#define JV_HD __host__ __device__ __forceinline__
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define JV_DEVICE_PASS 1
#endif
#else
#define JV_HD inline
#endif

namespace jaxvt {
// A translation unit compiled for a wider ISA (kernels_cpu_avx2.cc) defines this so the inline
// helpers below get internal linkage there and no wide-ISA copy can be picked by the linker for
// the portable code.
#if defined(JAXVT_FORMATS_INTERNAL_LINKAGE)
namespace {
#endif

// ggml type ids (gguf.GGMLQuantizationType).
enum Fmt : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};
constexpr int32_t kHostBit = 1 << 16;  // fmts[l] | kHostBit: layer l lives in the host tier
constexpr int32_t kFmtMask = kHostBit - 1;
constexpr int kUnit = 32;               // elements per unit

// The formats jaxvt runs: ggml type id, name, elements and bytes of one ggml block. Python holds
// the same table once (jaxvt/gguf/formats.py); tests/test_formats.py compares the two through the
// extension's `formats()`. The kernels' per-format functions below are checked against it at
// compile time.
struct FormatInfo {
  int type_id;
  const char* name;
  int block_elems;
  int block_bytes;
};
constexpr FormatInfo kFormats[] = {
    {kF32, "F32", 1, 4},          {kF16, "F16", 1, 2},          {kQ4_0, "Q4_0", 32, 18},
    {kQ4_1, "Q4_1", 32, 20},      {kQ8_0, "Q8_0", 32, 34},      {kQ4_K, "Q4_K", 256, 144},
    {kQ5_K, "Q5_K", 256, 176},    {kQ6_K, "Q6_K", 256, 210},    {kBF16, "BF16", 1, 2},
};

// Block layouts (little-endian; f16 stored as raw uint16 bits). Sizes are ggml's.
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };                  // x = d * (q - 8)
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };               // x = d * q + m
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };                   // x = d * q
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12], qs[128]; };            // 8 x 32
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12], qh[32], qs[128]; };    // 8 x 32, 5 bits
struct BlockQ6_K { uint8_t ql[128], qh[64]; int8_t scales[16]; uint16_t d; };   // 16 x 16, 6 bits
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34, "");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "");

JV_HD constexpr bool fmt_supported(int f) {
  return f == kF32 || f == kF16 || f == kBF16 || f == kQ4_0 || f == kQ4_1 || f == kQ8_0 ||
         f == kQ4_K || f == kQ5_K || f == kQ6_K;
}
// Elements / bytes of one k-block (the format's block, 32 elements for F32/F16/BF16), units per
// k-block. Written as switches so device code needs no table in memory.
JV_HD constexpr int kblock_elems(int f) { return (f == kQ4_K || f == kQ5_K || f == kQ6_K) ? 256 : 32; }
JV_HD constexpr int kblock_bytes(int f) {
  switch (f) {
    case kF32: return 128;
    case kF16: case kBF16: return 64;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}
JV_HD constexpr int units_per_kblock(int f) { return kblock_elems(f) / kUnit; }
// Bytes of a row of `cols` elements (cols a multiple of the k-block size).
JV_HD constexpr int64_t row_bytes(int f, int64_t cols) { return cols / kblock_elems(f) * kblock_bytes(f); }

// Every format of the table is supported, and its k-block is whole ggml blocks of its size.
constexpr bool kblocks_match_table() {
  int n = 0;
  for (const FormatInfo& f : kFormats) {
    const int ke = kblock_elems(f.type_id);
    if (!fmt_supported(f.type_id) || ke % f.block_elems != 0 ||
        kblock_bytes(f.type_id) != ke / f.block_elems * f.block_bytes)
      return false;
    ++n;
  }
  for (int t = 0; t < 64; ++t) n -= fmt_supported(t) ? 1 : 0;
  return n == 0;
}
static_assert(kblocks_match_table(), "the k-block functions disagree with kFormats");

// ---- scalar conversions ------------------------------------------------------------------------

JV_HD float bits_to_float(uint32_t u) {
#if defined(JV_DEVICE_PASS)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
JV_HD uint32_t float_to_bits(float f) {
#if defined(JV_DEVICE_PASS)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
// IEEE half -> float, exact for every input (subnormals, inf, NaN included).
JV_HD float half_to_float(uint16_t h) {
#if defined(JV_DEVICE_PASS)
  return __half2float(__ushort_as_half(h));  // hardware conversion, exact
#else
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

// float -> IEEE half bits, round to nearest even (ggml's GGML_FP32_TO_FP16 / F16C, numpy).
JV_HD uint16_t float_to_half(float f) {
#if defined(JV_DEVICE_PASS)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (ax >= 0x38800000u) {                                                // normal half
    uint32_t r = ax - 0x38000000u;
    r += 0xFFFu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (ax < 0x33000000u) return static_cast<uint16_t>(sign);  // below 2^-25: zero
  const uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u, sh = 126u - e;
  uint32_t q = m >> sh;
  const uint32_t rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
#endif
}
JV_HD float round_half(float f) { return half_to_float(float_to_half(f)); }

// float(q) - OFF for a small non-negative integer q (q < 2^22), exactly. On the device this uses
// the 2^23 "magic number" (an OR and a subtraction, both full rate) instead of an int->float
// conversion, which runs at a quarter of the FMA rate on NVIDIA parts.
template <int OFF>
JV_HD float q2f(uint32_t q) {
#if defined(JV_DEVICE_PASS)
  return __uint_as_float(0x4B000000u | q) - (8388608.0f + static_cast<float>(OFF));
#else
  return static_cast<float>(static_cast<int>(q) - OFF);
#endif
}
JV_HD float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }
// float -> bf16 bits, round to nearest even (NaN stays NaN).
JV_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
JV_HD float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// ---- byte loads that tolerate any alignment ----------------------------------------------------

JV_HD uint32_t ld_u16(const uint8_t* p) { return p[0] | (static_cast<uint32_t>(p[1]) << 8); }
JV_HD uint32_t ld_u32(const uint8_t* p) {
#if defined(JV_DEVICE_PASS)
  // Two aligned words and a funnel shift: the extra bytes read share the aligned word of the last
  // wanted byte, so they never cross a page or a shared-memory allocation's padded end.
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(a & ~uintptr_t{3});
  uint32_t sh = static_cast<uint32_t>(a & 3u) * 8u;
  if (sh == 0) return w[0];
  uint64_t both = (static_cast<uint64_t>(w[1]) << 32) | w[0];
  return static_cast<uint32_t>(both >> sh);
#else
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}
JV_HD float ld_half(const uint8_t* p) { return half_to_float(static_cast<uint16_t>(ld_u16(p))); }

// Q4_K / Q5_K packed 6-bit scale and min of sub-block j (0..7) (ggml's get_scale_min_k4).
// a, b, c: scale bytes j % 4, j % 4 + 4 and j % 4 + 8 (both cases read those three: select
// without branching).
JV_HD void k4_scale_min_bytes(int a, int b, int c, int j, int* sc, int* m) {
  *sc = j < 4 ? (a & 63) : ((c & 0x0F) | ((a >> 6) << 4));
  *m = j < 4 ? (b & 63) : ((c >> 4) | ((b >> 6) << 4));
}
JV_HD void k4_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  const int lo = j & 3;
  k4_scale_min_bytes(s[lo], s[lo + 4], s[lo + 8], j, sc, m);
}

// ---- unit dequantization: w[0..31] = elements [32u, 32u+32) of the k-block at kb ---------------

template <int F>
JV_HD void unit_weights(const uint8_t* kb, int u, float* w);

template <>
JV_HD void unit_weights<kF32>(const uint8_t* kb, int, float* w) {
#pragma unroll
  for (int i = 0; i < 32; ++i) w[i] = bits_to_float(ld_u32(kb + 4 * i));
}
template <>
JV_HD void unit_weights<kF16>(const uint8_t* kb, int, float* w) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    uint32_t v = ld_u32(kb + 4 * i);
    w[2 * i] = half_to_float(static_cast<uint16_t>(v & 0xFFFFu));
    w[2 * i + 1] = half_to_float(static_cast<uint16_t>(v >> 16));
  }
}
template <>
JV_HD void unit_weights<kBF16>(const uint8_t* kb, int, float* w) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    uint32_t v = ld_u32(kb + 4 * i);
    w[2 * i] = bits_to_float(v << 16);
    w[2 * i + 1] = bits_to_float(v & 0xFFFF0000u);
  }
}
template <>
JV_HD void unit_weights<kQ4_0>(const uint8_t* kb, int, float* w) {
  float d = ld_half(kb);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t q = ld_u32(kb + 2 + 4 * i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b = (q >> (8 * j)) & 0xFFu;
      w[4 * i + j] = d * q2f<8>(b & 0x0Fu);
      w[16 + 4 * i + j] = d * q2f<8>(b >> 4);
    }
  }
}
template <>
JV_HD void unit_weights<kQ4_1>(const uint8_t* kb, int, float* w) {
  float d = ld_half(kb), m = ld_half(kb + 2);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t q = ld_u32(kb + 4 + 4 * i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b = (q >> (8 * j)) & 0xFFu;
      // d*q is exact in float32 (11 x 4 significant bits), so contracting into an FMA or not
      // gives the same rounding as ggml's `d*q + m`; the same holds for the K formats below.
      float lo = d * q2f<0>(b & 0x0Fu), hi = d * q2f<0>(b >> 4);
      w[4 * i + j] = lo + m;
      w[16 + 4 * i + j] = hi + m;
    }
  }
}
template <>
JV_HD void unit_weights<kQ8_0>(const uint8_t* kb, int, float* w) {
  float d = ld_half(kb);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t q = ld_u32(kb + 2 + 4 * i);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[4 * i + j] = d * q2f<128>(((q >> (8 * j)) & 0xFFu) ^ 0x80u);  // int8 = (byte ^ 0x80) - 128
  }
}
template <>
JV_HD void unit_weights<kQ4_K>(const uint8_t* kb, int u, float* w) {
  int sc, mn;
  k4_scale_min(kb + 4, u, &sc, &mn);
  float d1 = ld_half(kb) * static_cast<float>(sc), m1 = ld_half(kb + 2) * static_cast<float>(mn);
  const uint8_t* qs = kb + 16 + 32 * (u >> 1);
  int sh = (u & 1) * 4;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t q = ld_u32(qs + 4 * i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float p = d1 * q2f<0>((q >> (8 * j + sh)) & 0x0Fu);
      w[4 * i + j] = p - m1;
    }
  }
}
template <>
JV_HD void unit_weights<kQ5_K>(const uint8_t* kb, int u, float* w) {
  int sc, mn;
  k4_scale_min(kb + 4, u, &sc, &mn);
  float d1 = ld_half(kb) * static_cast<float>(sc), m1 = ld_half(kb + 2) * static_cast<float>(mn);
  const uint8_t* qh = kb + 16;
  const uint8_t* qs = kb + 48 + 32 * (u >> 1);
  int sh = (u & 1) * 4;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t q = ld_u32(qs + 4 * i), h = ld_u32(qh + 4 * i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t v = ((q >> (8 * j + sh)) & 0x0Fu) | (((h >> (8 * j + u)) & 1u) << 4);
      float p = d1 * q2f<0>(v);
      w[4 * i + j] = p - m1;
    }
  }
}
template <>
JV_HD void unit_weights<kQ6_K>(const uint8_t* kb, int u, float* w) {
  // Unit u: half h = u / 4 (128 elements), quarter qq = u % 4 (32 elements) of that half.
  int h = u >> 2, qq = u & 3;
  const uint8_t* ql = kb + 64 * h + 32 * (qq & 1);
  const uint8_t* qh = kb + 128 + 32 * h;
  const int8_t* sc = reinterpret_cast<const int8_t*>(kb + 192 + 8 * h + 2 * qq);
  float d = ld_half(kb + 208);
  float d0 = d * static_cast<float>(sc[0]), d1 = d * static_cast<float>(sc[1]);
  int lsh = (qq >> 1) * 4, hsh = 2 * qq;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t l = ld_u32(ql + 4 * i), hb = ld_u32(qh + 4 * i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t v = ((l >> (8 * j + lsh)) & 0x0Fu) | (((hb >> (8 * j + hsh)) & 3u) << 4);
      w[4 * i + j] = (i < 4 ? d0 : d1) * q2f<32>(v);
    }
  }
}

// ---- where a layer's bytes are -----------------------------------------------------------------

struct LayerRef {
  const uint8_t* base;  // first byte of the layer's matrix (expert 0, row 0)
  int fmt;              // ggml type id
  bool host;            // base is in the pinned host tier
};

// Entry l of a layer table (uint32 [L, 2]: lo, hi): a host address, or a device-tier row index.
JV_HD uint64_t table_entry(const uint32_t* table, int64_t l) {
  return static_cast<uint64_t>(table[2 * l]) | (static_cast<uint64_t>(table[2 * l + 1]) << 32);
}

// table: uint32 [L, 2] (lo, hi); fmts: int32 [L]; data: the device-tier stack [n, stride].
// The layer index is clamped into [0, L) like a JAX dynamic index.
JV_HD LayerRef resolve_layer(const uint8_t* data, int64_t stride, const uint32_t* table,
                             const int32_t* fmts, int64_t n_layers, int32_t layer) {
  int64_t l = layer < 0 ? 0 : (layer >= n_layers ? n_layers - 1 : layer);
  int32_t f = fmts[l];
  const uint64_t v = table_entry(table, l);
  LayerRef r;
  r.fmt = f & kFmtMask;
  r.host = (f & kHostBit) != 0;
  r.base = (f & kHostBit) ? reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(v))
                          : data + static_cast<int64_t>(v) * stride;
  return r;
}

#if defined(JAXVT_FORMATS_INTERNAL_LINKAGE)
}  // namespace
#endif
}  // namespace jaxvt

#endif  // JAXVT_FFI_CSRC_FORMATS_H_
