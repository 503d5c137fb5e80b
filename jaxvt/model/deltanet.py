"""Gated DeltaNet (Qwen3.5 / Qwen3.6 / Qwen3-Next linear-attention layers), pure JAX.

Per value head, with a recurrent state S of shape [dk, dv] (float32) and for every token:

  S <- S * exp(g)                      g = log decay (<= 0)
  delta = beta * (v - S^T k)           beta in (0, 1): the write strength
  S <- S + k (x) delta
  o = S^T q

`gdn_recurrent` runs that step by step (decode); `gdn_chunked` computes the same in chunks of C
tokens (prefill) with the WY / UT transform: inside a chunk, with gamma_i the cumulative log decay
from the chunk start to token i and S0 the state entering the chunk,

  S_i = exp(gamma_i) S0 + sum_{j<=i} exp(gamma_i - gamma_j) k_j u_j^T
  (I + A) U = beta V - diag(beta exp(gamma)) K S0,   A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j (j < i)
  o_i = exp(gamma_i) S0^T q_i + sum_{j<=i} exp(gamma_i - gamma_j) (q_i.k_j) u_j

so one unit-lower-triangular solve per chunk replaces C sequential updates, and only the chunk
boundary states are sequential. No exponent in it is positive, so nothing overflows.

Letters: b batch, t tokens, h value heads, k key dim, v value dim, n chunks, c/i/j chunk positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxvt.ffi import gdn
from jaxvt.model import layers
from jaxvt.model.config import ModelConfig
from jaxvt.model.layers import Exec

_HI = jax.lax.Precision.HIGHEST  # the chunked solve is sensitive; never let a GPU use TF32 here


def _ein(spec: str, *xs) -> jax.Array:
  return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=jnp.float32)


def gdn_recurrent(q, k, v, g, beta, state):
  """Token-by-token gated delta rule.

  q, k [b, t, h, dk] (expanded to the value heads, l2-normed, q scaled by dk^-0.5);
  v [b, t, h, dv]; g (log decay, <= 0), beta [b, t, h]; state [b, h, dk, dv] float32.
  Returns (o [b, t, h, dv] float32, final state [b, h, dk, dv] float32).
  """
  f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major for the scan

  def step(S, xs):
    q_t, k_t, v_t, g_t, b_t = xs  # [b, h, ...]
    S = S * jnp.exp(g_t)[..., None, None]
    delta = b_t[..., None] * (v_t - _ein("bhkv,bhk->bhv", S, k_t))
    S = S + k_t[..., :, None] * delta[..., None, :]
    return S, _ein("bhkv,bhk->bhv", S, q_t)

  xs = tuple(map(f32, (q, k, v, g, beta)))
  if q.shape[1] == 1:  # decode: no loop
    S, o = step(state.astype(jnp.float32), tuple(x[0] for x in xs))
    return o[:, None], S
  S, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
  return jnp.moveaxis(o, 0, 1), S


def gdn_chunked(q, k, v, g, beta, state, chunk: int = 64):
  """The gated delta rule in chunks of `chunk` tokens (WY / UT form); same contract as
  `gdn_recurrent`. t need not be a multiple of the chunk: the tail is padded with g = beta = 0
  tokens, which leave the state unchanged.
  """
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  C = max(1, min(chunk, t))
  pad = (-t) % C
  n = (t + pad) // C

  def chunks(x):  # [b, t, h, ...] -> [n, b, h, C, ...]
    x = x.astype(jnp.float32)
    if pad:
      x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n, C, h, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

  q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
  gam = jnp.cumsum(g, axis=-1)  # [n, b, h, C]: log decay from the chunk start to token i
  causal = jnp.tril(jnp.ones((C, C), bool))  # j <= i
  strict = jnp.tril(jnp.ones((C, C), bool), -1)  # j < i
  diff = gam[..., :, None] - gam[..., None, :]  # [.., i, j] = gamma_i - gamma_j (<= 0 where j <= i)
  decay = jnp.exp(jnp.where(causal, diff, -jnp.inf))  # 0 above the diagonal, no overflow

  a = jnp.where(strict, beta[..., :, None] * _ein("nbhik,nbhjk->nbhij", k, k) * decay, 0.0)
  # (I + A)^-1 [beta v | beta e^gamma k] in one solve: two independent solves on XLA's CPU
  # backend can both block its intra-op pool (LAPACK trsm waits there for its own batch tasks)
  # and deadlock on a 2-core machine
  rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gam))[..., None] * k], axis=-1)
  uw = jax.lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)
  u0, w = uw[..., :dv], uw[..., dv:]  # [n, b, h, C, dv], [n, b, h, C, dk]
  qd = q * jnp.exp(gam)[..., None]  # reads the entering state
  attn = _ein("nbhik,nbhjk->nbhij", q, k) * decay  # intra-chunk, diagonal included
  kd = k * jnp.exp(gam[..., -1:] - gam)[..., None]  # decayed to the chunk end
  chunk_decay = jnp.exp(gam[..., -1])[..., None, None]  # [n, b, h, 1, 1]

  def step(S, xs):
    u0_c, w_c, qd_c, attn_c, kd_c, cd_c = xs
    u = u0_c - _ein("bhck,bhkv->bhcv", w_c, S)
    o = _ein("bhck,bhkv->bhcv", qd_c, S) + _ein("bhij,bhjv->bhiv", attn_c, u)
    S = S * cd_c + _ein("bhck,bhcv->bhkv", kd_c, u)
    return S, o

  S, o = jax.lax.scan(step, state.astype(jnp.float32), (u0, w, qd, attn, kd, chunk_decay))
  o = jnp.moveaxis(o, 3, 2)  # [n, b, C, h, dv]
  o = jnp.moveaxis(o, 0, 1).reshape(b, n * C, h, dv)[:, :t]
  return o, S


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _expand_heads(x: jax.Array, n_v: int, order: str) -> jax.Array:
  """[b, t, n_k, d] -> [b, t, n_v, d]: value head j reads q/k head j % n_k ("tiled", the
  qwen35 GGUF order) or j // (n_v / n_k) ("grouped", HF and qwen3next GGUF order)."""
  n_k = x.shape[2]
  if n_k == n_v:
    return x
  if order == "tiled":
    return jnp.tile(x, (1, 1, n_v // n_k, 1))
  if order == "grouped":
    return jnp.repeat(x, n_v // n_k, axis=2)
  raise ValueError(f"unknown ssm_value_order {order!r}")


def causal_conv(x: jax.Array, conv_state: jax.Array, kernel: jax.Array, valid: jax.Array):
  """Depthwise causal conv1d over time, continuing from `conv_state`.

  x [b, t, c] (this call's inputs), conv_state [b, K-1, c] (the K-1 inputs before them),
  kernel [c, K] (kernel[:, K-1] weighs the current token), valid [b, t] bool with the real tokens
  a prefix of each row (right padding). Returns (y [b, t, c] before the activation, new conv
  state [b, K-1, c] = the last K-1 inputs up to each row's last real token).
  """
  b, t, c = x.shape
  K = kernel.shape[-1]
  xs = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)], axis=1)
  y = sum(xs[:, j:j + t] * kernel[:, j] for j in range(K))
  n_valid = jnp.sum(valid.astype(jnp.int32), axis=1)  # [b]
  idx = n_valid[:, None] + jnp.arange(K - 1)[None, :]  # rows n .. n+K-2 of xs
  new_state = jnp.take_along_axis(xs, idx[:, :, None], axis=1)
  return y, new_state


