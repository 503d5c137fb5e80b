"""Weights pulled into the GPU's L2 cache ahead of the products that read them (jaxvt_l2_ahead).

A decode step's matvec kernels are short, and each pays a chain of dependent memory round trips
(its launch, the layer's address, its activations, the first weight bytes) before it streams at
bandwidth. `ahead(x, ws, layer)` returns x unchanged after one small launch that asks for each
stack's layer to be pulled from HBM into L2 (CUDA sm_90+: cp.async.bulk.prefetch.L2, nothing to
wait for), so the bytes stream while the kernels before their reader run, and that reader finds
them in L2. Give it the value the readers take (the normed hidden state; the routed ids with
`routed=True`, which prefetches only the experts they name): whatever reads the result runs after
the prefetch was issued.

Host-tier layers are skipped (their bytes cross the bus, which an L2 prefetch does not drive); on
HIP, on CUDA devices before sm_90 and on the CPU the call computes nothing. Nothing computed
depends on it: the reference is the identity (tests/test_l2_ahead.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.errors import JaxvtError
from jaxvt.qweight import QWeight

MAX_STACKS = 12  # stacks one launch takes (kernels_gpu.h kMaxL2)


def ahead(x: jax.Array, stacks: Sequence[tuple[QWeight, jax.Array] | None],
          routed: bool = False) -> jax.Array:
  """x, after layer l of each (stack, l) in stacks (None entries skipped) was asked into L2; with
  routed, x is the routed ids (int32, any shape) and only the experts they name are."""
  stacks = [s for s in stacks if s is not None]
  if not stacks:
    return x
  if routed:
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise JaxvtError(f"l2.ahead: routed ids must be integers, got {x.dtype}")
    if any(not w.meta.experts for w, _ in stacks):
      raise JaxvtError("l2.ahead: routed ids name experts; every stack must have them")
    x = x.astype(jnp.int32)
  for i in range(0, len(stacks), MAX_STACKS):
    part = stacks[i:i + MAX_STACKS]
    bufs = []
    for w, layer in part:
      layer = jnp.asarray(layer)
      if layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise JaxvtError("the layer index must be an integer scalar, got "
                         f"{layer.dtype}{layer.shape}")
      bufs += [w.data, w.table, w.fmts, layer.astype(jnp.int32)]
    call = jax.ffi.ffi_call("jaxvt_l2_ahead", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0})
    x = call(x, *bufs, rows=np.array([w.meta.rows for w, _ in part], np.int64),
             cols=np.array([w.meta.cols for w, _ in part], np.int64),
             experts=np.array([w.meta.experts for w, _ in part], np.int64), routed=routed)
  return x
