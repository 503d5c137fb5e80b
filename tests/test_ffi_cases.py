"""Shared fixtures of the FFI kernel tests (test_ffi.py, test_grouped.py, test_prefetch*.py on
CPU; their *_gpu.py files override `device` and `tier` from gpu_cases.py), and the fused decode
steps' kernel / reference pair and in-place check (kernel_and_reference, stack_writes:
test_gdn_step.py, test_attn_step.py); no tests.

Random valid GGUF blocks, QWeight stacks with chosen formats and tiers, and float64 numpy
references built on gguf-py's own dequantizer (independent of jaxvt's code).

Two arithmetic contracts (jaxvt.ffi.numerics): "f32" is x @ dequant(W).T; "ggml" (the default)
first converts x to the weight format's ggml vec-dot type (`quantize_x`: Q8_0 / Q8_1 / Q8_K per
block, or f16 / bf16 rounding; numpy float32 arithmetic, the same roundings as the kernels), so
its reference is quantize_x(x) @ dequant(W).T in float64, plus for Q4_1 ggml's use of
s = f16(d * sum q) in place of the exact d * sum q.

Tolerance of a matrix product: every kernel accumulates in float32, in an order of its own, while
the reference sums exactly in float64. The rounding error of such a float32 sum of n terms whose
partial sums and factored terms are bounded by T is at most about n*eps*T, typically sqrt(n)*eps*T
(eps = 2^-24 = 6e-8). The factored terms are bounded by 3*max|W_r|*|x| per element (|d*q| <= 2
max|w| and |m| <= max|w| for the offset formats), so with T = max_k|W_rk| * sum_k|x_k| we allow
2e-5 * T: ~100x the typical error at n <= 4096, yet ~100x smaller than what one wrong element
(a swapped nibble, a wrong scale) changes, about max|W_r| * |x_k| ~ T / n * (n / 10). In ggml mode
x is replaced by its quantized value on both sides, so the same bound applies.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Callable, Iterator

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import engine
from jaxvt.offload.host_tier import HostTier
from jaxvt.qweight import HOST_BIT, QMeta, QWeight, split_u64

F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30
ALL = [F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K]
NAMES = {f: gguf.GGMLQuantizationType(f).name for f in ALL}
# Byte offsets of the f16 scale fields inside one block (first: d, second: dmin / m).
SCALES = {Q4_0: (0,), Q4_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}
NAN_F16 = np.array([0x7E00], np.uint16).view(np.uint8)  # a quiet-NaN f16 scale


@pytest.fixture(scope="module")
def device():
  return jax.devices("cpu")[0]


@pytest.fixture(scope="module")
def tier(device):
  with HostTier(backend="cpu") as t:
    yield t


@pytest.fixture
def rng(request):
  # zlib.crc32, not hash(): str hashes change with every process (PYTHONHASHSEED), so a failure
  # seen once could not be run again with its data
  return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def put(tree, device):
  return jax.device_put(tree, device)


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
  fmts: tuple[int, ...] = ()
  bufs: dict = dataclasses.field(default_factory=dict)  # host-tier layer -> its HostBuffer

  def ref(self, x: np.ndarray, layer: int, expert: int = 0, mode: str = "ggml"):
    """(reference of x @ W[layer, expert].T under `mode`, tolerance), x [..., cols]."""
    fmt = self.fmts[layer]
    rows = self.mats[layer].shape[1]
    raw = self.raws[layer].reshape(-1, rows, self.raws[layer].shape[-1])[expert]
    return matmul_ref(x, self.mats[layer][expert], fmt if mode in ("ggml", "q8") else None, raw)


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
  bufs = {}
  for l in host:
    buf = bufs[l] = tier.alloc(raws[l].size)
    buf.array[:] = raws[l].reshape(-1)
    table[l] = buf.device_address
    fm[l] |= HOST_BIT
  meta = QMeta(rows=rows, cols=cols, experts=experts, formats=tuple(sorted(set(fmts))),
               n_layers=len(fmts), host_layers=tuple(sorted(host)))
  w = QWeight(jnp.asarray(data), jnp.asarray(split_u64(table)), jnp.asarray(fm), meta)
  mats = [dequant(r, f).reshape(e, rows, cols) for r, f in zip(raws, fmts)]
  return Stack(w, mats, raws, tuple(fmts), bufs)


def _f16(a) -> np.ndarray:
  return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _bf16(a) -> np.ndarray:
  u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
  u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16  # round to nearest even (finite inputs)
  return u.astype(np.uint32).view(np.float32)


def quantize_x(x: np.ndarray, fmt: int) -> tuple[np.ndarray, np.ndarray | None]:
  """x float32 [..., cols] converted to fmt's ggml vec-dot type and back to float64, and for
  Q4_1 the per-block excess s - d*sum(q) (ggml's rounded s) [..., nb]; ggml's recipes, numpy
  float32 arithmetic."""
  x = np.asarray(x, np.float32)
  if fmt == F32:
    return x.astype(np.float64), None
  if fmt in (F16, BF16):
    return (_f16(x) if fmt == F16 else _bf16(x)).astype(np.float64), None
  if fmt in (Q4_K, Q5_K, Q6_K):
    xb = x.reshape(*x.shape[:-1], -1, 256)
    m = np.take_along_axis(xb, np.argmax(np.abs(xb), -1)[..., None], -1)
    with np.errstate(divide="ignore"):
      iscale = np.where(m != 0, np.float32(-127) / m, np.float32(0)).astype(np.float32)
      d = np.where(m != 0, (np.float32(1) / iscale).astype(np.float32), 0).astype(np.float32)
    q = np.minimum(np.rint((iscale * xb).astype(np.float32)), 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape), None
  xb = x.reshape(*x.shape[:-1], -1, 32)
  amax = np.abs(xb).max(-1, keepdims=True)
  d = (amax / np.float32(127)).astype(np.float32)
  with np.errstate(divide="ignore"):
    inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
  q = np.rint((xb * inv).astype(np.float32))
  xq = (q.astype(np.float64) * _f16(d).astype(np.float64)).reshape(x.shape)
  if fmt != Q4_1:
    return xq, None
  exact = (_f16(d).astype(np.float64) * q.sum(-1, keepdims=True))[..., 0]
  s = _f16((d * q.sum(-1, keepdims=True).astype(np.float32)).astype(np.float32))[..., 0]
  return xq, s.astype(np.float64) - exact


def matmul_ref(x: np.ndarray, mat: np.ndarray, fmt: int | None = None,
               raw: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(reference in float64, tolerance) for x [..., cols], mat [rows, cols]: x @ mat.T ("f32"
  contract, fmt None), or with x converted to fmt's vec-dot type ("ggml"; raw [rows, row_bytes]
  supplies Q4_1's m)."""
  x64, excess = (np.asarray(x, np.float64), None) if fmt is None else quantize_x(x, fmt)
  y = x64 @ mat.astype(np.float64).T
  if excess is not None:  # ggml's Q4_1: sum_b m_b * s_b with s rounded to f16
    m = raw.reshape(raw.shape[0], -1, 20)[..., 2:4].copy().view("<f2")[..., 0].astype(np.float64)
    y = y + excess @ m.T
  tol = 2e-5 * np.abs(x64).sum(-1, keepdims=True) * np.abs(mat).max(-1)
  return y, tol + 1e-30


def assert_close(y, ref_tol) -> None:
  ref, tol = ref_tol
  y = np.asarray(y, np.float64)
  assert y.shape == ref.shape, (y.shape, ref.shape)
  excess = np.abs(y - ref) / np.broadcast_to(tol, ref.shape)
  bad = ~(excess <= 1.0)  # NaN counts as bad
  assert not bad.any(), f"{bad.sum()} of {bad.size} outside tolerance (worst {np.nanmax(excess):.3g}x)"


def experts_ref(x: np.ndarray, s: Stack, layer: int, ids: np.ndarray,
                mode: str = "ggml") -> tuple[np.ndarray, np.ndarray]:
  """x [T, cols] or [T, k, cols], ids [T, k] -> ([T, k, rows], tol) for expert stack s. Ids
  above range are clamped into it; a negative id routes its slot nowhere (a row of 0)."""
  T, k = ids.shape
  E, rows = s.mats[layer].shape[:2]
  ys, tols = np.zeros((T, k, rows)), np.zeros((T, k, rows))
  for t in range(T):
    for j in range(k):
      if ids[t, j] < 0:
        tols[t, j] = 1e-30  # exactly 0
        continue
      xv = x[t] if x.ndim == 2 else x[t, j]
      ys[t, j], tols[t, j] = s.ref(xv, layer, int(np.clip(ids[t, j], 0, E - 1)), mode)
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


def kernel_and_reference(device, kernel: Callable, reference: Callable,
                         state: tuple[str, ...]) -> tuple[Callable, Callable]:
  """(the kernel on `device`, the reference on the CPU backend), each jitted and taking numpy
  operands as keywords. The kernel's `state` operands (the stacks it updates in place) are
  donated, as the decode program's cache is."""
  cpu = jax.devices("cpu")[0]
  kern = jax.jit(lambda x, st: kernel(**x, **st), donate_argnums=1)
  ref = jax.jit(lambda x: reference(**x))

  def run_kern(**x):
    st = {k: x.pop(k) for k in state}
    return kern(jax.device_put(x, device), jax.device_put(st, device))

  return run_kern, (lambda **x: ref(jax.device_put(x, cpu)))


def chained_steps(kern: Callable, ref: Callable, first: dict, inputs: Callable[[int], dict],
                  state: tuple[str, ...], n: int = 4) -> Iterator[tuple[int, dict, tuple, tuple]]:
  """(step, the kernel's operands, its results, the reference's results) of `n` decode steps:
  step i's operands from inputs(i), its `state` stacks the kernel's results of the step before
  for the kernel and the reference's for the reference (step 0: first's)."""
  sk = sr = tuple(first[k] for k in state)
  for step in range(n):
    x = inputs(step)
    xk = {**x, **{k: np.asarray(v) for k, v in zip(state, sk)}}
    got = kern(**dict(xk))
    want = ref(**{**x, **dict(zip(state, sr))})
    yield step, xk, got, want
    sk, sr = tuple(got[1:]), tuple(want[1:])


def decode_text(eng, spec, ex, tok: int, pos: int, kv_len: int, compiled: bool = False) -> str:
  """The engine's decode program for one row (token `tok` at position `pos`) over a cache of
  `spec` under the rule `ex`: its lowered text, or with `compiled` the compiled HLO's."""
  args = (jnp.asarray([[tok]], jnp.int32), jnp.asarray([[pos]], jnp.int32))
  low = engine.decode_fn.lower(eng.weights, spec, *args, cfg=eng.cfg, ex=ex, kv_len=kv_len)
  return low.compile().as_text() if compiled else low.as_text()


def prefill_text(eng, spec, ex, T: int) -> str:
  """The lowered text of the engine's prefill program for one row of T tokens."""
  pre = (jnp.zeros((1, T), jnp.int32), jnp.arange(T, dtype=jnp.int32)[None],
         jnp.ones((1, T), bool), jnp.asarray([T - 1], jnp.int32))
  return engine.prefill_fn.lower(eng.weights, spec, *pre, cfg=eng.cfg, ex=ex,
                                 kv_len=T).as_text()


def assert_written_in_place(fused: str, plain: str, target: str, shapes: dict) -> None:
  """The compiled program `fused` calls `target` and writes none of the stacks {name: shape}
  whole (no copy, scatter, dynamic-update-slice or fusion producing one); `plain`, the jnp
  path's, does (so the check sees such writes)."""
  assert fused.count(f'custom_call_target="{target}"') >= 1
  for name, shape in shapes.items():
    assert stack_writes(plain, shape), name  # the check sees the jnp path's writes
    writes = stack_writes(fused, shape)
    assert writes == {}, f"{name}: the fused program writes the whole stack with {writes}"


def stack_writes(text: str, shape) -> dict:
  """{op: count} of the instructions of a compiled HLO `text` whose result is a whole f32 stack
  of `shape`, other than parameter / get-tuple-element / tuple / while (which only pass it on)."""
  want = "f32[" + ",".join(map(str, shape)) + "]{"
  counts = {}
  for line in text.splitlines():
    m = re.match(r"\s*(?:ROOT )?\S+ = (\S+) ([\w-]+)\(", line)
    if m and m.group(1).startswith(want) and m.group(2) not in (
        "parameter", "get-tuple-element", "tuple", "while"):
      counts[m.group(2)] = counts.get(m.group(2), 0) + 1
  return counts


def assert_rel(got, want, what: str, tol: float) -> None:
  """got == want in shape and dtype, and within tol of want's largest magnitude everywhere."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, what
  err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
  assert err <= tol, f"{what}: relative error {err:.2e}"
