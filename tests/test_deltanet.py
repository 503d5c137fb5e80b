"""Gated DeltaNet: chunked (prefill) == recurrent (decode) == a float64 per-token loop, and the whole
block (conv, gates, head order, gated norm, padding) against a float64 numpy reference built from a
synthetic GGUF file dequantized by gguf-py. The transformers torch rules are compared live
(`reference` marker) and through tests/reference/gdn_rules.npz recorded with them.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxvt.model import deltanet
from jaxvt.model.layers import Exec
from test_qwen_fixtures import device_weights, kernel_modes, np_tensors, synth_file

HERE = os.path.dirname(__file__)
RULES_NPZ = os.path.join(HERE, "reference", "gdn_rules.npz")


# ---------------------------------------------------------------------------------------------
# float64 references

def np_rule(q, k, v, g, beta, S):
  """The gated delta rule token by token in float64 (jaxvt.model.deltanet's docstring)."""
  q, k, v, g, beta, S = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, S))
  o = np.zeros(v.shape)
  S = S.copy()
  for i in range(q.shape[1]):
    S = S * np.exp(g[:, i])[..., None, None]
    delta = beta[:, i][..., None] * (v[:, i] - np.einsum("bhkv,bhk->bhv", S, k[:, i]))
    S = S + k[:, i][..., :, None] * delta[..., None, :]
    o[:, i] = np.einsum("bhkv,bhk->bhv", S, q[:, i])
  return o, S


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _silu(x):
  return x * _sigmoid(x)


def np_block(h, W, layer, cfg, conv_state, S, n_valid=None):
  """One DeltaNet mixer in float64 from GGUF tensors (as llama.cpp's qwen35moe graph computes it)."""
  p = f"blk.{layer}."
  b, t, _ = h.shape
  n_valid = np.full(b, t) if n_valid is None else np.asarray(n_valid)
  nk, nv, dk, dv = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_k_dim, cfg.ssm_v_dim
  mixed = h @ W[p + "attn_qkv.weight"].T
  z = (h @ W[p + "attn_gate.weight"].T).reshape(b, t, nv, dv)
  beta = _sigmoid(h @ W[p + "ssm_beta.weight"].T)
  g = W[p + "ssm_a"] * np.logaddexp(0, h @ W[p + "ssm_alpha.weight"].T + W[p + "ssm_dt.bias"])
  valid = np.arange(t)[None, :] < n_valid[:, None]
  beta, g = np.where(valid[..., None], beta, 0), np.where(valid[..., None], g, 0)
  kern = W[p + "ssm_conv1d.weight"]  # [conv_dim, K]
  K = kern.shape[1]
  xs = np.concatenate([conv_state, mixed], axis=1)
  y = _silu(sum(xs[:, j:j + t] * kern[:, j] for j in range(K)))
  new_conv = np.stack([xs[i, n_valid[i]:n_valid[i] + K - 1] for i in range(b)])
  l2 = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
  q = l2(y[..., :nk * dk].reshape(b, t, nk, dk)) / np.sqrt(dk)
  k = l2(y[..., nk * dk:2 * nk * dk].reshape(b, t, nk, dk))
  v = y[..., 2 * nk * dk:].reshape(b, t, nv, dv)
  head = (np.arange(nv) % nk if cfg.ssm_value_order == "tiled" else np.arange(nv) // (nv // nk))
  o, S = np_rule(q[:, :, head], k[:, :, head], v, g, beta, S)
  o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + cfg.rms_eps) * W[p + "ssm_norm.weight"]
  out = (o * _silu(z)).reshape(b, t, nv * dv) @ W[p + "ssm_out.weight"].T
  return out, new_conv, S


# ---------------------------------------------------------------------------------------------
# The rule

