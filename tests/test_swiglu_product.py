"""swiglu inside the down products (ops.qmatmul / ops.qmatmul_experts with up=, the custom calls
jaxvt_swiglu_qmatmul_q8, jaxvt_swiglu_experts_q8, jaxvt_swiglu_experts_cached_q8): the product
of swiglu(g, u) formed by the kernel as it reads its input.

On the CPU the kernel's input rows are jaxvt_swiglu's (ggml's vectorized expf), so the fused call
is the swiglu step followed by the plain product, bit for bit; against float64 numpy (gguf's
dequantizers through test_ffi_cases, the swiglu in float64) within the products' rounding. The
decoder with Products.fused_swiglu on gives a dense file's logits unchanged under ggml numerics
and the same program with fewer steps. tests/test_swiglu_product_gpu.py runs these on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import engine as engine_mod, model_fns, synth
from jaxvt.errors import JaxvtError
from jaxvt.ffi import numerics, ops, steps
from jaxvt.ffi.tuning import Products
from jaxvt.model.layers import Exec
from test_ffi_cases import ALL, NAMES, Q4_K, Q6_K, Q8_0, make_stack, matmul_ref, put
from test_ffi_cases import device, rng  # noqa: F401,E402  (the shared fixtures: the CPU)
from test_add_norm import _prompt_logits  # noqa: E402  (a prompt's logits under an Exec)


def unfused(g, u, device):
  """The platform's swiglu step as the model computes it unfused under ggml numerics: on the
  CPU the ggml kernel (jaxvt_swiglu), elsewhere its jnp formula."""
  return steps.swiglu(g, u, kernels=device.platform == "cpu")


def same_as_unfused(got, want, device):
  """The CPU's fused call is the unfused step and product bit for bit; a GPU kernel's expf and
  XLA's exp round some elements an ulp apart, which moves the product by float32 rounding (or,
  where an element's quantized value moves, by one step of it)."""
  got, want = np.asarray(got), np.asarray(want)
  if device.platform == "cpu":
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


def _gu(rng, shape, scale=3.0):
  f = lambda: (rng.standard_normal(shape) * scale).astype(np.float32)
  return f(), f()


def float64_product(g, u, s, layer):
  """swiglu in float64 rounded to float32, then test_ffi_cases.matmul_ref (the activations in
  the format's vec-dot type, gguf's dequantized rows, float64 sums)."""
  h = ((g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))) * u).astype(np.float32)
  fmt = s.fmts[layer]
  return matmul_ref(h, s.mats[layer][0], fmt, s.raws[layer].reshape(s.mats[layer].shape[1], -1))


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: NAMES[f])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_dense_product_is_the_step_then_the_product(device, rng, fmt, batch):
  """qmatmul(g, up=u) is qmatmul(swiglu(g, u)) (the platform's swiglu step; same_as_unfused),
  and within the products' rounding of float64 numpy."""
  rows, cols = 40, 512
  s = make_stack(rng, [fmt, fmt], rows, cols)
  w = put(s.w, device)
  g, u = _gu(rng, (batch, cols))
  gd, ud = put(jnp.asarray(g), device), put(jnp.asarray(u), device)
  fused = jax.jit(lambda g, u, l: ops.qmatmul(g, w, l, "ggml", up=u))
  plain = jax.jit(lambda g, u, l: ops.qmatmul(unfused(g, u, device), w, l, "ggml"))
  for layer in (0, 1):
    got = np.asarray(fused(gd, ud, jnp.int32(layer)))
    same_as_unfused(got, plain(gd, ud, jnp.int32(layer)), device)
    want, _ = float64_product(g, u, s, layer)
    # (an element's swiglu an ulp apart can move its quantized value by one step)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_leading_axes_and_vmap(device, rng):
  """[..., cols] operands keep their leading axes; under vmap (the engine's row axis) with g
  and u batched or u shared, each element is the unbatched call's."""
  s = make_stack(rng, [Q4_K], 24, 256)
  w = put(s.w, device)
  g, u = (jnp.asarray(a) for a in _gu(rng, (2, 3, 256)))
  one = lambda g, u: ops.qmatmul(g, w, 0, "ggml", up=u)
  y = np.asarray(jax.jit(one)(g, u))
  assert y.shape == (2, 3, 24)
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(one))(g, u)), y)
  shared = np.asarray(jax.jit(jax.vmap(one, in_axes=(0, None)))(g, u[0]))
  for i in range(2):
    np.testing.assert_array_equal(shared[i], np.asarray(one(g[i], u[0])))


@pytest.mark.parametrize("per_slot", [True, False])
def test_the_experts_product_is_the_step_then_the_product(device, rng, per_slot):
  """qmatmul_experts(g, up=u) is qmatmul_experts(swiglu(g, u)) (same_as_unfused): rows of g and u one
  per slot ([T, k, cols]: a MoE's down) or one per token ([T, cols]); repeated, out-of-range
  and negative ids (clamped; routed nowhere: zeros)."""
  E, rows, cols, T, k = 6, 32, 512, 3, 4
  s = make_stack(rng, [Q4_K, Q6_K, Q8_0], rows, cols, experts=E)
  w = put(s.w, device)
  ids = jnp.asarray(np.array([[0, 5, 5, 2], [9, 1, -1, 0], [3, 3, 4, 2]], np.int32))
  g, u = (jnp.asarray(a) for a in _gu(rng, (T, k, cols) if per_slot else (T, cols)))
  fused = jax.jit(lambda g, u, l: ops.qmatmul_experts(g, w, l, ids, "ggml", up=u))
  plain = jax.jit(lambda g, u, l: ops.qmatmul_experts(unfused(g, u, device), w, l, ids, "ggml"))
  for layer in range(3):
    got = np.asarray(fused(g, u, jnp.int32(layer)))
    same_as_unfused(got, plain(g, u, jnp.int32(layer)), device)
    assert (got[1, 2] == 0).all() and np.isfinite(got).all()


