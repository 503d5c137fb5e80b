"""MoE FFN against a float64 numpy reference built from synthetic GGUF files (dequantized by
gguf-py): router softmax / top-k / renormalisation, routed SwiGLU experts in several formats (both
paths of the jnp reference: gathered experts for few tokens, one pass per expert for many), and
the sigmoid-gated shared expert.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt.ffi import backend
from jaxvt.model import moe
from jaxvt.ffi.tuning import Products
from jaxvt.model.layers import Exec
from test_qwen_fixtures import device_weights, kernel_modes, np_tensors, synth_file


def _silu(x):
  return x / (1 + np.exp(-x))


def np_moe(x, W, layer, cfg):
  """x [T, d] float64 -> [T, d], the qwen3moe / qwen35moe FFN as llama.cpp builds it."""
  p = f"blk.{layer}."
  logits = x @ W[p + "ffn_gate_inp.weight"].T
  prob = np.exp(logits - logits.max(-1, keepdims=True))
  prob /= prob.sum(-1, keepdims=True)
  ids = np.argsort(-prob, axis=-1, kind="stable")[:, :cfg.n_experts_used]
  wts = np.take_along_axis(prob, ids, -1)
  if cfg.norm_topk_prob:
    wts = wts / wts.sum(-1, keepdims=True)
  G, U, D = (W[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for e, wt in zip(ids[t], wts[t]):
      y[t] += wt * (D[e] @ (_silu(G[e] @ x[t]) * (U[e] @ x[t])))
  if cfg.shared_ffn_dim:
    s = W[p + "ffn_down_shexp.weight"] @ (
        _silu(W[p + "ffn_gate_shexp.weight"] @ x.T) * (W[p + "ffn_up_shexp.weight"] @ x.T))
    gate = 1 / (1 + np.exp(-(x @ W[p + "ffn_gate_inp_shexp.weight"])))
    y += gate[:, None] * s.T
  return y


_FILES = {
    # (arch, recipe, overrides): tiny rows fall back to Q8_0 for K recipes (64 % 256 != 0)
    "qwen3moe-mixed": ("qwen3moe", "mixed", {}),
    "qwen35moe-mixed": ("qwen35moe", "mixed", {}),
    "qwen35moe-q4_k_m-256": ("qwen35moe", "q4_k_m",
                             dict(d_model=256, expert_ffn_dim=256, shared_ffn_dim=256)),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("moe")
  out = {}
  for key, (arch, recipe, over) in _FILES.items():
    cfg, path = synth_file(d, arch, recipe, seed=4, **over)
    out[key] = (cfg, device_weights(path, cfg), np_tensors(path))
  return out


def _ffn_out(terms):
  """The FFN's output from moe_block's terms (which the decoder adds with the residual)."""
  return terms.total()


@functools.cache
def _jit_moe(cfg, ex=Exec(kernels=False, numerics="f32")):
  return jax.jit(lambda h, w, li: _ffn_out(moe.moe_block(h, w, li, cfg=cfg, ex=ex)[0]))


@pytest.mark.parametrize("ex", kernel_modes())
@pytest.mark.parametrize("key", list(_FILES))
@pytest.mark.parametrize("t", [3, 16])  # T*k <= E: gathered experts; else one pass per expert
def test_moe_block_matches_float64(files, key, t, ex):
  cfg, w, W = files[key]
  rng = np.random.default_rng(t)
  h = rng.standard_normal((1, t, cfg.d_model))
  li = 2
  got = np.asarray(_jit_moe(cfg, ex)(jnp.asarray(h, jnp.float32), w, jnp.int32(li)), np.float64)
  want = np_moe(h[0], W, li, cfg)[None]
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


def test_moe_block_grouped_matches_float64(files):
  """The routed experts on the grouped kernel (Exec.products: GPU prefill's path, run here on the
  CPU kernel): bf16 weights and activations, so within 2^-7 of the float64 block's scale."""
  from jaxvt import ffi
  if not ffi.available("cpu"):
    pytest.skip("jaxvt extension not built")
  ex = Exec(kernels=True, numerics="f32", products=Products(grouped_slots=1))
  for key in _FILES:
    cfg, w, W = files[key]
    h = np.random.default_rng(7).standard_normal((1, 16, cfg.d_model))
    got = np.asarray(_jit_moe(cfg, ex)(jnp.asarray(h, jnp.float32), w, jnp.int32(1)), np.float64)
    want = np_moe(h[0], W, 1, cfg)[None]
    np.testing.assert_allclose(got, want, atol=2.0 ** -7 * np.abs(want).max(), rtol=0)
    assert not np.allclose(got, want, atol=1e-6 * np.abs(want).max(), rtol=0)  # it is bf16


def test_moe_without_renormalisation(files):
  cfg, w, W = files["qwen3moe-mixed"]
  cfg = dataclasses.replace(cfg, norm_topk_prob=False)
  h = np.random.default_rng(0).standard_normal((2, 3, cfg.d_model))
  got = np.asarray(_jit_moe(cfg)(jnp.asarray(h, jnp.float32), w, jnp.int32(1)), np.float64)
  want = np_moe(h.reshape(6, -1), W, 1, cfg).reshape(h.shape)
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


def test_route():
  logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
  ids, wts = moe.route(logits, 2, True, Exec())
  assert ids.tolist() == [[1, 2], [0, 3]]
  p = np.exp([[2.0, 1.0], [3.0, 2.5]])
  np.testing.assert_allclose(wts, p / p.sum(-1, keepdims=True), rtol=1e-6)
  _, raw = moe.route(logits, 2, False, Exec())
  full = np.exp(np.asarray(logits))
  np.testing.assert_allclose(raw, np.take_along_axis(full / full.sum(-1, keepdims=True),
                                                     np.asarray(ids), -1), rtol=1e-6)


def test_expert_paths_agree(files):
  """ops.moe_experts_ref (gathered), backend.experts_per_expert_ref and, where built, the
  ops.moe_experts kernel compute the same routed-expert sum."""
  from jaxvt import ffi
  from jaxvt.ffi import ops
  cfg, w, _ = files["qwen35moe-q4_k_m-256"]
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((5, cfg.d_model)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, cfg.n_experts, (5, 2)), jnp.int32)
  wts = jnp.asarray(rng.uniform(0, 1, (5, 2)), jnp.float32)
  args = (x, w["moe.w_gate"], w["moe.w_up"], w["moe.w_down"], jnp.int32(3), ids, wts)
  for mode in ("f32", "ggml"):
    a = np.asarray(ops.moe_experts_ref(*args, mode=mode))
    # ggml mode re-quantizes the SwiGLU output before the down product, so a float32 rounding
    # difference upstream can move one int8 step of one block: 1e-3 of the scale, not 1e-5.
    tol = (1e-5 if mode == "f32" else 1e-3) * np.abs(a).max()
    np.testing.assert_allclose(backend.experts_per_expert_ref(*args, mode=mode), a, atol=tol)
    if ffi.available("cpu"):
      np.testing.assert_allclose(ops.moe_experts(*args, mode=mode), a, atol=tol)
