"""The backends the model computes through: `REFERENCE` (jnp, reading device-tier weights only)
and `KERNELS` (jaxvt's FFI custom calls, reading either tier). `Exec.backend` picks one; the
model (jaxvt.model) calls only these ops and never names a kernel or a tuning knob:

  matmul(x, w, layer, ex)          x [..., cols] times layer `layer` of stack w -> f32 [..., rows]
  swiglu_matmul(g, u, w, layer, ex)  matmul(swiglu(g, u, ex), w, layer, ex) (one launch where
                                   the backend fuses "swiglu")
  shares_input(x, ws, ex)          whether matmul_many runs ws as one launch
  matmul_many(x, ws, layer, ex)    [matmul(x, w, layer, ex) for w in ws], one launch
  embed(ids, w, ex)                rows of an embedding table -> f32 [..., cols]
  route(logits, k, renormalise, ex)  router logits [T, E] -> (ids [T, k], weights [T, k])
  experts(ex, n_tokens, k, E, combined=True)
                                   fn(x, w_gate, w_up, w_down, layer, ids, weights) -> [T, d]
                                   (combined=False, where slots_apart: the k slots' [T, k, d])
  slots_apart(ex, n_tokens, k, E)  whether experts can leave the k slots unsummed
  fused(step, ex, tokens=1)        whether a step ("attn", "gdn", "norm", "swiglu") is one
                                   custom call (for "swiglu": formed inside the down products);
                                   for attention, whether `tokens` query tokens take it, token
                                   by token
  add_norm(x, y, w, layer, eps, ex, c=None, s=None, g=None, v=None)
                                   the residual add and RMSNorm at a block boundary, with
                                   weighted slots, the gated term and a dotted vector
                                   (jaxvt.ffi.norm) -> (x', h, dot)
  attn_split(ex)                   positions of one split of the fused attention step (None:
                                   by the program's kv_len)
  rowdot(x, v, ex)                 x f32 [T, d] times a vector v [d] -> f32 [T]
  rms_scale(x, eps, ex)            RMSNorm's factor 1 / sqrt(mean(x^2) + eps): f32 [..., 1]
  fusion_barrier(x)                x, kept out of the fusion that forms it where the backend's
                                   compiler would otherwise fuse the next product into it

and the other steps in ggml's rounding (jaxvt.ffi.steps: the CPU kernels, or their jnp formulas):

  rms_norm(x, w, eps, ex)          x f32 [..., d], w [d] or None -> f32 [..., d]
  rope(x, positions, n_dims, base, neox, ex)  x f32 [..., T, H, hd] rotated at positions [..., T]
  attention(q, k_cache, v_cache, layer, positions, n_query, kv_len, scale, ex)
                                   causal attention of q [b, t, H, D] over a stacked KV cache's
                                   layer `layer` -> f32 [b, t, H, Dv]
  swiglu(g, u, ex)                 silu(g) * u, f32 [..., d]

Which kernel a product takes by its rows (matvec, tiled, staged; per slot or grouped experts)
is the Exec's tuning row (jaxvt.ffi.tuning.Products).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxvt.ffi import grouped, norm, numerics, ops, route, steps
from jaxvt.gguf import quants
from jaxvt.gguf.formats import F32, FORMATS
from jaxvt.qweight import FMT_MASK, HOST_BIT, QMeta, QWeight


class _GgmlSteps:
  """The ops in ggml's rounding (jaxvt.ffi.steps), which the model calls under "ggml" numerics:
  the CPU kernels where `step_kernels` (on other platforms their jnp formulas), else the jnp
  formulas everywhere."""

  step_kernels: ClassVar[bool]

  def rms_norm(self, x, w, eps: float, ex):
    return steps.rms_norm(x, w, eps, kernels=self.step_kernels)

  def rope(self, x, positions, n_dims: int, base: float, neox: bool, ex):
    return steps.rope(x, positions, n_dims, base, neox, kernels=self.step_kernels)

  def attention(self, q, k_cache, v_cache, layer, positions, n_query, kv_len: int, scale: float,
                ex):
    return steps.attention(q, k_cache, v_cache, layer, positions, n_query, kv_len, scale,
                           kernels=self.step_kernels)

  def swiglu(self, g, u, ex):
    return steps.swiglu(g, u, kernels=self.step_kernels)


@dataclasses.dataclass(frozen=True)
class Reference(_GgmlSteps):
  """The jnp references of every op (the default where no extension is built)."""

  step_kernels: ClassVar[bool] = False

  def matmul(self, x, w, layer, ex):
    return ops.qmatmul_ref(x.astype(jnp.float32), w, layer, ex.mode)

  def swiglu_matmul(self, g, u, w, layer, ex):
    return self.matmul(_swiglu(self, g, u, ex), w, layer, ex)

  def shares_input(self, x, ws, ex) -> bool:
    return False

  def matmul_many(self, x, ws, layer, ex):
    return [self.matmul(x, w, layer, ex) for w in ws]

  def embed(self, ids, w, ex):
    return ops.qembed_ref(ids, w, jnp.int32(0))

  def route(self, logits, k: int, renormalise: bool, ex):
    return route.moe_route_ref(logits, k, renormalise)

  def experts(self, ex, n_tokens: int, k: int, n_experts: int, combined: bool = True):
    """The gathered reference for few slots; one pass per expert for many (its [T, k, rows,
    cols] intermediate would not fit). Always combined."""
    fn = ops.moe_experts_ref if n_tokens * k <= n_experts else experts_per_expert_ref
    return functools.partial(fn, mode=ex.mode)

  def slots_apart(self, ex, n_tokens: int, k: int, n_experts: int) -> bool:
    return False

  def fused(self, step: str, ex, tokens: int = 1) -> bool:
    return False

  def add_norm(self, x, y, w, layer, eps: float, ex, c=None, s=None, g=None, v=None):
    return norm.add_norm_ref(x, y, w, layer, eps=eps, c=c, s=s, g=g, v=v, ggml=ex.ggml)

  def attn_split(self, ex) -> int | None:
    return None

  def rowdot(self, x, v, ex):
    return jnp.dot(x, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)

  def rms_scale(self, x, eps: float, ex):
    return _rms_scale(x, eps)

  def fusion_barrier(self, x):
    return x


_FUSED = {"attn": "attn_fused", "gdn": "gdn_fused", "route": "fused_route",
          "norm": "fused_norm", "swiglu": "fused_swiglu"}


@dataclasses.dataclass(frozen=True)
class Kernels(_GgmlSteps):
  """jaxvt's custom calls, each product on the path the Exec's tuning row gives for its rows."""

  step_kernels: ClassVar[bool] = True

  def matmul(self, x, w, layer, ex):
    path = ex.products.dense(x.size // x.shape[-1], w.meta)
    if path == "staged":
      return jnp.dot(x.astype(jnp.bfloat16), ops.qdequant(w, layer).T,
                     preferred_element_type=jnp.float32)
    if path == "tiled":
      return grouped.qmatmul_tiled(x, w, layer)
    return ops.qmatmul(x.astype(jnp.float32), w, layer, ex.mode)

  def swiglu_matmul(self, g, u, w, layer, ex):
    """One launch where the row fuses swiglu, the products are integer ones and the product
    takes the matvec kernels (ops.qmatmul's up=), else the swiglu step, then matmul."""
    if (self.fused("swiglu", ex) and numerics.integer_products(ex.mode)
            and ex.products.dense(g.size // g.shape[-1], w.meta) == "matvec"):
      return ops.qmatmul(g.astype(jnp.float32), w, layer, ex.mode, up=u)
    return self.matmul(_swiglu(self, g, u, ex), w, layer, ex)

  def shares_input(self, x, ws, ex) -> bool:
    rows = x.size // x.shape[-1]
    return all(ex.products.dense(rows, w.meta) == "matvec" for w in ws)

  def matmul_many(self, x, ws, layer, ex):
    """One launch on a GPU (ops.qmatmul_multi; the same bits as one call a matrix)."""
    return ops.qmatmul_multi(x.astype(jnp.float32), ws, layer, ex.mode)

  def embed(self, ids, w, ex):
    return ops.qembed(ids, w, jnp.int32(0))

  def route(self, logits, k: int, renormalise: bool, ex):
    """One custom call where the tuning row fuses the router (the same ids, weights to float32
    rounding), else the reference (whose arithmetic the CPU's llama.cpp checks match)."""
    fn = route.moe_route if ex.products.fused_route else route.moe_route_ref
    return fn(logits, k, renormalise)

  def experts(self, ex, n_tokens: int, k: int, n_experts: int, combined: bool = True):
    """The grouped kernel from the tuning row's slot count, else the per-slot kernels (both
    read only the routed experts' bytes, from either tier); their k slots added in slot order
    where the row says so (Products.ordered_sums), or left apart (combined=False; the per-slot
    kernels only: slots_apart)."""
    if ex.products.experts(n_tokens * k, n_experts) == "grouped":
      return grouped.moe_grouped
    return functools.partial(ops.moe_experts, mode=ex.mode, ordered=ex.products.ordered_sums,
                             combined=combined,
                             swiglu=(self.fused("swiglu", ex)
                                     and numerics.integer_products(ex.mode)))

  def slots_apart(self, ex, n_tokens: int, k: int, n_experts: int) -> bool:
    """Whether the routed experts of n_tokens tokens take the per-slot kernels, whose k outputs
    experts(combined=False) can leave unsummed."""
    return ex.products.experts(n_tokens * k, n_experts) != "grouped"

  def fused(self, step: str, ex, tokens: int = 1) -> bool:
    """Whether the tuning row fuses the step; several query tokens take the fused attention
    step (token by token) only where it says so (Products.attn_steps)."""
    on = bool(getattr(ex.products, _FUSED[step]))
    return on and (tokens == 1 or step != "attn" or ex.products.attn_steps)

  def add_norm(self, x, y, w, layer, eps: float, ex, c=None, s=None, g=None, v=None):
    """One custom call (jaxvt.ffi.norm.add_norm; ggml's sum of squares under ggml numerics)."""
    return norm.add_norm(x, y, w, layer, eps=eps, c=c, s=s, g=g, v=v, ggml=ex.ggml)

  def attn_split(self, ex) -> int | None:
    """The tuning row's fixed split (Products.attn_chunk), else None (by kv_len)."""
    return ex.products.attn_chunk or None

  def rowdot(self, x, v, ex):
    """Where the row asks for sums whose order does not depend on the rows
    (Products.ordered_sums), the matvec kernel with v as a one-row float32 matrix (its fixed
    order; XLA picks a dot's algorithm, and its reductions' vectorisation, by the shapes); else a
    float32 dot."""
    v = v.astype(jnp.float32)
    if ex.products.ordered_sums and _vector_ok(v.shape[-1]):
      return ops.qmatmul(x, _vector_weight(v), jnp.int32(0), ex.mode)[..., 0]
    return jnp.dot(x, v, precision=jax.lax.Precision.HIGHEST)

  def rms_scale(self, x, eps: float, ex):
    """Where the row asks for ordered sums, the sum of squares by the matvec kernel (x^2 times
    a row of ones) and 1 / sqrt(sum / d + eps) in correctly rounded steps (XLA's rsqrt and its
    reductions may round a row differently by the shapes); else XLA's."""
    d = x.shape[-1]
    if not (ex.products.ordered_sums and _vector_ok(d)):
      return _rms_scale(x, eps)
    ones = _vector_weight(jnp.ones((d,), jnp.float32))
    ss = ops.qmatmul(x * x, ones, jnp.int32(0), ex.mode)  # [..., 1]
    return 1.0 / jnp.sqrt(ss / d + eps)

  def fusion_barrier(self, x):
    """x through an optimization barrier: XLA:GPU would otherwise fuse a dot reading x into the
    fusion that forms x (a slower multi-output reduction); the value is the same."""
    return jax.lax.optimization_barrier(x)


REFERENCE = Reference()
KERNELS = Kernels()


def _swiglu(backend, g, u, ex):
  """The swiglu step as the model computes it: ggml's rounding under ggml numerics (the
  backend's swiglu), else jax.nn.silu."""
  return backend.swiglu(g, u, ex) if ex.ggml else jax.nn.silu(g) * u


def _rms_scale(x, eps: float):
  """XLA's RMSNorm factor: rsqrt(mean(x^2) + eps) over the last axis, f32 [..., 1]."""
  return jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _vector_ok(d: int) -> bool:
  """Whether d columns are whole float32 blocks (a one-row F32 matrix the kernels take)."""
  return d % FORMATS[F32].kblock_elems == 0


def _vector_weight(v: jax.Array) -> QWeight:
  """v f32 [d] as a one-layer, one-row float32 weight on the device (its bytes as the kernels
  read an F32 matrix), so that x @ v takes the matvec kernel."""
  d = v.shape[-1]
  raw = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint8).reshape(1, 4 * d)
  meta = QMeta(rows=1, cols=d, experts=0, formats=(F32,), n_layers=1)
  return QWeight(raw, jnp.zeros((1, 2), jnp.uint32), jnp.full((1,), F32, jnp.int32), meta)


# ---------------------------------------------------------------------------------------------
# The reference's routed experts for many tokens.
#
# jaxvt.ffi.ops.moe_experts_ref gathers the routed experts' matrices per token and slot: a
# [T, k, rows, cols] float32 intermediate, fine for decode but 137 GB for a 4096-token prefill of
# Qwen3.6-35B-A3B. For many tokens we instead pass once over the experts, each dequantized once
# and applied to every token with its combine weight (0 where not routed): memory O(T d + rows cols).

def _layer_expert(w: QWeight, layer, e, fmt: int, raw_bytes: bool = False) -> jax.Array:
  """Expert `e` of layer `layer` (device tier) of an expert stack, dequantized: f32 [rows, cols]
  (raw_bytes: its blocks, uint8 [rows, row_bytes])."""
  m = w.meta
  nbytes = m.rows * quants.row_bytes(fmt, m.cols)
  slot = w.table[layer, 0].astype(jnp.int32)
  raw = jax.lax.dynamic_index_in_dim(w.data, slot, 0, keepdims=False)[:m.experts * nbytes]
  if raw.shape[0] < m.experts * nbytes:  # every layer host-tier: data is a placeholder
    raw = jnp.pad(raw, (0, m.experts * nbytes - raw.shape[0]))
  raw = jax.lax.dynamic_slice_in_dim(raw, e * nbytes, nbytes).reshape(m.rows, -1)
  return raw if raw_bytes else quants.dequantize(raw, fmt, m.cols)


def _expert_product(x: jax.Array, w: QWeight, layer, e, mode: str) -> jax.Array:
  """x f32 [T, cols] times expert e of layer `layer`: f32 [T, rows] (jaxvt.ffi.numerics.qdot)."""
  formats = w.meta.formats
  f = (w.fmts[layer] & FMT_MASK).astype(jnp.int32)
  branch = sum(jnp.where(f == t, i, 0) for i, t in enumerate(formats))
  fns = [lambda t=t: numerics.qdot(x, _layer_expert(w, layer, e, t, raw_bytes=True), t,
                                   w.meta.cols, mode) for t in formats]
  return fns[0]() if len(fns) == 1 else jax.lax.switch(branch, fns)


def experts_per_expert_ref(x, w_gate: QWeight, w_up: QWeight, w_down: QWeight, layer, ids,
                           weights, mode: str = "ggml"):
  """Same contract as ops.moe_experts_ref, one pass per expert (for many tokens). Device-tier
  layers only (NaN for a host-tier layer, like the ops references)."""
  x = x.astype(jnp.float32)
  E = w_gate.meta.experts
  comb = jnp.sum(jnp.where(ids[..., None] == jnp.arange(E), weights[..., None], 0.0), axis=1)

  def body(acc, e):
    hid = ops.silu_mul(_expert_product(x, w_gate, layer, e, mode),
                       _expert_product(x, w_up, layer, e, mode), mode)
    return acc + _expert_product(hid, w_down, layer, e, mode) * comb[:, e, None], None

  acc, _ = jax.lax.scan(body, jnp.zeros_like(x), jnp.arange(E))
  host = (w_gate.fmts[layer] & HOST_BIT) != 0
  return jnp.where(host, jnp.nan, acc)