def rule_inputs(rng, b, t, h, dk, dv, g_lo=-0.5, state_scale=0.1):
  l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = l2(rng.standard_normal((b, t, h, dk))) / np.sqrt(dk)
  k = l2(rng.standard_normal((b, t, h, dk)))
  v = rng.standard_normal((b, t, h, dv))
  g = rng.uniform(g_lo, 0, (b, t, h))
  beta = rng.uniform(0, 1, (b, t, h))
  S = state_scale * rng.standard_normal((b, h, dk, dv))
  return q, k, v, g, beta, S


@functools.cache
def _jit_rule(kind: str, chunk: int):
  fn = deltanet.gdn_recurrent if kind == "recurrent" else functools.partial(
      deltanet.gdn_chunked, chunk=chunk)
  return jax.jit(fn)


def run_rule(kind, args, chunk=64):
  o, S = _jit_rule(kind, chunk)(*(jnp.asarray(x, jnp.float32) for x in args))
  return np.asarray(o, np.float64), np.asarray(S, np.float64)


@pytest.mark.parametrize("t,chunk", [(1, 64), (64, 64), (150, 64), (150, 16), (33, 8)])
def test_rule_chunked_and_recurrent_match_float64(t, chunk):
  args = rule_inputs(np.random.default_rng(t * 100 + chunk), 2, t, 3, 16, 8)
  o_ref, S_ref = np_rule(*args)
  for kind in ("recurrent", "chunked"):
    o, S = run_rule(kind, args, chunk)
    np.testing.assert_allclose(o, o_ref, atol=2e-6, rtol=0, err_msg=kind)
    np.testing.assert_allclose(S, S_ref, atol=2e-6 * max(1, np.abs(S_ref).max()), rtol=0,
                               err_msg=kind)


@settings(max_examples=16, deadline=None, database=None)
@given(t=st.sampled_from([2, 9, 16, 23]), g_lo=st.sampled_from([-1e-4, -0.3, -5.0, -30.0]),
       seed=st.integers(0, 2**31 - 1))
def test_rule_property_chunked_equals_recurrent(t, g_lo, seed):
  """Lengths below, at and between chunks; no decay to very strong decay; beta in [0, 1].
  (A few fixed lengths: every new shape compiles.)"""
  args = rule_inputs(np.random.default_rng(seed), 1, t, 2, 8, 4, g_lo=g_lo)
  o_ref, S_ref = np_rule(*args)
  o_c, S_c = run_rule("chunked", args, 16)
  np.testing.assert_allclose(o_c, o_ref, atol=5e-6, rtol=0)
  np.testing.assert_allclose(S_c, S_ref, atol=5e-6 * max(1, np.abs(S_ref).max()), rtol=0)


def test_rule_long_sequence_no_decay_is_stable():
  """512 tokens, beta = 1, almost no decay: the state saturates; chunked stays on the float64 path."""
  rng = np.random.default_rng(5)
  q, k, v, g, beta, S = rule_inputs(rng, 1, 512, 2, 32, 16, g_lo=-1e-3, state_scale=1.0)
  beta = np.ones_like(beta)
  o_ref, S_ref = np_rule(q, k, v, g, beta, S)
  for kind in ("chunked", "recurrent"):
    o, S1 = run_rule(kind, (q, k, v, g, beta, S))
    err = np.abs(o - o_ref).max() / np.abs(o_ref).max()
    assert err < 2e-5, (kind, err)
    assert np.abs(S1 - S_ref).max() / np.abs(S_ref).max() < 2e-5


def _torch_rules():
  try:
    import torch
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
  except ImportError:
    return None
  return torch, m