def gdn_mix(mixed, z, beta, alpha, a, dt_bias, conv_w, norm_w, conv_state, ssm_state, valid,
            eps: float, order: str, chunked: bool = True):
  """A DeltaNet mixer between its projections, in jnp, for any t: gating, the causal conv and
  silu, l2-normed q / k expanded to the value heads, the gated delta rule, then
  rms_norm(o) * norm_w * silu(z).

  mixed [b, t, conv_dim] = [q | k | v] (conv_dim = 2 nk dk + nv dv); z [b, t, nv dv]; beta, alpha
  [b, t, nv] (the projections' raw outputs); a, dt_bias [nv]; conv_w [conv_dim, K]; norm_w [dv];
  conv_state [b, K-1, conv_dim]; ssm_state [b, nv, dk, dv] float32; valid [b, t] bool. Sizes come
  from the operands (a device of a mesh passes its own heads). `chunked`: several tokens take
  gdn_chunked (else gdn_recurrent, token by token: a token's arithmetic is then the same in a
  prefill of any length and in decode). Returns (y [b, t, nv dv] float32, conv_state,
  ssm_state).
  """
  b, t, conv_dim = mixed.shape
  nv, dv, dk = beta.shape[-1], norm_w.shape[-1], ssm_state.shape[-2]
  nk = (conv_dim - nv * dv) // (2 * dk)
  z = z.reshape(b, t, nv, dv)
  beta = jax.nn.sigmoid(beta)
  g = a * jax.nn.softplus(alpha + dt_bias)  # ssm_a = -exp(A_log)
  beta = jnp.where(valid[..., None], beta, 0.0)
  g = jnp.where(valid[..., None], g, 0.0)

  with jax.named_scope("gdn_conv"):
    mixed, conv_state = causal_conv(mixed, conv_state, conv_w, valid)
    mixed = jax.nn.silu(mixed)
  qk = nk * dk
  q = mixed[..., :qk].reshape(b, t, nk, dk)
  k = mixed[..., qk:2 * qk].reshape(b, t, nk, dk)
  v = mixed[..., 2 * qk:].reshape(b, t, nv, dv)
  q = _l2norm(q) * (dk ** -0.5)
  k = _l2norm(k)
  q = _expand_heads(q, nv, order)
  k = _expand_heads(k, nv, order)

  with jax.named_scope("gdn_core"):
    rule = gdn_chunked if chunked and t > 1 else gdn_recurrent
    o, ssm_state = rule(q, k, v, g, beta, ssm_state)

  y = layers.rms_norm(o, norm_w, eps) * jax.nn.silu(z)  # ssm_norm: no +1
  return y.reshape(b, t, nv * dv), conv_state, ssm_state


