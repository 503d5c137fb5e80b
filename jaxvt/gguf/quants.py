"""GGUF block formats and their dequantization in pure JAX.

Weights stay in memory as the raw GGUF blocks (uint8) and are expanded to float32 inside jitted
code. A row of `cols` elements is `cols // block_elems` consecutive blocks of `block_bytes` bytes;
`dequantize(raw [..., row_bytes], type_id, cols) -> f32 [..., cols]` works on any leading batch
dims (rows, layers, experts).

Layouts (little-endian f16 scales; `gguf.quants` is the reference we match):

- F32 / F16 / BF16: one element per "block" of 4 / 2 / 2 bytes.
- Q4_0 (32 el, 18 B): `d f16, qs[16]`; x = d * (q - 8); low nibbles are elements 0-15, high 16-31.
- Q4_1 (32 el, 20 B): `d f16, m f16, qs[16]`; x = d * q + m.
- Q8_0 (32 el, 34 B): `d f16, int8 q[32]`; x = q * d.
- Q4_K (256 el, 144 B): `d, dmin f16, scales[12], qs[128]`; 8 sub-blocks of 32 with 6-bit
  scale sc and min m; x = (d*sc) * q - (dmin*m). Sub-block 2g uses the low nibbles of
  qs[32g:32g+32], sub-block 2g+1 their high nibbles.
- Q5_K (256 el, 176 B): `d, dmin, scales[12], qh[32], qs[128]`; as Q4_K with a fifth bit: bit j of
  qh[i] is bit 4 of element i of sub-block j.
- Q6_K (256 el, 210 B): `ql[128], qh[64], int8 scales[16], d f16`; 16 sub-blocks of 16;
  x = (d*sc) * (q - 32) with q 6 bits.

Exactness: every product formed here is exact in float32 (f16 significand 11 bits x 6-bit scale x
4/5-bit quant <= 22 bits; Q6_K 11 + 7 + 5 = 23 bits; Q8_0 11 + 7), so the only rounding is the
final `+ m` / `- dmin*m`. The result is therefore bit-identical to `gguf.quants.dequantize` in any
association order and with or without FMA contraction.

Memory: nibble and bit extraction stay in uint8 (same element count as the output); the single
convert to float32 is fused by XLA with the scale multiply, so no int32 intermediates exist.
"""

from __future__ import annotations

from typing import Callable

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.errors import JaxvtError
from jaxvt.gguf import formats
from jaxvt.gguf.formats import (BF16, F16, F32, FORMATS, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0,
                                QuantFormat)

_T = gguf.GGMLQuantizationType


def format_name(type_id: int) -> str:
  """Name of a ggml type id (`"Q4_K"`), also for types jaxvt does not support; never raises."""
  if int(type_id) in FORMATS:
    return FORMATS[int(type_id)].name
  try:
    return _T(int(type_id)).name
  except ValueError:
    return f"ggml type {int(type_id)}"


def get_format(type_id: int) -> QuantFormat:
  """The `QuantFormat` of a supported type id; JaxvtError otherwise."""
  return formats.get_format(type_id, format_name(type_id))


def row_bytes(type_id: int, cols: int) -> int:
  """Bytes of one row of `cols` elements in format `type_id` (jaxvt.gguf.formats.row_bytes, with
  ggml's names for unsupported types in the message)."""
  return formats.row_bytes(type_id, cols, format_name(type_id))


# ---------------------------------------------------------------------------------------------
# Helpers on blocks: uint8 [..., nb, block_bytes].

_U8 = jnp.uint8


def _f16(b: jax.Array) -> jax.Array:
  """uint8 [..., 2] (little-endian f16) -> f32 [...]."""
  return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
  """uint8 [..., n] -> uint8 [..., 2, n]: low nibbles, then high nibbles."""
  return jnp.stack([qs & _U8(0x0F), qs >> _U8(4)], axis=-2)