def test_moe_experts_with_the_fused_down(device, rng):
  """ops.moe_experts(swiglu=True): the routed experts' sum with down's input formed in the down
  call; within float32 rounding of the unfused path (whose silu_mul is numerics.swiglu's jnp
  formula), and on_read sees the gate/up product's output."""
  E, d, f, T, k = 8, 256, 512, 2, 3
  stacks = [make_stack(rng, [Q4_K], f, d, experts=E), make_stack(rng, [Q4_K], f, d, experts=E),
            make_stack(rng, [Q6_K], d, f, experts=E)]
  wg, wu, wd = (put(s.w, device) for s in stacks)
  x = jnp.asarray(rng.standard_normal((T, d)).astype(np.float32))
  ids = jnp.asarray(np.array([[1, 4, 7], [4, 0, 2]], np.int32))
  wts = jnp.asarray(rng.random((T, k)).astype(np.float32))
  seen = {}
  run = lambda sw, on_read=None: ops.moe_experts(x, wg, wu, wd, 0, ids, wts, "ggml",
                                                 on_read=on_read, swiglu=sw)
  on = np.asarray(run(True, seen.__setitem__))
  off = np.asarray(run(False))
  np.testing.assert_allclose(on, off, rtol=0, atol=1e-4 * np.abs(off).max())
  assert seen["gate_up"].shape == (T, k, f) and seen["down"].shape == (T, k, d)


def test_float32_products_are_refused(device, rng):
  s = make_stack(rng, [Q8_0], 8, 64)
  g = np.zeros((1, 64), np.float32)
  with pytest.raises(JaxvtError, match="integer products"):
    ops.qmatmul(g, s.w, 0, "f32", up=g)


def test_mismatched_shapes_are_refused(device, rng):
  s = make_stack(rng, [Q8_0], 8, 64)
  with pytest.raises(JaxvtError, match="differ in shape"):
    ops.qmatmul(np.zeros((2, 64), np.float32), s.w, 0, "ggml", up=np.zeros((1, 64), np.float32))


def test_the_reference_is_the_composition(device, rng):
  """swiglu_qmatmul_ref: numerics.swiglu then qmatmul_ref; the kernel within float32 rounding
  of it (the CPU's swiglu takes ggml's vectorized expf, the reference jnp's)."""
  s = make_stack(rng, [Q4_K], 16, 256)
  w = put(s.w, device)
  g, u = (jnp.asarray(a) for a in _gu(rng, (2, 256)))
  ref = np.asarray(ops.swiglu_qmatmul_ref(g, u, w, 0))
  np.testing.assert_array_equal(ref, np.asarray(ops.qmatmul_ref(numerics.swiglu(g, u), w, 0)))
  got = np.asarray(ops.qmatmul(g, w, 0, "ggml", up=u))
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3 * np.abs(ref).max())


# ---- the decoder with the fused down products ----------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen35moe"])
def tiny(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("swiglu") / f"{request.param}.gguf")
  synth.write_model(path, synth.tiny_config(request.param), "q8_0", seed=23)
  with engine_mod.load(path, max_context=64) as eng:
    yield eng


def _program_targets(eng, ex: Exec, T: int) -> list[str]:
  """The custom-call targets in the StableHLO of a T-token prefill under `ex` (lowered only)."""
  fn = jax.jit(functools.partial(model_fns._forward, cfg=eng.cfg, ex=ex, kv_len=64))
  text = fn.lower(eng.weights, eng.new_cache(1), jnp.zeros((1, T), jnp.int32),
                  jnp.arange(T, dtype=jnp.int32)[None], valid=jnp.ones((1, T), bool),
                  logits_at=jnp.asarray([T - 1], jnp.int32)).as_text()
  return re.findall(r"custom_call @(\w+)", text)


@pytest.mark.parametrize("T", [1, 13])
def test_the_decoder_with_the_fused_down(tiny, T):
  """The same prompt's logits with fused_swiglu on and off under ggml numerics: a dense file's
  are the same bits (its swiglu step is the same ggml kernel either way), a MoE file's within
  float32 rounding (its routed experts' swiglu was the jnp formula); the program holds the
  fused calls and no jaxvt_swiglu (the dense FFN's step) any more."""
  eng = tiny
  ids = np.random.default_rng(2).integers(5, eng.cfg.vocab_size, T).tolist()
  base = dataclasses.replace(eng.ex, numerics="ggml")
  ex_off = dataclasses.replace(base, products=Products(gdn_fused=True))
  ex_on = dataclasses.replace(base, products=Products(gdn_fused=True, fused_swiglu=True))
  on_calls, off_calls = _program_targets(eng, ex_on, T), _program_targets(eng, ex_off, T)
  fused = [c for c in on_calls if c.startswith("jaxvt_swiglu_")]
  assert fused and "jaxvt_swiglu" not in on_calls
  assert not [c for c in off_calls if c.startswith("jaxvt_swiglu_")]
  off, on = _prompt_logits(eng, ex_off, ids), _prompt_logits(eng, ex_on, ids)
  assert np.isfinite(on).all()
  if eng.cfg.arch == "llama":
    np.testing.assert_array_equal(on, off)
  else:
    np.testing.assert_allclose(on, off, atol=2e-3 * np.abs(off).max(), rtol=0)