@pytest.mark.reference
def test_rule_matches_transformers_live():
  mods = _torch_rules()
  if mods is None:
    pytest.skip("torch/transformers not installed")
  torch, m = mods
  rng = np.random.default_rng(11)
  b, t, nk, nv, dk, dv = 2, 100, 2, 4, 16, 8
  # Raw (un-normalised) q/k with n_k < n_v heads: transformers expands them grouped, l2-normalises
  # and scales q itself; we do the same by hand before calling our rule.
  qr, kr = rng.standard_normal((b, t, nk, dk)), rng.standard_normal((b, t, nk, dk))
  v = rng.standard_normal((b, t, nv, dv))
  g, beta = rng.uniform(-0.5, 0, (b, t, nv)), rng.uniform(0, 1, (b, t, nv))
  S0 = 0.1 * rng.standard_normal((b, nv, dk, dv))
  T = lambda x: torch.tensor(x, dtype=torch.float32)
  l2 = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
  q = np.repeat(l2(qr), nv // nk, axis=2) / np.sqrt(dk)
  k = np.repeat(l2(kr), nv // nk, axis=2)
  for name, fn in (("chunk", m.torch_chunk_gated_delta_rule),
                   ("recurrent", m.torch_recurrent_gated_delta_rule)):
    kw = dict(chunk_size=64) if name == "chunk" else {}
    o_t, S_t = fn(T(qr), T(kr), T(v), g=T(g), beta=T(beta), initial_state=T(S0),
                  output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    for kind in ("chunked", "recurrent"):
      o, S = run_rule(kind, (q, k, v, g, beta, S0))
      np.testing.assert_allclose(o, o_t.double().numpy(), atol=1e-5, err_msg=f"{name}/{kind}")
      np.testing.assert_allclose(S, S_t.double().numpy(), atol=1e-5, err_msg=f"{name}/{kind}")


def test_rule_matches_transformers_recording():
  if not os.path.exists(RULES_NPZ):
    pytest.skip("tests/reference/gdn_rules.npz not recorded (tests/reference/record_transformers.py)")
  z = np.load(RULES_NPZ)
  q, k, v, g, beta, S0 = (z[n] for n in ("q", "k", "v", "g", "beta", "state"))
  for kind in ("chunked", "recurrent"):
    o, S = run_rule(kind, (q, k, v, g, beta, S0))
    for src in ("chunk", "recurrent"):
      np.testing.assert_allclose(o, z[f"o_{src}"], atol=1e-5, err_msg=f"{src}/{kind}")
      np.testing.assert_allclose(S, z[f"state_{src}"], atol=1e-5, err_msg=f"{src}/{kind}")


# ---------------------------------------------------------------------------------------------
# The block

@pytest.fixture(scope="module")
def model(tmp_path_factory):
  cfg, path = synth_file(tmp_path_factory.mktemp("gdn"), "qwen35moe", "mixed", seed=2)
  return cfg, device_weights(path, cfg), np_tensors(path)


@functools.cache
def _jit_block(cfg, ex):
  return jax.jit(functools.partial(deltanet.deltanet_block, cfg=cfg, ex=ex))


def block(cfg, w, gi, h, conv, ssm, valid=None, ex=Exec(kernels=False, numerics="f32")):
  if valid is None:
    valid = np.ones(h.shape[:2], bool)
  # deltanet_block takes the cache's whole state stacks: layer gi holds these states
  n = len(cfg.deltanet_layers)
  stack = lambda x: jnp.zeros((n,) + np.shape(x), jnp.float32).at[gi].set(
      jnp.asarray(x, jnp.float32))
  out, conv, ssm = _jit_block(cfg, ex)(jnp.asarray(h, jnp.float32), w, jnp.int32(gi), stack(conv),
                                   stack(ssm), jnp.asarray(valid))
  return tuple(np.asarray(x, np.float64) for x in (out, conv[gi], ssm[gi]))


def _states(cfg, rng, b, scale=0.3):
  conv_dim = 2 * cfg.ssm_k_heads * cfg.ssm_k_dim + cfg.ssm_v_heads * cfg.ssm_v_dim
  conv = scale * rng.standard_normal((b, cfg.ssm_conv_kernel - 1, conv_dim))
  ssm = scale * rng.standard_normal((b, cfg.ssm_v_heads, cfg.ssm_k_dim, cfg.ssm_v_dim))
  return conv, ssm


@pytest.mark.parametrize("ex", kernel_modes())
@pytest.mark.parametrize("order", ["tiled", "grouped"])
@pytest.mark.parametrize("t", [1, 13])
def test_block_matches_float64(model, order, t, ex):
  cfg, w, W = model
  cfg = dataclasses.replace(cfg, ssm_value_order=order)
  rng = np.random.default_rng(t)
  h = rng.standard_normal((2, t, cfg.d_model))
  conv, ssm = _states(cfg, rng, 2)
  gi = 1
  layer = cfg.deltanet_layers[gi]
  want = np_block(h, W, layer, cfg, conv, ssm)
  got = block(cfg, w, gi, h, conv, ssm, ex=ex)
  for name, a, b in zip(("out", "conv", "ssm"), got, want):
    np.testing.assert_allclose(a, b, atol=2e-5 * max(1, np.abs(b).max()), rtol=0, err_msg=name)


def test_block_value_order_matters(model):
  """Tiled and grouped head orders give different results when n_v > n_k (guards the switch)."""
  cfg, w, _ = model
  rng = np.random.default_rng(0)
  h = rng.standard_normal((1, 5, cfg.d_model))
  conv, ssm = _states(cfg, rng, 1)
  a = block(cfg, w, 0, h, conv, ssm)[0]
  b = block(dataclasses.replace(cfg, ssm_value_order="grouped"), w, 0, h, conv, ssm)[0]
  assert np.abs(a - b).max() > 1e-3


def test_prefill_then_decode_equals_one_pass(model):
  cfg, w, _ = model
  rng = np.random.default_rng(1)
  h = rng.standard_normal((2, 12, cfg.d_model))
  conv, ssm = _states(cfg, rng, 2, scale=0.0)
  full, conv_f, ssm_f = block(cfg, w, 2, h, conv, ssm)
  out, conv_s, ssm_s = block(cfg, w, 2, h[:, :8], conv, ssm)
  outs = [out]
  for i in range(8, 12):  # one token at a time: the recurrent path
    o, conv_s, ssm_s = block(cfg, w, 2, h[:, i:i + 1], conv_s, ssm_s)
    outs.append(o)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-5)
  np.testing.assert_allclose(conv_s, conv_f, atol=1e-6)
  np.testing.assert_allclose(ssm_s, ssm_f, atol=2e-5)


def test_padding_leaves_states_unchanged(model):
  """Right padding (bucketed prefill): the states are those after the last real token."""
  cfg, w, W = model
  rng = np.random.default_rng(2)
  h = rng.standard_normal((3, 10, cfg.d_model))
  conv, ssm = _states(cfg, rng, 3)
  n_valid = np.array([6, 10, 0])
  valid = np.arange(10)[None, :] < n_valid[:, None]
  out, conv_p, ssm_p = block(cfg, w, 0, h, conv, ssm, valid)
  want_out, want_conv, want_ssm = np_block(h, W, cfg.deltanet_layers[0], cfg, conv, ssm, n_valid)
  np.testing.assert_allclose(conv_p, want_conv, atol=1e-6)
  np.testing.assert_allclose(ssm_p, want_ssm, atol=2e-5)
  np.testing.assert_allclose(conv_p[2], conv[2], atol=1e-7)  # no real token: nothing changes
  np.testing.assert_allclose(ssm_p[2], ssm[2], atol=1e-7)
  for i, n in enumerate(n_valid):
    np.testing.assert_allclose(out[i, :n], want_out[i, :n], atol=2e-5)
  # Row 0 equals running its 6 real tokens alone.
  _, conv6, ssm6 = block(cfg, w, 0, h[:1, :6], conv[:1], ssm[:1])
  np.testing.assert_allclose(conv_p[:1], conv6, atol=1e-6)
  np.testing.assert_allclose(ssm_p[:1], ssm6, atol=2e-5)
