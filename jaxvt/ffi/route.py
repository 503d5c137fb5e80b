"""The MoE router's softmax-top-k (`moe_route`, the custom call jaxvt_moe_route,
csrc/common/route.h) beside its jnp reference (`moe_route_ref`):

  moe_route(logits f32 [T, E], k, renormalise)  -> ids int32 [T, k], weights f32 [T, k]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxvt.errors import JaxvtError

MAX_EXPERTS = 512  # csrc/common/route.h kMaxExperts: wider routers run moe_route_ref


def moe_route_ref(logits: jax.Array, k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
  """Router logits [..., E] -> (ids int32 [..., k], weights float32 [..., k]): softmax in
  float32, lax.top_k (descending, ties to the lower index), renormalised to sum 1 if asked."""
  p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  wts, ids = jax.lax.top_k(p, k)
  if renormalise:
    wts = wts / jnp.sum(wts, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), wts


def moe_route(logits: jax.Array, k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
  """moe_route_ref as one custom call (csrc/common/route.h): the same ids where no two probabilities
  are within float32 rounding of each other, the weights to float32 rounding. A row whose
  softmax is NaN (a NaN or +inf logit, or all -inf) gives ids 0 .. k-1 with NaN weights, as the
  reference does."""
  logits = jnp.asarray(logits, jnp.float32)
  E = logits.shape[-1]
  if not 1 <= k <= E:
    raise JaxvtError(f"moe_route: k = {k} must be 1 .. {E} (the router's experts)")
  if E > MAX_EXPERTS:
    return moe_route_ref(logits, k, renormalise)
  out = (jax.ShapeDtypeStruct((*logits.shape[:-1], k), jnp.int32),
         jax.ShapeDtypeStruct((*logits.shape[:-1], k), jnp.float32))
  return jax.ffi.ffi_call("jaxvt_moe_route", out, vmap_method="expand_dims")(
      logits, renormalise=bool(renormalise))