def _k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Q4_K/Q5_K packed scales uint8 [..., 12] -> (sc, m) f32 [..., 8] (6-bit each).

  Bytes 0-3: sc[0:4] | (sc[4:8] bits 4-5) << 6; bytes 4-7 the same for m;
  bytes 8-11: sc[4:8] low 4 bits | m[4:8] low 4 bits << 4.
  """
  d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
  sc = jnp.concatenate([d & _U8(0x3F), (md & _U8(0x0F)) | ((d >> _U8(2)) & _U8(0x30))], axis=-1)
  mn = jnp.concatenate([m & _U8(0x3F), (md >> _U8(4)) | ((m >> _U8(2)) & _U8(0x30))], axis=-1)
  return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _deq_f32(b: jax.Array) -> jax.Array:
  """uint8 [..., n, 4] -> f32 [..., n, 1]."""
  return jax.lax.bitcast_convert_type(b, jnp.float32)[..., None]


def _deq_f16(b: jax.Array) -> jax.Array:
  """uint8 [..., n, 2] -> f32 [..., n, 1]."""
  return _f16(b)[..., None]


def _deq_bf16(b: jax.Array) -> jax.Array:
  """uint8 [..., n, 2] -> f32 [..., n, 1]: the bf16 bits become the high half of an f32."""
  u = jax.lax.bitcast_convert_type(b, jnp.uint16).astype(jnp.uint32) << jnp.uint32(16)
  return jax.lax.bitcast_convert_type(u, jnp.float32)[..., None]


def _deq_q4_0(b: jax.Array) -> jax.Array:
  """uint8 [..., nb, 18] -> f32 [..., nb, 32]."""
  d = _f16(b[..., 0:2])[..., None]
  q = _nibbles(b[..., 2:18]).reshape(*b.shape[:-1], 32)
  return d * (q.astype(jnp.float32) - 8.0)


def _deq_q4_1(b: jax.Array) -> jax.Array:
  """uint8 [..., nb, 20] -> f32 [..., nb, 32]."""
  d = _f16(b[..., 0:2])[..., None]
  m = _f16(b[..., 2:4])[..., None]
  q = _nibbles(b[..., 4:20]).reshape(*b.shape[:-1], 32)
  return d * q.astype(jnp.float32) + m


def _deq_q8_0(b: jax.Array) -> jax.Array:
  """uint8 [..., nb, 34] -> f32 [..., nb, 32]."""
  d = _f16(b[..., 0:2])[..., None]
  q = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8)
  return q.astype(jnp.float32) * d


def _deq_q4_k(b: jax.Array) -> jax.Array:
  """uint8 [..., nb, 144] -> f32 [..., nb, 256]."""
  lead = b.shape[:-1]
  d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
  sc, mn = _k_scale_min(b[..., 4:16])
  dsc = (d * sc)[..., None]                                      # [..., nb, 8, 1]
  dm = (dmin * mn)[..., None]
  qs = b[..., 16:144].reshape(*lead, 4, 32)
  q = _nibbles(qs).reshape(*lead, 8, 32)                         # sub-block 2g+h
  return (dsc * q.astype(jnp.float32) - dm).reshape(*lead, 256)


def _deq_q5_k(b: jax.Array) -> jax.Array:
  """uint8 [..., nb, 176] -> f32 [..., nb, 256]."""
  lead = b.shape[:-1]
  d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
  sc, mn = _k_scale_min(b[..., 4:16])
  dsc = (d * sc)[..., None]
  dm = (dmin * mn)[..., None]
  qh = b[..., 16:48][..., None, :]                               # [..., nb, 1, 32]
  shifts = jnp.arange(8, dtype=_U8)[:, None]                     # [8, 1]
  hi = ((qh >> shifts) & _U8(1)) << _U8(4)                       # [..., nb, 8, 32]
  lo = _nibbles(b[..., 48:176].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)
  q = lo | hi
  return (dsc * q.astype(jnp.float32) - dm).reshape(*lead, 256)


def _deq_q6_k(b: jax.Array) -> jax.Array:
  """uint8 [..., nb, 210] -> f32 [..., nb, 256].

  Element e = 128h + r: low 4 bits from nibble r // 64 of ql[64h + r % 64], high 2 bits from
  bits 2(r // 32) of qh[32h + r % 32]; scale index e // 16.
  """
  lead = b.shape[:-1]
  ql = b[..., 0:128].reshape(*lead, 2, 64)
  qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
  sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
  d = _f16(b[..., 208:210])[..., None]
  lo = _nibbles(ql).reshape(*lead, 2, 128)
  shifts = jnp.array([0, 2, 4, 6], dtype=_U8)[:, None]           # [4, 1]
  hi = (((qh >> shifts) & _U8(3)) << _U8(4)).reshape(*lead, 2, 128)
  q = (lo | hi).reshape(*lead, 16, 16).astype(jnp.float32) - 32.0
  return ((d * sc)[..., None] * q).reshape(*lead, 256)


_DEQUANT: dict[int, Callable[[jax.Array], jax.Array]] = {
    F32: _deq_f32, F16: _deq_f16, BF16: _deq_bf16, Q4_0: _deq_q4_0, Q4_1: _deq_q4_1,
    Q8_0: _deq_q8_0, Q4_K: _deq_q4_k, Q5_K: _deq_q5_k, Q6_K: _deq_q6_k,
}


def dequantize_blocks(blocks: jax.Array, type_id: int) -> jax.Array:
  """uint8 [..., block_bytes] blocks -> f32 [..., block_elems]. `type_id` is static."""
  fmt = get_format(type_id)
  if blocks.dtype != jnp.uint8 or blocks.ndim < 1 or blocks.shape[-1] != fmt.block_bytes:
    raise JaxvtError(
        f"{fmt.name} blocks must be uint8 [..., {fmt.block_bytes}], got {blocks.dtype} "
        f"{tuple(blocks.shape)}; pass the raw tensor bytes")
  return _DEQUANT[fmt.type_id](blocks[..., None, :])[..., 0, :]


def dequantize(raw: jax.Array | np.ndarray, type_id: int, cols: int) -> jax.Array:
  """Expand raw GGUF rows to float32.

  Args:
    raw: uint8 `[..., row_bytes(type_id, cols)]`, any leading dims (a jax or numpy array).
    type_id: ggml type id (static: dispatch happens at trace time).
    cols: elements per row (static).
  Returns:
    float32 `[..., cols]`, equal to `gguf.quants.dequantize` bit for bit.
  """
  fmt = get_format(type_id)
  nbytes = row_bytes(type_id, cols)
  raw = jnp.asarray(raw)
  if raw.dtype != jnp.uint8 or raw.ndim < 1 or raw.shape[-1] != nbytes:
    raise JaxvtError(
        f"{fmt.name} data for rows of {cols} elements must be uint8 [..., {nbytes}], got "
        f"{raw.dtype} {tuple(raw.shape)}; pass the tensor's raw bytes with the right column count")
  lead = raw.shape[:-1]
  nb = cols // fmt.block_elems
  blocks = raw.reshape(*lead, nb, fmt.block_bytes)
  return _DEQUANT[fmt.type_id](blocks).reshape(*lead, cols)