def gdn_step_ref(mixed, z, beta_raw, alpha_raw, a, dt_bias, conv_w, norm_w, conv_state,
                 ssm_state, valid, layer, *, eps: float, order: str = "tiled"):
  """The jnp reference of jaxvt.ffi.gdn.gdn_step (its t == 1 shapes: no token axis, valid [b];
  whole stacks and the layer index, clamped into each stack): gdn_mix at one token on layer
  `layer`, written back into the state stacks."""
  one = lambda x: jnp.asarray(x)[:, None]
  lw = jnp.clip(jnp.asarray(layer, jnp.int32), 0, jnp.shape(a)[0] - 1)
  ls = jnp.clip(jnp.asarray(layer, jnp.int32), 0, jnp.shape(ssm_state)[0] - 1)
  conv_state, ssm_state = jnp.asarray(conv_state), jnp.asarray(ssm_state)
  y, conv, ssm = gdn_mix(one(mixed), one(z), one(beta_raw), one(alpha_raw), a[lw], dt_bias[lw],
                         conv_w[lw], norm_w[lw], conv_state[ls], ssm_state[ls],
                         one(valid).astype(bool), eps, order)
  return (y[:, 0], conv_state.at[ls].set(conv.astype(conv_state.dtype)),
          ssm_state.at[ls].set(ssm.astype(ssm_state.dtype)))


