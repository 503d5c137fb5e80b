"""jaxvt's arithmetic contracts in plain jnp: the formulas the `*_ref` ops compute and the kernels
implement (docs/NUMERICS.md).

Three modes (`MODES`):

- "ggml" (default): what llama.cpp's CPU backend computes. Before a product with a weight matrix
  of format F, each activation row is converted to F's ggml vec-dot type (`VEC_TYPE`): Q8_0 for
  Q4_0/Q8_0, Q8_1 for Q4_1, Q8_K for the K formats, F16/BF16 for F16/BF16 weights, nothing for
  F32 (block recipes in jaxvt/ffi/csrc/common/act.h). Quantized blocks are dotted in integers and scaled
  in float32: y = sum_b (d_w * d_x) * isum_b  (+ sum_b m_w * s_x for Q4_1; per 256-block
  d_x*d_w * sum_j sc_j isum_j - d_x*dmin_w * sum_j m_j bsum_j for Q4_K/Q5_K). The CPU kernels
  add in ggml's AVX2 order; this reference adds in XLA's order (same integers, float32 rounding
  apart).
- "f32": dequantize the weights exactly (gguf-py's floats), then an f32 dot product: the model as
  a float framework (transformers) computes it.
- "q8": the products with weight matrices in "ggml"'s arithmetic (the same integers; the GPU
  kernels add the float32 terms per 32-element unit, in their own fixed order), every other step
  of the model in float32 as in "f32". The default on GPUs: integer dots are what make a matvec
  over quantized weights run near the memory's bandwidth there.

Besides the matmul, "ggml" mode fixes the model's other float32 steps as ggml does them
(`rms_norm`, `swiglu`, `rope`, `attention` below; their CPU kernels in
csrc/kernels_cpu_ggml.h reproduce ggml's rounding bit for bit, these jnp formulas up to XLA's
exp/cos/sum rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.gguf import quants as Q
from jaxvt.gguf.quants import dequantize

MODES = ("ggml", "f32", "q8")


def default_mode(platform: str) -> str:
  """The contract jaxvt computes in on a platform: "ggml" on the CPU (its kernels reproduce
  llama.cpp there), "q8" on GPUs (ggml's integer products, float32 elsewhere)."""
  return "ggml" if platform.lower() == "cpu" else "q8"


def integer_products(mode: str) -> bool:
  """Whether products with weight matrices quantize activations and dot in integers."""
  return mode in ("ggml", "q8")
F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = (
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
VEC_TYPE = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q8_0", Q8_0: "Q8_0", Q4_1: "Q8_1",
            Q4_K: "Q8_K", Q5_K: "Q8_K", Q6_K: "Q8_K"}
_HI = jax.lax.Precision.HIGHEST


def act_row_bytes(fmt: int, cols: int) -> int:
  """Bytes of one activation row in the kernels' scratch layout (csrc/common/act.h)."""
  vt = VEC_TYPE[fmt]
  if vt in ("Q8_0", "Q8_1"):
    return cols // 32 * 40
  if vt == "Q8_K":
    return cols // 256 * 292
  return cols * (4 if vt == "F32" else 2)


# ---------------------------------------------------------------------------------------------
# activation quantization


def _split(v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """|v| (finite, nonzero float32) as (m int32 in [2^23, 2^24), e int32): |v| = m * 2^e."""
  bits = jax.lax.bitcast_convert_type(jnp.abs(v), jnp.uint32).astype(jnp.int32)
  field, frac = bits >> 23, bits & 0x7FFFFF
  sub = field == 0  # subnormal: normalise the fraction
  shift = jnp.where(sub, jax.lax.clz(jnp.where(sub, frac, 1)) - 8, 0)
  m = jnp.where(sub, frac << shift, frac | (1 << 23))
  return m, jnp.where(sub, -149 - shift, field - 150)


def exact_div(a, b) -> jax.Array:
  """a / b in float32, correctly rounded (nearest even) on every backend, for finite nonzero a
  and b whose quotient is a normal number; 0 where a or b is 0 and both are finite (the
  quantizers' convention); the backend's a / b otherwise (NaN and infinities as IEEE says).

  XLA:GPU lowers float32 division to PTX div.full.f32 (`-nvptx-prec-divf32=1`: within 2 ulp,
  not correctly rounded), and rewrites a division by a constant into a product with its rounded
  reciprocal; ggml (and jaxvt's kernels) divide in IEEE float32. So the quotient is formed here
  by integer long division of the two 24-bit significands (28 quotient bits, then a sticky bit),
  which every backend computes exactly."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  special = ~(jnp.isfinite(a) & jnp.isfinite(b))
  zero = ((a == 0) | (b == 0)) & ~special  # (a backend that flushes subnormals sees 0 there)
  ma, ea = _split(jnp.where(zero, 1.0, a))
  mb, eb = _split(jnp.where(zero, 1.0, b))
  q = (ma >= mb).astype(jnp.int32)  # ma / mb in (1/2, 2): the integer part is 0 or 1
  r = ma - q * mb
  for _ in range(4):  # 7 quotient bits a step: r < mb < 2^24, so r << 7 < 2^31
    num = r << 7
    d = num // mb
    r = num - d * mb
    q = (q << 7) | d  # q = floor(ma * 2^28 / mb), in [2^27, 2^29)
  sh = jnp.where(q >= (1 << 28), 5, 4)  # keep 24 bits
  mant = q >> sh
  rest = q & ((1 << sh) - 1)
  half = 1 << (sh - 1)
  up = (rest > half) | ((rest == half) & ((r != 0) | ((mant & 1) == 1)))
  mant = mant + up.astype(jnp.int32)
  carry = mant == (1 << 24)  # rounding reached the next power of two
  mant = jnp.where(carry, 1 << 23, mant)
  e2 = sh - 28 + ea - eb + carry.astype(jnp.int32) + 23 + 127  # biased exponent of mant / 2^23
  bits = (e2 << 23) | (mant - (1 << 23))
  neg = (a < 0) != (b < 0)
  bits = jnp.where(neg, bits | jnp.int32(-2**31), bits)
  out = jax.lax.bitcast_convert_type(bits, jnp.float32)
  # NaN / infinite operands, and quotients outside the normal range, keep the backend's division
  # (its special values are IEEE's; the quantizers never divide so)
  plain = special | (e2 < 1) | (e2 > 254)
  return jnp.where(zero, jnp.float32(0), jnp.where(plain, a / jnp.where(zero, 1.0, b), out))


def quantize_q8(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x f32 [..., cols] -> (q int8 [..., nb, 32], d f32 [..., nb] (f16 values), s f32 [..., nb]).

  ggml's quantize_row_q8_1 (s = f16(d * sum q), d before its f16 rounding); Q8_0 drops s.
  """
  xb = x.reshape(*x.shape[:-1], -1, 32)
  amax = jnp.max(jnp.abs(xb), axis=-1)
  d = exact_div(amax, 127)  # 0 where amax is 0
  inv = exact_div(127, amax)
  q = jnp.round(xb * inv[..., None])  # round half to even
  s = round_to(d * jnp.sum(q, axis=-1), jnp.float16)
  return q.astype(jnp.int8), round_to(d, jnp.float16), s


def quantize_q8k(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x f32 [..., cols] -> (q int8 [..., nb, 256], d f32 [..., nb], bsums int32 [..., nb, 16]).

  ggml's quantize_row_q8_K_ref: m = the first element of largest |x|, iscale = -127/m,
  q = min(127, round_half_even(iscale * x)), d = 1/iscale.
  """
  xb = x.reshape(*x.shape[:-1], -1, 256)
  idx = jnp.argmax(jnp.abs(xb), axis=-1)  # first maximum, like ggml's strict '>'
  m = jnp.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
  nz = m != 0
  iscale = exact_div(-127, m)  # (no algebra between the two divisions: integer arithmetic)
  q = jnp.minimum(jnp.round(iscale[..., None] * xb), 127)
  q = jnp.where(nz[..., None], q, 0).astype(jnp.int8)
  d = exact_div(1, iscale)
  bsums = jnp.sum(q.reshape(*q.shape[:-1], 16, 16).astype(jnp.int32), axis=-1)
  return q, d, bsums


def round_to(x: jax.Array, dtype) -> jax.Array:
  """x rounded to `dtype` (bfloat16 or float16; nearest even, float16's subnormals too; float32:
  x), kept in float32. Not `.astype(dtype).astype(float32)`: XLA:GPU, allowed excess precision
  by default, removes that pair of converts (measured on the H200: references 3-6x outside
  their bound)."""
  x = jnp.asarray(x, jnp.float32)
  if jnp.dtype(dtype) == jnp.float32:
    return x
  if jnp.dtype(dtype) == jnp.bfloat16:
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
  if jnp.dtype(dtype) != jnp.float16:
    raise ValueError(f"round_to: bfloat16, float16 or float32, not {dtype}")
  sub = jnp.round(x * 2.0 ** 24) * 2.0 ** -24  # float16's subnormal grid (2^-24 apart)
  return jnp.where(jnp.abs(x) < 2.0 ** -14, sub,
                   jax.lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10))


# ---------------------------------------------------------------------------------------------
# integer views of weight blocks: uint8 [..., nb, block_bytes]


def _idot(a: jax.Array, w: jax.Array) -> jax.Array:
  """a int [L..., nb, k], w int [L..., R, nb, k] -> int32 [L..., R, nb], exactly.

  Computed as a float32 product (XLA's fast path on every platform): k <= 32 products of
  |a| <= 127 and |w| <= 127 (32 x 127 x 127 < 2^24), so every partial sum is an exact integer.
  """
  y = jnp.einsum("...bk,...rbk->...rb", a.astype(jnp.float32), w.astype(jnp.float32),
                 precision=_HI)
  return y.astype(jnp.int32)


def _k_parts(b: jax.Array, five: bool):
  """Q4_K/Q5_K blocks -> (q uint8 [..., nb, 8, 32], sc, mn int32 [..., nb, 8], d, dmin f32)."""
  lead = b.shape[:-1]
  sc, mn = Q._k_scale_min(b[..., 4:16])
  q = Q._nibbles(b[..., (48 if five else 16):].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)
  if five:
    qh = b[..., 16:48][..., None, :]
    q = q | (((qh >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & jnp.uint8(1)) << jnp.uint8(4))
  return (q, sc.astype(jnp.int32), mn.astype(jnp.int32), Q._f16(b[..., 0:2]), Q._f16(b[..., 2:4]))


def _q6_parts(b: jax.Array):
  """Q6_K blocks -> (q int8 [..., nb, 16, 16] (q - 32), sc int32 [..., nb, 16], d f32)."""
  lead = b.shape[:-1]
  ql = b[..., 0:128].reshape(*lead, 2, 64)
  qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
  lo = Q._nibbles(ql).reshape(*lead, 2, 128)
  hi = (((qh >> jnp.array([0, 2, 4, 6], dtype=jnp.uint8)[:, None]) & jnp.uint8(3)) << jnp.uint8(4))
  q = (lo | hi.reshape(*lead, 2, 128)).reshape(*lead, 16, 16).astype(jnp.int8) - jnp.int8(32)
  sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.int32)
  return q, sc, Q._f16(b[..., 208:210])


# ---------------------------------------------------------------------------------------------
# the product


def qdot(x: jax.Array, raw: jax.Array, fmt: int, cols: int, mode: str = "ggml") -> jax.Array:
  """x f32 [L..., cols] times weight rows raw uint8 [L'..., R, row_bytes] (L' broadcastable
  against L) -> f32 [L..., R] under the contract `mode`."""
  x = jnp.asarray(x, jnp.float32)
  if mode == "f32" or fmt == F32:  # ("q8" computes "ggml"'s products)
    wts = dequantize(raw, fmt, cols)
    return jnp.einsum("...k,...rk->...r", x, wts, precision=_HI)
  if fmt in (F16, BF16):
    wts = dequantize(raw, fmt, cols)
    xr = round_to(x, jnp.float16 if fmt == F16 else jnp.bfloat16)
    return jnp.einsum("...k,...rk->...r", xr, wts, precision=_HI)
  fm = Q.get_format(fmt)
  blocks = raw.reshape(*raw.shape[:-1], cols // fm.block_elems, fm.block_bytes)
  if fmt in (Q4_0, Q4_1, Q8_0):
    qa, da, sa = quantize_q8(x)
    dw = Q._f16(blocks[..., 0:2])                                   # [L'..., R, nb]
    if fmt == Q8_0:
      qw = jax.lax.bitcast_convert_type(blocks[..., 2:34], jnp.int8)
    else:
      off = 4 if fmt == Q4_1 else 2
      qw = Q._nibbles(blocks[..., off:off + 16]).reshape(*blocks.shape[:-1], 32).astype(jnp.int8)
      if fmt == Q4_0:
        qw = qw - jnp.int8(8)
    isum = _idot(qa, qw).astype(jnp.float32)                        # [L..., R, nb]
    terms = (dw * da[..., None, :]) * isum
    if fmt == Q4_1:  # one reduction: XLA:CPU (jax 0.10.2) miscompiles a sum of two fused ones
      terms = terms + Q._f16(blocks[..., 2:4]) * sa[..., None, :]
    return jnp.sum(terms, axis=-1)
  qa, da, bs = quantize_q8k(x)                                      # [L..., nb, 256]
  nb = blocks.shape[-2]
  if fmt == Q6_K:
    qw, sc, dw = _q6_parts(blocks)                                  # [L'..., R, nb, 16, 16]
    s = _idot(qa.reshape(*qa.shape[:-2], nb * 16, 16), qw.reshape(*qw.shape[:-3], nb * 16, 16))
    s = s.reshape(*s.shape[:-1], nb, 16)                            # [L..., R, nb, 16]
    sumi = jnp.sum(sc * s, axis=-1).astype(jnp.float32)
    return jnp.sum((da[..., None, :] * dw) * sumi, axis=-1)
  qw, sc, mn, dw, dmin = _k_parts(blocks, fmt == Q5_K)              # [L'..., R, nb, 8, 32]
  s = _idot(qa.reshape(*qa.shape[:-2], nb * 8, 32), qw.reshape(*qw.shape[:-3], nb * 8, 32))
  s = s.reshape(*s.shape[:-1], nb, 8)                               # [L..., R, nb, 8]
  sumi = jnp.sum(sc * s, axis=-1).astype(jnp.float32)
  pairs = bs.reshape(*bs.shape[:-1], 8, 2).sum(-1)                  # [L..., nb, 8]
  summ = jnp.sum(mn * pairs[..., None, :, :], axis=-1).astype(jnp.float32)
  da_ = da[..., None, :]
  return jnp.sum((da_ * dw) * sumi + (-da_ * dmin) * summ, axis=-1)  # one reduction (see above)


# ---------------------------------------------------------------------------------------------
# the model's other steps in ggml mode


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
  """(x * (1 / sqrt(mean(x*x) + eps))) * w over the last axis (ggml's order of roundings)."""
  x = jnp.asarray(x, jnp.float32)
  mean = jnp.sum(x * x, axis=-1, keepdims=True) / jnp.float32(x.shape[-1])
  y = x * (jnp.float32(1) / jnp.sqrt(mean + jnp.float32(eps)))
  return y if w is None else y * w


def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
  """(g / (1 + exp(0 - g))) * u (ggml's silu, then the product)."""
  g = jnp.asarray(g, jnp.float32)
  return (g / (jnp.float32(1) + jnp.exp(jnp.float32(0) - g))) * u


def theta_scale(base: float, n_dims: int) -> np.float32:
  """powf(base, -2.0f / n_dims) as ggml computes it: the float32 exponent, the power correctly
  rounded to float32 (glibc's powf). Computed as a float64 power rounded once, not with numpy's
  float32 `np.power`, whose SIMD version on AVX-512 CPUs is up to an ulp off (10000^-1/32 came
  out 0.74989426 instead of 0.7498942, which moves theta by 2e-4 rad at position 4095)."""
  e = float(np.float32(-2.0) / np.float32(n_dims))
  return np.float32(float(np.float32(base)) ** e)


def rope(x: jax.Array, positions: jax.Array, n_dims: int, base: float, neox: bool) -> jax.Array:
  """ggml_rope_ext (NORMAL: adjacent pairs; NEOX: halves) on the first n_dims of each head.

  x f32 [..., T, H, hd], positions int32 [..., T]. theta_i = pos * ts^i by repeated float32
  multiplication (ggml's cache), then cos/sin and the rotation.
  """
  p = positions.astype(jnp.float32)
  # an opaque multiplier: XLA would otherwise fold the chain (p * ts) * ts ... into p * ts^i
  ts = jnp.where(jnp.isnan(p), jnp.float32(1), jnp.float32(theta_scale(base, n_dims)))
  th = [p]
  for _ in range(n_dims // 2 - 1):
    th.append(th[-1] * ts)
  theta = jnp.stack(th, axis=-1)[..., None, :]  # [..., T, 1, n_dims/2]
  c, s = jnp.cos(theta), jnp.sin(theta)
  xr, rest = x[..., :n_dims], x[..., n_dims:]
  if neox:
    x0, x1 = xr[..., :n_dims // 2], xr[..., n_dims // 2:]
    y = jnp.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
  else:
    x0, x1 = xr[..., 0::2], xr[..., 1::2]
    y = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(xr.shape)
  return jnp.concatenate([y, rest], axis=-1) if rest.shape[-1] else y


def attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
              scale: float) -> jax.Array:
  """softmax(scale * q.k + causal mask) v as ggml's non-flash path rounds it.

  q f32 [b, t, H, D]; k [b, S, K, D], v [b, S, K, Dv] in the cache dtype; positions [b, t].
  q and the probabilities are rounded to the cache dtype (ggml converts the second operand of a
  product with an f16 cache to f16); scores, softmax and sums are float32.
  -> f32 [b, t, H, Dv].
  """
  b, t, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  cd = k.dtype
  qg = round_to(q, cd).reshape(b, t, K, H // K, D)
  sc = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32), precision=_HI)
  w = sc * jnp.float32(scale)
  visible = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [b, t, S]
  w = jnp.where(visible[:, None, None], w, -jnp.inf)
  e = jnp.exp(w - jnp.max(w, axis=-1, keepdims=True))
  p = e * (jnp.float32(1) / jnp.sum(e, axis=-1, keepdims=True))
  p = round_to(p, cd)
  o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32), precision=_HI)
  return o.reshape(b, t, H, v.shape[-1])
