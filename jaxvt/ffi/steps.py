"""Model steps in ggml arithmetic (`rms_norm`, `swiglu`, `rope`, `attention`): CPU kernels that
reproduce ggml's float32 rounding bit for bit (csrc/kernels_cpu_ggml.h); other platforms and
`kernels=False` run the jnp formulas of jaxvt.ffi.numerics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi as _ffi
from jaxvt.ffi import numerics, ops

_ffi.register()


def _on_cpu(kernel, ref, *args):
  """kernel(*args) when lowered for CPU (and the extension is built), else ref(*args)."""
  if not _ffi.available("cpu"):
    return ref(*args)
  return jax.lax.platform_dependent(*args, cpu=kernel, default=ref)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float, kernels: bool = True) -> jax.Array:
  """x f32 [..., d], w f32 [d] or None -> numerics.rms_norm (ggml's rounding on CPU kernels)."""
  x = jnp.asarray(x, jnp.float32)
  if not kernels:
    return numerics.rms_norm(x, w, eps)
  w = jnp.ones(x.shape[-1:], jnp.float32) if w is None else jnp.asarray(w, jnp.float32)

  def kernel(x, w):
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return jax.ffi.ffi_call("jaxvt_rms_norm", out, vmap_method="sequential")(
        x, w, eps=np.float32(eps))

  return _on_cpu(kernel, lambda x, w: numerics.rms_norm(x, w, eps), x, w)


def swiglu(g: jax.Array, u: jax.Array, kernels: bool = True) -> jax.Array:
  """(g / (1 + exp(-g))) * u for f32 [..., d] (numerics.swiglu)."""
  g, u = jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32)
  if not kernels:
    return numerics.swiglu(g, u)

  def kernel(g, u):
    out = jax.ShapeDtypeStruct(g.shape, jnp.float32)
    return jax.ffi.ffi_call("jaxvt_swiglu", out, vmap_method="sequential")(g, u)

  return _on_cpu(kernel, numerics.swiglu, g, u)


def rope(x: jax.Array, positions: jax.Array, n_dims: int, base: float, neox: bool,
         kernels: bool = True) -> jax.Array:
  """x f32 [..., T, H, hd], positions int32 [..., T] -> numerics.rope (ggml_rope_ext)."""
  x = jnp.asarray(x, jnp.float32)
  positions = jnp.asarray(positions, jnp.int32)
  ref = lambda x, p: numerics.rope(x, p, n_dims, base, neox)
  if not kernels:
    return ref(x, positions)

  def kernel(x, p):
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return jax.ffi.ffi_call("jaxvt_rope", out, vmap_method="sequential")(
        x, p, n_dims=np.int64(n_dims), base=np.float32(base), neox=np.int64(bool(neox)))

  return _on_cpu(kernel, ref, x, positions)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, positions: jax.Array,
              n_query: jax.Array, kv_len: int, scale: float, kernels: bool = True) -> jax.Array:
  """Causal softmax attention over a stacked KV cache, as ggml's non-flash path rounds it.

  q f32 [b, t, H, D] (after RoPE); k_cache [A, b, S, K, D], v_cache [A, b, S, K, Dv] (float16
  or float32: q and the probabilities are rounded to it); layer int32 [] (which of the A);
  positions int32 [b, t]; n_query int32 [b]: real query tokens of each row in this call
  (llama.cpp's batched products, whose float32 order differs, serve >= 2); the tokens from
  n_query on are a bucketed prefill's padding, and their output is zeros (the kernel skips
  them: at a long prompt's bucket they are much of the quadratic work). Only the first kv_len
  (static) positions are read. -> f32 [b, t, H, Dv].
  """
  q = jnp.asarray(q, jnp.float32)
  layer = ops._layer(layer)
  positions = jnp.asarray(positions, jnp.int32)
  n_query = jnp.asarray(n_query, jnp.int32)
  b = q.shape[0]
  K, D, Dv = k_cache.shape[3], k_cache.shape[4], v_cache.shape[4]

  def ref(q, kc, vc, layer, positions, n_query):
    zero = jnp.zeros((), jnp.int32)
    l = jnp.clip(layer, 0, kc.shape[0] - 1)
    ks = jax.lax.dynamic_slice(kc, (l, zero, zero, zero, zero), (1, b, kv_len, K, D))[0]
    vs = jax.lax.dynamic_slice(vc, (l, zero, zero, zero, zero), (1, b, kv_len, K, Dv))[0]
    real = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :] < n_query[:, None]
    return jnp.where(real[:, :, None, None], numerics.attention(q, ks, vs, positions, scale), 0.0)

  args = (q, k_cache, v_cache, layer, positions, n_query)
  if not kernels or kv_len % 8:
    return ref(*args)

  def kernel(q, kc, vc, layer, positions, n_query):
    out = jax.ShapeDtypeStruct((*q.shape[:3], Dv), jnp.float32)
    return jax.ffi.ffi_call("jaxvt_attention", out, vmap_method="sequential")(
        q, kc, vc, layer, positions, n_query, kv_len=np.int64(kv_len), scale=np.float32(scale))

  return _on_cpu(kernel, ref, *args)