def gdn_steps(mixed, z, beta, alpha, stacks, conv_states, ssm_states, valid, gi,
              cfg: ModelConfig):
  """The fused decode step (jaxvt.ffi.gdn.gdn_step) at each of the t tokens in turn, on the
  whole state stacks: a token's arithmetic is then the same in a prefill of any length, after a
  prefix hit and in decode, and does not depend on the other rows (each row's sums run in a
  fixed order). mixed, z, beta, alpha [b, t, ...]; valid [b, t]. Returns (y [b, t, nv dv],
  conv_states, ssm_states)."""
  def step(carry, xs):
    conv, ssm = carry
    m_t, z_t, b_t, a_t, v_t = xs
    y_t, conv, ssm = gdn.gdn_step(m_t, z_t, b_t, a_t, *stacks, conv, ssm, v_t, gi,
                                  eps=cfg.rms_eps, order=cfg.ssm_value_order)
    return (conv, ssm), y_t

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (mixed, z, beta, alpha, valid))
  if mixed.shape[1] == 1:  # decode: no loop
    (conv_states, ssm_states), y = step((conv_states, ssm_states), tuple(x[0] for x in xs))
    return y[:, None], conv_states, ssm_states
  (conv_states, ssm_states), y = jax.lax.scan(step, (conv_states, ssm_states), xs)
  return jnp.moveaxis(y, 0, 1), conv_states, ssm_states


def deltanet_block(h, w: dict, gi, conv_states, ssm_states, valid, cfg: ModelConfig, ex: Exec):
  """One Gated DeltaNet mixer (the block's residual and norms live in the decoder).

  h [b, t, d] (already normed); w: all weights (whole stacks; matrices read through
  layers.linear at stack index `gi`, vectors indexed [gi]); conv_states [n_gdn, b, K-1, conv_dim]
  and ssm_states [n_gdn, b, n_v, dk, dv] float32: the cache's whole state stacks, layer `gi`
  this block's (the weights' stack index and the cache's are the same); valid [b, t] bool
  (padding, on the right, leaves both states unchanged). Returns (out [b, t, d] float32,
  conv_states, ssm_states) with layer gi updated.

  Decode (t == 1) under a rule with `gdn_fused` (jaxvt.ffi.tuning.Products; the GPUs' row) runs the middle as
  one custom call on the stacks, updating layer gi in place (jaxvt.ffi.gdn.gdn_step); otherwise
  gdn_mix's jnp on layer gi's slices, written back: the chunked form from the rule's
  `gdn_chunked_rows` tokens, else the recurrence (the CPU's: the same bits however the tokens
  are split between calls, and faster there).
  """
  b, t, _ = h.shape
  with jax.named_scope("gdn_in"):
    mixed, z, beta, alpha = layers.linear_many(
        h, [w["gdn.w_qkv"], w["gdn.w_z"], w["gdn.w_beta"], w["gdn.w_alpha"]], gi, ex)
    # mixed [b, t, conv_dim] = [q | k | v]; z [b, t, nv dv]; beta, alpha [b, t, nv]
  stacks = (w["gdn.a"], w["gdn.dt_bias"], w["gdn.conv"], w["gdn.norm"])
  rows = ex.products.gdn_chunked_rows
  chunked = bool(rows) and t >= rows
  if ex.backend.fused("gdn", ex) and not chunked:
    with jax.named_scope("gdn_step"):
      y, conv_states, ssm_states = gdn_steps(mixed, z, beta, alpha, stacks, conv_states,
                                             ssm_states, valid, gi, cfg)
  else:
    vecs = tuple(x[gi] for x in stacks)
    y, conv, ssm = gdn_mix(mixed, z, beta, alpha, *vecs, conv_states[gi], ssm_states[gi], valid,
                           cfg.rms_eps, cfg.ssm_value_order, chunked=chunked)
    conv_states = conv_states.at[gi].set(conv.astype(conv_states.dtype))
    ssm_states = ssm_states.at[gi].set(ssm.astype(ssm_states.dtype))

  with jax.named_scope("gdn_out"):
    out = layers.linear(y, w["gdn.w_out"], gi, ex)
  return out, conv_states, ssm_states
