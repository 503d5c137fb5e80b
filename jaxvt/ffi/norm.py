"""The residual add and RMSNorm at a block boundary: one custom call (`jaxvt_add_norm`,
csrc/common/norm.h) for what a decoder computes between two blocks, which XLA runs as three to
six small kernels (the add, the sum of squares, the scaling, the shared expert's gate and its
sigmoid):

  add_norm(x [..., d], y [..., d], w [L, d], layer, eps=, c=None [..., K], s=None [..., d],
           g=None [...], v=None [L, d]) -> (x', h [..., d], dot [...])
    u   = y, or with c: sum_k c_k y_k for y [..., K, d] (a MoE's routed experts' outputs and
          their weights), in slot order
    x'  = x + (u + sigmoid(g) * s)      (x + u without s)
    h   = x' / sqrt(mean(x'^2) + eps) * w[layer]
    dot = h . v[layer]                   (0 without v)

`layer` is an int32 scalar (traced: a scan's layer index), clamped into the stacks, read on the
device: no slice of w or v is formed around the call. Each row's sums run in a fixed order of
its own (norm.h), so a row's bits never depend on the other rows of its call (the batch-invariant
rows need no other form), and the CPU and GPU kernels differ only by their exp's rounding.
`ggml`: the sum of squares in ggml's order and rounding (the CPU's kernel; elsewhere the jnp
formula), so that x' and h are llama.cpp's bits where the gated term is absent. `add_norm_ref` is
the jnp reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi as _ffi
from jaxvt.errors import JaxvtError
from jaxvt.ffi import numerics, ops

_ffi.register()


def _operands(x, y, w, layer, c, s, g, v):
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  x, y, w = f32(x), f32(y), f32(w)
  d = x.shape[-1]
  if c is not None:
    c = f32(c)
    if c.shape[:-1] != x.shape[:-1] or y.shape != (*c.shape, d):
      raise JaxvtError(f"add_norm: with weights c {c.shape}, y {y.shape} must be "
                       f"{(*c.shape, d)} for x {x.shape}")
  elif y.shape != x.shape:
    raise JaxvtError(f"add_norm: x {x.shape} and y {y.shape} must match")
  if w.ndim != 2 or w.shape[1] != d:
    raise JaxvtError(f"add_norm: w {w.shape} must be [L, {d}]")
  if (s is None) != (g is None):
    raise JaxvtError("add_norm: the gated term takes both s and g")
  if s is not None:
    s, g = f32(s), f32(g)
    if s.shape != x.shape or g.shape != x.shape[:-1]:
      raise JaxvtError(f"add_norm: s {s.shape} must be x's shape, g {g.shape} {x.shape[:-1]}")
  if v is not None:
    v = f32(v)
    if v.shape != w.shape:
      raise JaxvtError(f"add_norm: v {v.shape} must be w's shape {w.shape}")
  layer = jnp.asarray(layer)
  if layer.ndim or not jnp.issubdtype(layer.dtype, jnp.integer):
    raise JaxvtError(f"add_norm: the layer must be an integer scalar, got "
                     f"{layer.dtype}{layer.shape}")
  return x, y, w, layer.astype(jnp.int32), c, s, g, v


def add_norm_ref(x, y, w, layer, *, eps: float, c=None, s=None, g=None, v=None,
                 ggml: bool = False):
  """The jnp reference of add_norm (the same contract; ggml: numerics.rms_norm's roundings)."""
  x, y, w, layer, c, s, g, v = _operands(x, y, w, layer, c, s, g, v)
  l = jnp.clip(layer, 0, w.shape[0] - 1)
  if c is not None:  # the weighted slots, added in slot order
    y = ops.combine(c, y, ordered=True)
  xo = x + (y if s is None else y + jax.nn.sigmoid(g)[..., None] * s)
  if ggml:
    h = numerics.rms_norm(xo, w[l], eps)
  else:
    h = xo * jax.lax.rsqrt(jnp.mean(xo * xo, axis=-1, keepdims=True) + eps) * w[l]
  dot = (jnp.zeros(x.shape[:-1], jnp.float32) if v is None else
         jnp.dot(h, v[l], precision=jax.lax.Precision.HIGHEST))
  return xo, h, dot


def add_norm(x, y, w, layer, *, eps: float, c=None, s=None, g=None, v=None, ggml: bool = False):
  """The residual add and RMSNorm in one custom call (the module docstring has the contract).
  Returns (x', h, dot)."""
  x, y, w, layer, c, s, g, v = _operands(x, y, w, layer, c, s, g, v)
  lead, d = x.shape[:-1], x.shape[-1]
  rows = int(np.prod(lead, dtype=np.int64))
  K = 1 if c is None else c.shape[-1]
  empty = jnp.zeros((0,), jnp.float32)
  out = (jax.ShapeDtypeStruct((rows, d), jnp.float32), jax.ShapeDtypeStruct((rows, d), jnp.float32),
         jax.ShapeDtypeStruct((rows,), jnp.float32))
  opt = lambda a, *shape: empty if a is None else a.reshape(*shape)

  def kernel(x, y, c, s, g, w, v, layer, ggml):
    return jax.ffi.ffi_call("jaxvt_add_norm", out, vmap_method="sequential")(
        x, y, c, s, g, w, v, layer, eps=np.float32(eps), ggml=bool(ggml))

  args = (x.reshape(rows, d), y.reshape(rows * K, d), opt(c, rows, K), opt(s, rows, d),
          opt(g, rows), w, empty if v is None else v, layer)
  if ggml:  # the CPU's kernel; elsewhere the jnp formula in ggml's rounding
    def ref(x, y, c, s, g, w, v, layer):
      some = lambda a, *shape: None if a.size == 0 else a.reshape(*shape)
      return add_norm_ref(x, y.reshape(rows, K, d) if K > 1 or c.size else y, w, layer,
                          eps=eps, c=some(c, rows, K), s=some(s, rows, d), g=some(g, rows),
                          v=some(v, *w.shape), ggml=True)
    if _ffi.available("cpu"):
      xo, h, dot = jax.lax.platform_dependent(*args, cpu=lambda *a: kernel(*a, True), default=ref)
    else:
      xo, h, dot = ref(*args)
  else:
    xo, h, dot = kernel(*args, False)
  return xo.reshape(x.shape), h.reshape(x.shape), dot.reshape(lead)
