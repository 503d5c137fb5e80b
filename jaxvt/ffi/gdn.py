"""The fused Gated DeltaNet decode step: one custom call (`jaxvt_gdn_step`, csrc/common/gdn.h) for
everything between a DeltaNet layer's input projections and its output projection at t == 1, on
whole stacks: it reads layer `layer` of the weight stacks and updates layer `layer` of the state
stacks in place (the stacks are aliased to the results: no slice or update-slice around it).

  gdn_step(mixed [b, conv_dim], z [b, nv dv], beta_raw [b, nv], alpha_raw [b, nv], a [L, nv],
           dt_bias [L, nv], conv_w [L, conv_dim, K], norm_w [L, dv],
           conv_state [Ls, b, K-1, conv_dim], ssm_state [Ls, b, nv, dk, dv], valid [b], layer,
           eps=, order=)
    -> (y [b, nv dv] float32, conv_state [Ls, ...] float32, ssm_state [Ls, ...] float32)

`layer` is an int32 scalar (traced: a scan's layer index), clamped into each stack (an index out
of range reads and writes the nearest layer, never outside the buffers). y is the input of the
output projection: rms_norm(o) * norm_w * silu(z). A row whose `valid` is False keeps both states
(beta = g = 0). Every size comes from the operands (nk from conv_dim = 2 nk dk + nv dv), so a
device of a mesh passes its own heads. float32 throughout, each sum in a fixed order:
deterministic, and within float32 rounding of the reference. The states must be float32 stacks
to be updated in place (others are converted, then copied).

The jnp reference is jaxvt.model.deltanet.gdn_step_ref: it is made of the model's own functions
(causal_conv, _l2norm, _expand_heads, gdn_recurrent, layers.rms_norm), and jaxvt.model sits above
this package (tests/test_layering.py), so it lives there; tests/test_gdn_step.py compares them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi as _ffi
from jaxvt.errors import JaxvtError

_ffi.register()

MAX_DIM = 256  # dk and dv at most this (gdn.h kMaxDim)
QK_EPS = 1e-6  # the q / k l2norm's epsilon (jaxvt.model.deltanet._l2norm)


def gdn_step(mixed, z, beta_raw, alpha_raw, a, dt_bias, conv_w, norm_w, conv_state, ssm_state,
             valid, layer, *, eps: float, order: str = "tiled"):
  """One decode step of layer `layer` of a Gated DeltaNet's stacks (the module docstring has the
  shapes); `order` is the value heads' key head order, "tiled" or "grouped"
  (ModelConfig.ssm_value_order). Returns (y, conv_state stack, ssm_state stack)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  mixed, z, beta_raw, alpha_raw = map(f32, (mixed, z, beta_raw, alpha_raw))
  a, dt_bias, conv_w, norm_w = map(f32, (a, dt_bias, conv_w, norm_w))
  conv_dtype = jnp.asarray(conv_state).dtype
  conv_state, ssm_state = f32(conv_state), f32(ssm_state)
  valid = jnp.asarray(valid).astype(jnp.int32)
  layer = jnp.asarray(layer).astype(jnp.int32)
  if mixed.ndim != 2 or ssm_state.ndim != 5 or conv_w.ndim != 3:
    raise JaxvtError(f"gdn_step: mixed {mixed.shape} must be [b, conv_dim], ssm_state "
                     f"{ssm_state.shape} [Ls, b, nv, dk, dv], conv_w {conv_w.shape} "
                     "[L, conv_dim, K]")
  b, conv_dim = mixed.shape
  Ls, _, nv, dk, dv = ssm_state.shape
  L, K = conv_w.shape[0], conv_w.shape[-1]
  nk = (conv_dim - nv * dv) // (2 * dk)
  if order not in ("tiled", "grouped"):
    raise JaxvtError(f"gdn_step: unknown value order {order!r}")
  if (nk < 1 or nv % nk or 2 * nk * dk + nv * dv != conv_dim or max(dk, dv) > MAX_DIM
      or ssm_state.shape[1] != b or conv_state.shape != (Ls, b, K - 1, conv_dim)
      or conv_w.shape != (L, conv_dim, K) or a.shape != (L, nv) or dt_bias.shape != (L, nv)
      or norm_w.shape != (L, dv) or valid.shape != (b,) or layer.shape != ()):
    raise JaxvtError(f"gdn_step: shapes do not fit one another (mixed {mixed.shape}, ssm_state "
                     f"{ssm_state.shape}, conv_state {conv_state.shape}, conv kernel "
                     f"{conv_w.shape}, a {a.shape}, dt_bias {dt_bias.shape}, norm {norm_w.shape}, "
                     f"valid {valid.shape}, layer {layer.shape}; dk, dv at most {MAX_DIM})")
  out = (jax.ShapeDtypeStruct((b, nv * dv), jnp.float32),
         jax.ShapeDtypeStruct(conv_state.shape, jnp.float32),
         jax.ShapeDtypeStruct(ssm_state.shape, jnp.float32),
         jax.ShapeDtypeStruct((b, conv_dim), jnp.float32))  # conv_out: the kernels' scratch
  # Both stacks are updated in place (layer `layer` only): the conv phase finishes before the
  # heads read its output (csrc/common/gdn.h), so no head reads a conv state another has written.
  call = jax.ffi.ffi_call("jaxvt_gdn_step", out, input_output_aliases={8: 1, 9: 2},
                          vmap_method="sequential")
  y, conv_state, ssm_state, _ = call(
      mixed, z, beta_raw, alpha_raw, a, dt_bias, conv_w, norm_w, conv_state, ssm_state, valid,
      layer, nk=np.int64(nk), grouped=np.int64(order == "grouped"), eps=np.float32(eps),
      qk_eps=np.float32(QK_EPS))
  return y, conv_state.astype(conv_dtype), ssm_state
