"""Mixture-of-experts FFN (qwen3moe, qwen35moe, qwen3next): softmax router, top-k, SwiGLU experts,
optional shared expert behind a sigmoid gate.

  p = softmax(router x)            over all experts, float32
  ids, wts = top_k(p)              renormalised to sum 1 when cfg.norm_topk_prob
  y = sum_k wts_k * down_e(silu(gate_e x) * up_e x)           (routed experts, e = ids_k)
    + sigmoid(shexp_gate . x) * down_s(silu(gate_s x) * up_s x)  (shared expert, if any)

The router is `route` (on a GPU one custom call, ops.moe_route: Exec.products.fused_route).
The routed experts go through `jaxvt.ffi.ops.moe_experts` (kernels: reads only the routed
experts' bytes, from either memory tier; for many slots on a GPU `grouped.moe_grouped`, the slots
sorted by expert and multiplied on tensor cores, Exec.products) or, without kernels, its jnp
reference (few tokens) or a one-pass-per-expert reference (many tokens; see below). Letters:
T tokens, k routed slots, e experts, f expert hidden, d model dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxvt.ffi import grouped, numerics, ops
from jaxvt.gguf import quants
from jaxvt.model import layers
from jaxvt.model.config import ModelConfig
from jaxvt.model.layers import Exec
from jaxvt.model.axes import AXES
from jaxvt.qweight import FMT_MASK, HOST_BIT, QWeight


def route(logits: jax.Array, k: int, renormalise: bool,
          fused: bool = False) -> tuple[jax.Array, jax.Array]:
  """Router logits [T, E] -> (ids int32 [T, k], weights float32 [T, k]): softmax, top k,
  renormalised when asked. fused: one custom call (ops.moe_route; Products.fused_route), else its
  jnp reference ops.moe_route_ref (whose arithmetic the CPU's llama.cpp checks match)."""
  return (ops.moe_route if fused else ops.moe_route_ref)(logits, k, renormalise)


# ---------------------------------------------------------------------------------------------
# Reference path for the routed experts.
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


def _routed(ex: Exec, n_tokens: int, k: int, n_experts: int):
  """fn(x, w_gate, w_up, w_down, layer, ids, weights) for the routed experts of n_tokens tokens:
  with kernels, the grouped kernel (many slots on a GPU, Exec.products) or the matvec kernels;
  without, the gathered reference (few slots) or one pass per expert."""
  if ex.kernels and ex.products.experts(n_tokens * k) == "grouped":
    return grouped.moe_grouped
  if ex.kernels:
    fn = ops.moe_experts
  else:
    fn = ops.moe_experts_ref if n_tokens * k <= n_experts else experts_per_expert_ref
  return functools.partial(fn, mode=ex.numerics)


def local_experts(ids: jax.Array, wts: jax.Array, n_local: int) -> tuple[jax.Array, jax.Array]:
  """Inside a shard_map whose devices hold experts [i * n_local, (i + 1) * n_local) (i: the
  device's index over ("ep", "tp")): global expert ids -> local ids. A slot routed to another
  device's experts gets id -1 (routed nowhere: the experts kernels read nothing for it and give
  0) and weight 0; the psum over the mesh adds the other devices' slots. (Routing those slots to
  a local expert with weight 0 would be correct too, but that expert would then serve half of a
  prefill's slots on each device, 16 at a time.)"""
  local = ids - jax.lax.axis_index(AXES) * n_local
  mine = (local >= 0) & (local < n_local)
  return jnp.where(mine, local, -1), jnp.where(mine, wts, 0.0)


ROUTED = ("moe.w_gate", "moe.w_up", "moe.w_down")


def moe_block(h: jax.Array, w: dict, li, cfg: ModelConfig, ex: Exec, state=None, slot: int = 0):
  """MoE FFN of layer `li` (traced int32 index into the stacks): h [b, t, d] (already normed) ->
  (float32 [b, t, d], state). `state` is the offload schedule's (Exec.schedule; None without
  one), threaded through its hooks untouched: they say which extra stacks the router's launch
  multiplies, where the routed stacks are read from and what moves after the products. `slot`:
  the layer's place in its period."""
  b, t, d = h.shape
  x = h.reshape(b * t, d).astype(jnp.float32)
  sched = ex.schedule if state is not None else None
  with jax.named_scope("router"):
    # The router, the schedule's extra stacks and the shared expert's gate / up read the same x:
    # one launch where they can.
    shared = ["shexp.w_gate", "shexp.w_up"] if cfg.shared_ffn_dim else []
    extra = list(sched.router_inputs(state, slot)) if sched else []
    logits, *more = layers.linear_many(x, [w[n] for n in ["moe.router", *extra, *shared]], li, ex)
    gu = more[len(extra):]
    # Whole [T, E] logits on every device (the router is replicated), routed before the split.
    fused = ex.kernels and ex.products.fused_route
    ids, wts = route(logits, cfg.n_experts_used, cfg.norm_topk_prob, fused=fused)
    if sched:
      state, pred = sched.after_route(state, w, li, slot, more[:len(extra)], ex)
    if ex.par is not None and ex.par.size > 1:  # the experts are split over the whole mesh
      ids, wts = local_experts(ids, wts, w["moe.w_gate"].meta.experts)
  with jax.named_scope("experts"):
    routed = _routed(ex, b * t, cfg.n_experts_used, cfg.n_experts)
    views, kw, layer = sched.experts(state, w, li, slot) if sched else ({n: w[n] for n in ROUTED},
                                                                         {}, None)
    (wg, lg), (wu, _), (wd, _) = (views[n].layer_view(li) for n in ROUTED)
    y = routed(x, wg, wu, wd, lg, ids, wts, **kw)  # sharded: this device's experts' partial sum
    if sched:
      state = sched.after_experts(layer, w, li, pred, ex)
  if cfg.shared_ffn_dim:
    with jax.named_scope("shared_expert"):
      s = layers.swiglu_down(gu[0], gu[1], w["shexp.w_down"], li, ex)
      # x through a barrier: XLA:GPU otherwise fuses this dot into the fusion that forms x (the
      # residual's norm), a slower multi-output reduction; the value is the same
      xg = jax.lax.optimization_barrier(x) if ex.kernels else x
      gate = jax.nn.sigmoid(jnp.dot(xg, w["shexp.gate"][li].astype(jnp.float32),
                                    precision=jax.lax.Precision.HIGHEST))  # [T]
      if ex.par is not None and ex.par.ep > 1:  # s is split over tp only, the experts over both
        y = layers.reduce(y, ex, experts=True) + gate[:, None] * layers.reduce(s, ex)
        return y.reshape(b, t, d), state
      y = y + gate[:, None] * s  # (one psum for both when experts and s split over tp alone)
  return layers.reduce(y, ex, experts=True).reshape(b, t, d), state
