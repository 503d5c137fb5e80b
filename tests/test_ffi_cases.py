"""Shared fixtures of the FFI kernel tests (test_ffi.py on CPU, test_ffi_gpu.py on GPU); no tests.

Random valid GGUF blocks, QWeight stacks with chosen formats and tiers, and float64 numpy
references built on gguf-py's own dequantizer (independent of jaxvt's code).

Tolerance of a matrix product: every kernel accumulates in float32, in an order of its own (per
32-element unit, with each unit's scale factored out: d*sum(q*x) - m*sum(x)), while the reference
sums exactly in float64. The rounding error of such a float32 sum of n terms whose partial sums
and factored terms are bounded by T is at most about n*eps*T, typically sqrt(n)*eps*T
(eps = 2^-24 = 6e-8). The factored terms are bounded by 3*max|W_r|*|x| per element (|d*q| <= 2
max|w| and |m| <= max|w| for the offset formats), so with T = max_k|W_rk| * sum_k|x_k| we allow
2e-5 * T: ~100x the typical error at n <= 4096, yet ~100x smaller than what one wrong element
(a swapped nibble, a wrong scale) changes, about max|W_r| * |x_k| ~ T / n * (n / 10).
"""

from __future__ import annotations

import dataclasses

import gguf
import jax.numpy as jnp
import numpy as np

from jaxvt.qweight import HOST_BIT, QMeta, QWeight, split_u64

F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30
ALL = [F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K]
NAMES = {f: gguf.GGMLQuantizationType(f).name for f in ALL}
# Byte offsets of the f16 scale fields inside one block (first: d, second: dmin / m).
SCALES = {Q4_0: (0,), Q4_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}
NAN_F16 = np.array([0x7E00], np.uint16).view(np.uint8)  # a quiet-NaN f16 scale


def row_bytes(fmt: int, cols: int) -> int:
  be, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt)]
  return cols // be * bb


def random_blocks(rng: np.random.Generator, fmt: int, nrows: int, cols: int) -> np.ndarray:
  """uint8 [nrows, row_bytes]: valid random rows (random quants, sane finite f16 scales)."""
  if fmt in (F32, F16, BF16):
    x = (rng.standard_normal((nrows, cols)) * 0.05).astype(np.float32)
    if fmt == F32:
      return x.view(np.uint8).reshape(nrows, -1)
    if fmt == F16:
      return x.astype(np.float16).view(np.uint8).reshape(nrows, -1)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(nrows, -1)
  be, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt)]
  nb = nrows * cols // be
  raw = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
  for i, off in enumerate(SCALES[fmt]):
    sign = 1.0 if i else rng.choice([-1.0, 1.0], nb)  # d of any sign, dmin / m positive
    v = (sign * rng.uniform(0.5, 1.5, nb) * (0.004 if i == 0 else 0.02)).astype("<f2")
    raw[:, off:off + 2] = v.view(np.uint8).reshape(nb, 2)
  return raw.reshape(nrows, -1)


def dequant(raw: np.ndarray, fmt: int) -> np.ndarray:
  """gguf-py's numpy dequantizer: uint8 [..., row_bytes] -> float32 [..., cols]."""
  with np.errstate(all="ignore"):
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(fmt)), np.float32)


@dataclasses.dataclass
class Stack:
  """A QWeight plus the numpy truth of each layer (float32 [E or 1, rows, cols])."""
  w: QWeight
  mats: list[np.ndarray]
  raws: list[np.ndarray]  # uint8 [E*rows, row_bytes] per layer


def make_stack(rng, fmts: list[int], rows: int, cols: int, experts: int = 0,
               host: tuple[int, ...] = (), tier=None, raws: list[np.ndarray] | None = None,
               pad: int = 3) -> Stack:
  """Layers l with formats fmts[l]; layers in `host` go to HostTier `tier` (by address).

  Device-tier layers are packed into data [n, stride] with `pad` spare bytes so that slots start
  at unaligned offsets (kernels must not assume alignment).
  """
  e = max(experts, 1)
  raws = raws or [random_blocks(rng, f, e * rows, cols) for f in fmts]
  dev = [l for l in range(len(fmts)) if l not in host]
  stride = max([raws[l].size for l in dev], default=1) + (pad if dev else 0)
  data = np.zeros((max(len(dev), 1), stride), np.uint8)
  table = np.zeros(len(fmts), np.uint64)
  fm = np.array(fmts, np.int32)
  for slot, l in enumerate(dev):
    data[slot, :raws[l].size] = raws[l].reshape(-1)
    table[l] = slot
  for l in host:
    buf = tier.alloc(raws[l].size)
    buf.array[:] = raws[l].reshape(-1)
    table[l] = buf.device_address
    fm[l] |= HOST_BIT
  meta = QMeta(rows=rows, cols=cols, experts=experts, formats=tuple(sorted(set(fmts))),
               n_layers=len(fmts), host_layers=tuple(sorted(host)))
  w = QWeight(jnp.asarray(data), jnp.asarray(split_u64(table)), jnp.asarray(fm), meta)
  mats = [dequant(r, f).reshape(e, rows, cols) for r, f in zip(raws, fmts)]
  return Stack(w, mats, raws)


def matmul_ref(x: np.ndarray, mat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(x @ mat.T in float64, tolerance) for x [..., cols], mat [rows, cols]."""
  x64 = np.asarray(x, np.float64)
  y = x64 @ mat.astype(np.float64).T
  tol = 2e-5 * np.abs(x64).sum(-1, keepdims=True) * np.abs(mat).max(-1)
  return y, tol + 1e-30


def assert_close(y, ref_tol) -> None:
  ref, tol = ref_tol
  y = np.asarray(y, np.float64)
  assert y.shape == ref.shape, (y.shape, ref.shape)
  excess = np.abs(y - ref) / np.broadcast_to(tol, ref.shape)
  bad = ~(excess <= 1.0)  # NaN counts as bad
  assert not bad.any(), f"{bad.sum()} of {bad.size} outside tolerance (worst {np.nanmax(excess):.3g}x)"


def experts_ref(x: np.ndarray, mats: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """x [T, cols] or [T, k, cols], mats [E, rows, cols], ids [T, k] -> ([T, k, rows], tol)."""
  T, k = ids.shape
  ys, tols = np.zeros((T, k, mats.shape[1])), np.zeros((T, k, mats.shape[1]))
  for t in range(T):
    for j in range(k):
      xv = x[t] if x.ndim == 2 else x[t, j]
      ys[t, j], tols[t, j] = matmul_ref(xv, mats[np.clip(ids[t, j], 0, mats.shape[0] - 1)])
  return ys, tols


def poison_experts(raw: np.ndarray, fmt: int, experts: int, keep: set[int]) -> np.ndarray:
  """raw [E*rows, rb] with every block of the experts not in `keep` given NaN scales."""
  out = raw.copy().reshape(experts, -1)
  be, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt)]
  for e in range(experts):
    if e in keep:
      continue
    if fmt in SCALES:
      blocks = out[e].reshape(-1, bb)
      for off in SCALES[fmt]:
        blocks[:, off:off + 2] = NAN_F16
    else:  # float formats: all-ones bytes are NaN in f32, f16 and bf16
      out[e] = 0xFF
  return out.reshape(raw.shape)
