"""Quantize float32 arrays into GGUF blocks (numpy), for test fixtures and synthetic models.

- `quantize(x f32 [..., cols], type_id) -> uint8 [..., row_bytes]` for all nine formats of
  `jaxvt.gguf.quants.FORMATS`: F32/F16/BF16 by casting, Q4_0/Q4_1/Q8_0 by `gguf.quants.quantize`,
  Q4_K/Q5_K/Q6_K by our own quantizer below (gguf-py has none).
- `random_blocks(rng, type_id, shape) -> uint8 [..., row_bytes]`: valid random blocks (random
  quants, finite positive f16 super-block scales) at random-byte speed, for synthetic weights.

The K-quantizer is a one-pass min/max scheme that never clips. Per super-block of 256:

- Q4_K/Q5_K (L = 15 / 31 levels above 0, 8 sub-blocks of 32): the sub-block offset must be <= 0
  (x = d*sc*q - dmin*m with m >= 0), so lo_j = min(min x_j, 0). dmin = max_j(-lo_j)/63 rounded
  *up* to f16, m_j = ceil(-lo_j / dmin), so the representable bottom -dmin*m_j <= lo_j. The
  step needed is need_j = (max x_j + dmin*m_j) / L; d = max_j need_j / 63 rounded up to f16 and
  sc_j = ceil(need_j / d), so the step d*sc_j >= need_j covers the sub-block. q = rint.
- Q6_K (16 sub-blocks of 16, symmetric, q - 32 in [-32, 31]): need_j = max|x_j| / 31,
  d = max_j need_j / 127 rounded up to f16, sc_j = ceil(need_j / d) in [0, 127].

Error bound: every element rounds to the nearest level of a range that covers it, so
|err| <= step_j / 2 <= (need_j + d) / 2, up to float32 rounding. With A the super-block's max |x|
and R its max_j(max x_j - lo_j) <= 2A: Q4_K <= (R + A/63)/30 * (1 + 1/63) ~ 0.069 A,
Q5_K ~ 0.033 A, Q6_K <= A/62 * (1 + 1/127) ~ 0.0163 A (f16 subnormal d adds up to 2^-25 each).
"""

from __future__ import annotations

import gguf
import numpy as np

from jaxvt.errors import JaxvtError
from jaxvt.gguf.quants import (BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, get_format,
                               row_bytes)


def _f16_up(v: np.ndarray, what: str) -> np.ndarray:
  """f32 [...] >= 0 -> f16 [...], the smallest f16 >= v (so a scale never shrinks)."""
  with np.errstate(over="ignore"):
    h = v.astype(np.float16)
  h = np.where(h.astype(np.float32) < v, np.nextafter(h, np.float16(np.inf)), h)
  if not np.all(np.isfinite(h)):
    raise JaxvtError(
        f"{what} scale overflows float16 (max |x| ~ {float(np.max(v)):.3g} x levels); "
        f"rescale the values to |x| < ~1e7 before quantizing")
  return h


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """a / b with 0 where b == 0 (f32)."""
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(b > 0, a / np.where(b > 0, b, 1), 0).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
  """uint8 [..., 8, 32] (values < 16) -> [..., 128]: byte 32g+i = q[2g,i] | q[2g+1,i] << 4."""
  q = q.reshape(*q.shape[:-2], 4, 2, 32)
  return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], 128)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
  """6-bit sc, m uint8 [..., 8] -> packed uint8 [..., 12] (inverse of quants._k_scale_min)."""
  b0 = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
  b1 = m[..., :4] | ((m[..., 4:] >> 4) << 6)
  b2 = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
  return np.concatenate([b0, b1, b2], axis=-1)


def _f16_bytes(h: np.ndarray) -> np.ndarray:
  """f16 [...] -> uint8 [..., 2] (little-endian)."""
  return np.ascontiguousarray(h.astype("<f2")).view(np.uint8).reshape(*h.shape, 2)


