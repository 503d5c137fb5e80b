"""The residual add and RMSNorm at a block boundary (jaxvt.ffi.norm.add_norm, csrc/common/norm.h)
on the CPU kernel: against float64 numpy and its jnp reference, ggml's bits where asked, each
row's bits independent of the other rows, the layer clamped into the stacks, bad operands
refused; and the decoder with the fused step (Products.fused_norm) against the decoder without
it on tiny dense and hybrid files. tests/test_add_norm_gpu.py runs the GPU
kernel against this one."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import engine as engine_mod, ffi, model_fns, synth
from jaxvt.errors import JaxvtError
from jaxvt.ffi import norm, steps
from jaxvt.ffi.tuning import Products
from jaxvt.model import decoder
from jaxvt.model.layers import Exec
from test_ffi_cases import device  # noqa: F401  (the shared fixture: the CPU)

pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")

EPS = 1e-6


def operands(T: int, d: int, L: int = 3, seed: int = 0, scale: float = 1.0, K: int = 0):
  """x, y (y [T, K, d] with weights c [T, K] where K), s, g, w, v."""
  rng = np.random.default_rng(seed)
  f = lambda *s: (rng.standard_normal(s) * scale).astype(np.float32)
  o = dict(x=f(T, d), y=f(T, K, d) if K else f(T, d), s=f(T, d), g=f(T) * 3, w=f(L, d) + 1,
           v=f(L, d))
  if K:
    o["c"] = rng.random((T, K)).astype(np.float32)
  return o


def float64(o, layer: int, gated: bool, dotted: bool):
  """add_norm in float64 numpy."""
  x, y, w, v = (o[k].astype(np.float64) for k in "xywv")
  if "c" in o:
    y = np.einsum("tk,tkd->td", o["c"].astype(np.float64), y)
  if gated:
    y = y + o["s"] / (1 + np.exp(-o["g"].astype(np.float64)))[:, None]
  l = min(max(layer, 0), w.shape[0] - 1)
  xo = x + y
  h = xo / np.sqrt(np.mean(xo * xo, axis=-1, keepdims=True) + EPS) * w[l]
  return xo, h, (h @ v[l] if dotted else np.zeros(len(x)))


def run(o, layer, gated, dotted, fn=norm.add_norm, device=None, **kw):
  """fn's (x', h, dot) on `device` (None: the CPU)."""
  extra = dict(s=o["s"], g=o["g"]) if gated else {}
  if dotted:
    extra["v"] = o["v"]
  if "c" in o:
    extra["c"] = o["c"]
  put = lambda a: jax.device_put(a, device or jax.devices("cpu")[0])
  f = jax.jit(lambda x, y, w, layer, ex: fn(x, y, w, layer, eps=EPS, **ex, **kw))
  out = f(put(o["x"]), put(o["y"]), put(o["w"]), put(np.int32(layer)),
          {k: put(v) for k, v in extra.items()})
  return [np.asarray(a) for a in out]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dotted", [False, True])
@pytest.mark.parametrize("T,d,K", [(1, 2048, 0), (3, 576, 0), (17, 100, 0), (2, 4097, 0),
                                   (1, 2048, 8), (5, 576, 1), (3, 100, 3)])
def test_matches_float64_and_the_reference(device, T, d, K, gated, dotted):
  """K: y as K weighted slots (a MoE's routed outputs)."""
  o = operands(T, d, seed=T + d, K=K)
  got = run(o, 1, gated, dotted, device=device)
  ref = run(o, 1, gated, dotted, fn=norm.add_norm_ref, device=device)
  for a, b, want, what in zip(got, ref, float64(o, 1, gated, dotted), ("x'", "h", "dot")):
    tol = 4e-6 * max(1.0, np.abs(want).max()) * (np.sqrt(d) if what == "dot" else 1) * (K or 1)
    np.testing.assert_allclose(a, want, atol=tol, rtol=0, err_msg=what)
    np.testing.assert_allclose(b, want, atol=tol, rtol=0, err_msg=what)


def test_without_a_vector_the_dot_is_zero_and_x_is_exact(device):
  o = operands(4, 300)
  xo, _, dot = run(o, 0, False, False, device=device)
  np.testing.assert_array_equal(xo, o["x"] + o["y"])
  np.testing.assert_array_equal(dot, np.zeros(4, np.float32))


def test_ggml_is_the_ggml_steps_bit_for_bit():
  """ggml: x + y, then ggml's rms_norm (jaxvt.ffi.steps' kernel, llama.cpp's bits); the control:
  the default sums round some rows otherwise."""
  o = operands(64, 576, seed=3, scale=7.0)
  xo, h, _ = run(o, 2, False, False, ggml=True)
  np.testing.assert_array_equal(xo, o["x"] + o["y"])
  want = np.asarray(steps.rms_norm(xo, o["w"][2], EPS))
  np.testing.assert_array_equal(h, want)
  assert not np.array_equal(run(o, 2, False, False)[1], want)


@pytest.mark.parametrize("gated,dotted,K", [(False, False, 0), (True, True, 0), (True, True, 8)])
def test_a_rows_bits_do_not_depend_on_the_other_rows(device, gated, dotted, K):
  """Row 5 alone, among 64 rows and among 333 gives the same bits (each row's sums in norm.h's
  order)."""
  o = operands(333, 2048, seed=9, K=K)
  full = run(o, 1, gated, dotted, device=device)
  for rows in (slice(5, 6), slice(0, 64)):
    part = run({k: (v[rows] if k in ("x", "y", "s", "g", "c") else v) for k, v in o.items()},
               1, gated, dotted, device=device)
    i = 5 - rows.start
    for a, b in zip(part, full):
      np.testing.assert_array_equal(a[i], b[5])


def test_the_layer_is_clamped_into_the_stacks(device):
  o = operands(2, 256)
  for layer, inside in ((-4, 0), (7, 2)):
    for a, b in zip(run(o, layer, True, True, device=device),
                    run(o, inside, True, True, device=device)):
      np.testing.assert_array_equal(a, b)


def test_leading_axes_are_rows():
  o = operands(6, 128)
  x, y = o["x"].reshape(2, 3, 128), o["y"].reshape(2, 3, 128)
  xo, h, dot = norm.add_norm(x, y, o["w"], 1, eps=EPS, v=o["v"])
  assert xo.shape == h.shape == (2, 3, 128) and dot.shape == (2, 3)
  flat = run(o, 1, False, True)
  np.testing.assert_array_equal(np.asarray(h).reshape(6, 128), flat[1])


@pytest.mark.parametrize("bad", [dict(y=np.zeros((3, 8), np.float32)),
                                 dict(w=np.zeros((8,), np.float32)),
                                 dict(s=np.zeros((2, 8), np.float32)),
                                 dict(v=np.zeros((1, 8), np.float32)),
                                 dict(c=np.zeros((2, 3), np.float32)),
                                 dict(y=np.zeros((2, 3, 8), np.float32),
                                      c=np.zeros((2, 2), np.float32)),
                                 dict(layer=jnp.zeros((2,), jnp.int32))])
def test_bad_operands_are_refused(bad):
  args = dict(x=np.zeros((2, 8), np.float32), y=np.zeros((2, 8), np.float32),
              w=np.ones((3, 8), np.float32), layer=0)
  args.update(bad)
  layer = args.pop("layer")
  with pytest.raises(JaxvtError, match="add_norm"):
    norm.add_norm(args.pop("x"), args.pop("y"), args.pop("w"), layer, eps=EPS, **args)


# ---- the decoder with the fused step -----------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen35moe"])
def tiny(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("add_norm") / f"{request.param}.gguf")
  synth.write_model(path, synth.tiny_config(request.param), "q8_0", seed=21)
  with engine_mod.load(path, max_context=64) as eng:
    yield eng


def _program_calls(eng, ex: Exec, T: int) -> int:
  """jaxvt_add_norm calls in the StableHLO of a T-token prefill under `ex` (lowered only)."""
  fn = jax.jit(functools.partial(model_fns._forward, cfg=eng.cfg, ex=ex, kv_len=64))
  text = fn.lower(eng.weights, eng.new_cache(1), jnp.zeros((1, T), jnp.int32),
                  jnp.arange(T, dtype=jnp.int32)[None], valid=jnp.ones((1, T), bool),
                  logits_at=jnp.asarray([T - 1], jnp.int32)).as_text()
  return len(re.findall(r"custom_call @jaxvt_add_norm\b", text))


def _prompt_logits(eng, ex: Exec, ids: list[int]) -> np.ndarray:
  args, kv_len = eng._prefill_args(ids, 0, len(ids))
  logits, _ = model_fns.prefill_fn(eng.weights, eng.new_cache(1), *args, cfg=eng.cfg, ex=ex,
                                   kv_len=kv_len)
  return np.asarray(logits[0])


@pytest.mark.parametrize("numerics", ["f32", "ggml"])
def test_the_decoder_with_the_fused_step(tiny, numerics):
  """The same prompt's logits with fused_norm on and off: within float32 rounding of each other
  (the sums' order differs), and under ggml numerics the same bits on the dense file (no gated
  term: the fused step computes ggml's add and norm) but not on the hybrid one (its shared
  expert's sigmoid and gate dot are the kernel's there)."""
  eng = tiny
  ids = np.random.default_rng(1).integers(5, eng.cfg.vocab_size, 13).tolist()
  base = dataclasses.replace(eng.ex, numerics=numerics)
  ex_off = dataclasses.replace(base, products=Products(gdn_fused=True))
  ex_on = dataclasses.replace(base, products=Products(gdn_fused=True, fused_norm=True))
  # two a layer in the scanned period's body, and the final norm
  assert _program_calls(eng, ex_on, 13) == 2 * len(decoder.layer_period(eng.cfg)) + 1
  assert _program_calls(eng, ex_off, 13) == 0
  off, on = _prompt_logits(eng, ex_off, ids), _prompt_logits(eng, ex_on, ids)
  assert np.isfinite(on).all()
  np.testing.assert_allclose(on, off, atol=2e-3 * np.abs(off).max(), rtol=0)
  if numerics == "ggml" and eng.cfg.arch == "llama":
    np.testing.assert_array_equal(on, off)