def _quantize_k_asym(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
  """Q4_K/Q5_K core. x f32 [N, 8, 32] -> (d f16 [N], dmin f16 [N], sc u8 [N,8], m u8 [N,8],
  q u8 [N,8,32] in [0, levels])."""
  what = "Q4_K" if levels == 15 else "Q5_K"
  lo = np.minimum(x.min(axis=-1), 0)                              # [N, 8] <= 0
  hi = x.max(axis=-1)
  dmin = _f16_up(np.max(-lo, axis=-1) / 63, what)                 # [N]
  dmin32 = dmin.astype(np.float32)[:, None]
  m = np.clip(np.ceil(_div(-lo, dmin32)), 0, 63).astype(np.uint8)
  dm = dmin32 * m.astype(np.float32)                              # exact, as gguf computes it
  need = (hi + dm) / levels                                       # [N, 8] step that covers x_j
  d = _f16_up(need.max(axis=-1) / 63, what)
  d32 = d.astype(np.float32)[:, None]
  sc = np.clip(np.ceil(_div(need, d32)), 0, 63).astype(np.uint8)
  step = (d32 * sc.astype(np.float32))[..., None]                 # [N, 8, 1]
  q = np.clip(np.rint(_div(x + dm[..., None], step)), 0, levels).astype(np.uint8)
  return d, dmin, sc, m, q


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
  """f32 [N, 256] -> uint8 [N, 144]."""
  d, dmin, sc, m, q = _quantize_k_asym(x.reshape(-1, 8, 32), 15)
  return np.concatenate(
      [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), _pack_nibbles(q)], axis=-1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
  """f32 [N, 256] -> uint8 [N, 176]; qh[i] bit j = bit 4 of element i of sub-block j."""
  d, dmin, sc, m, q = _quantize_k_asym(x.reshape(-1, 8, 32), 31)
  bits = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]  # [N, 8, 32]
  qh = np.bitwise_or.reduce(bits, axis=-2)                        # [N, 32]
  return np.concatenate(
      [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qh, _pack_nibbles(q & 0x0F)],
      axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
  """f32 [N, 256] -> uint8 [N, 210] (`ql[128], qh[64], int8 sc[16], d`)."""
  n = x.shape[0]
  xs = x.reshape(n, 16, 16)
  need = np.abs(xs).max(axis=-1) / 31                             # [N, 16]
  d = _f16_up(need.max(axis=-1) / 127, "Q6_K")
  d32 = d.astype(np.float32)[:, None]
  sc = np.clip(np.ceil(_div(need, d32)), 0, 127).astype(np.int8)
  step = (d32 * sc.astype(np.float32))[..., None]
  q = (np.clip(np.rint(_div(xs, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
  lo = q & 0x0F                                                   # element 128h + r
  ql = (lo[..., :64] | (lo[..., 64:] << 4)).reshape(n, 128)
  hb = (q >> 4).reshape(n, 2, 4, 32)                              # r = 32k + j
  qh = (hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6))
  return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=-1)


_K_QUANTIZERS = {Q4_K: _quantize_q4_k, Q5_K: _quantize_q5_k, Q6_K: _quantize_q6_k}


def quantize(x: np.ndarray, type_id: int) -> np.ndarray:
  """Quantize float rows into GGUF blocks.

  Args:
    x: float `[..., cols]` (converted to float32), finite.
    type_id: one of `jaxvt.gguf.quants.FORMATS`.
  Returns:
    uint8 `[..., row_bytes(type_id, cols)]`; `gguf.quants.dequantize` of it approximates x (see
    the module docstring for the K-format bounds).
  """
  fmt = get_format(type_id)
  x = np.asarray(x, dtype=np.float32)
  if x.ndim < 1:
    raise JaxvtError("quantize needs an array of shape [..., cols]; pass at least one dimension")
  cols = x.shape[-1]
  nbytes = row_bytes(type_id, cols)
  out_shape = (*x.shape[:-1], nbytes)
  if fmt.type_id == F32:
    return np.ascontiguousarray(x.astype("<f4")).view(np.uint8).reshape(out_shape)
  if fmt.type_id == F16:
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(out_shape)
  if not np.all(np.isfinite(x)):
    raise JaxvtError(f"cannot quantize non-finite values to {fmt.name}; clean NaN/Inf first")
  if fmt.type_id in (BF16, Q4_0, Q4_1, Q8_0):
    out = gguf.quants.quantize(x, gguf.GGMLQuantizationType(fmt.type_id))
    return np.ascontiguousarray(out).reshape(out_shape)
  blocks = x.reshape(-1, fmt.block_elems)
  return _K_QUANTIZERS[fmt.type_id](blocks).reshape(out_shape)


# ---------------------------------------------------------------------------------------------
# Random valid blocks.

def _m2(lo: int, hi: int) -> float:
  """E[k^2] for k uniform on the integers lo..hi."""
  k = np.arange(lo, hi + 1, dtype=np.float64)
  return float(np.mean(k * k))


# Per format: (byte offsets of f16 scale fields, element std per unit of the first scale field),
# with the second field (if any) set to `offset_ratio` x the first to centre values on zero.
# Random q uniform on 0..2^b-1 and 6-bit sc, m uniform on 0..63 (E sc = E m = 31.5):
#   Q4_1: x = d q + m, m = -7.5 d        -> Var = d^2 (E q^2 - 7.5^2)
#   Q4_K: x = d sc q - dmin m, dmin = 7.5 d -> E x = 0, E x^2 = d^2 (E sc^2 E q^2
#         - 2 * 7.5 * 31.5^2 * 7.5 + 7.5^2 E m^2); Q5_K the same with 15.5 and q on 0..31.
#   Q6_K: x = d sc (q - 32), sc uniform int8 -> E x^2 ~ d^2 E sc^2 E (q-32)^2.
def _k_std(mid: float, qmax: int) -> float:
  e_sc2 = _m2(0, 63)
  return float(np.sqrt(e_sc2 * _m2(0, qmax) - 2 * mid * 31.5 * 31.5 * mid + mid * mid * e_sc2))


_RANDOM = {
    Q4_0: ((0,), np.sqrt(_m2(-8, 7)), 0.0),
    Q4_1: ((0, 2), np.sqrt(_m2(0, 15) - 7.5**2), -7.5),
    Q8_0: ((0,), np.sqrt(_m2(-128, 127)), 0.0),
    Q4_K: ((0, 2), _k_std(7.5, 15), 7.5),
    Q5_K: ((0, 2), _k_std(15.5, 31), 15.5),
    Q6_K: ((208,), np.sqrt(_m2(-128, 127) * _m2(-32, 31)), 0.0),
}


def random_blocks(rng: np.random.Generator, type_id: int, shape: tuple[int, ...],
                  scale: float = 0.02) -> np.ndarray:
  """Valid random GGUF blocks for a tensor of logical shape `shape = (..., cols)`.

  Quant bytes (and Q4_K/Q5_K 6-bit sub-scales, Q6_K int8 sub-scales) are uniform random bytes; the
  f16 super-block scales are positive, finite, jittered x U[0.5, 1.5) per block, and chosen so the
  dequantized elements have mean ~0 and standard deviation ~`scale`. Float formats get
  `scale * N(0, 1)`. Cost is dominated by the random bytes (`rng.bit_generator.random_raw`).

  Returns:
    uint8 `[..., row_bytes(type_id, cols)]`.
  """
  fmt = get_format(type_id)
  shape = tuple(int(s) for s in shape)
  if not shape:
    raise JaxvtError("random_blocks needs a shape (..., cols); pass at least one dimension")
  nbytes = row_bytes(type_id, shape[-1])
  if fmt.type_id in (F32, F16, BF16):
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return quantize(x, fmt.type_id)
  out_shape = (*shape[:-1], nbytes)
  total = int(np.prod(out_shape))
  raw = rng.bit_generator.random_raw((total + 7) // 8).view(np.uint8)[:total]
  blocks = raw.reshape(-1, fmt.block_bytes // 2 * 2).view(np.uint16)  # all block sizes are even
  offsets, unit_std, ratio = _RANDOM[fmt.type_id]
  n = blocks.shape[0]
  jitter = rng.uniform(0.5, 1.5, n).astype(np.float32)
  d = (np.float32(scale / (unit_std * np.sqrt(13 / 12))) * jitter).astype("<f2")
  blocks[:, offsets[0] // 2] = d.view(np.uint16)
  if len(offsets) > 1:
    blocks[:, offsets[1] // 2] = (d.astype(np.float32) * np.float32(ratio)).astype("<f2").view(
        np.uint16)
  return raw.reshape(out_shape)
