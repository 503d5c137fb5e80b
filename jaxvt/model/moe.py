"""Mixture-of-experts FFN (qwen3moe, qwen35moe, qwen3next): softmax router, top-k, SwiGLU experts,
optional shared expert behind a sigmoid gate.

  p = softmax(router x)            over all experts, float32
  ids, wts = top_k(p)              renormalised to sum 1 when cfg.norm_topk_prob
  y = sum_k wts_k * down_e(silu(gate_e x) * up_e x)           (routed experts, e = ids_k)
    + sigmoid(shexp_gate . x) * down_s(silu(gate_s x) * up_s x)  (shared expert, if any)

The router and the routed experts are the backend's ops (Exec.backend, jaxvt.ffi.backend: the
kernels read only the routed experts' bytes, from either memory tier); where host-tier experts
are read from is the offload schedule's (Exec.schedule). Letters: T tokens, k routed slots,
e experts, f expert hidden, d model dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxvt.model import layers
from jaxvt.model.config import ModelConfig
from jaxvt.model.layers import Exec
from jaxvt.model.axes import AXES


def route(logits: jax.Array, k: int, renormalise: bool, ex: Exec) -> tuple[jax.Array, jax.Array]:
  """Router logits [T, E] -> (ids int32 [T, k], weights float32 [T, k]): softmax, top k,
  renormalised when asked (the backend's route: jaxvt.ffi.backend)."""
  return ex.backend.route(logits, k, renormalise, ex)


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


def _one_device(ex: Exec) -> bool:
  return ex.par is None or ex.par.size == 1


def gated_terms(cfg: ModelConfig, ex: Exec) -> bool:
  """Whether moe_block returns its shared expert as a gated term (Terms.s, Terms.g) for the
  residual add (layers.add_norm) rather than summed into y: with a shared expert, on one device
  (on a mesh the two are summed before the one psum they share)."""
  return bool(cfg.shared_ffn_dim) and _one_device(ex)


def slots_apart(cfg: ModelConfig, ex: Exec, n_tokens: int) -> bool:
  """Whether moe_block returns its k routed outputs unsummed (Terms.y [..., k, d] with their
  weights Terms.c) for the fused residual add to weight and sum: where the backend fuses that
  add, on one device, where the routed experts of n_tokens tokens take the per-slot kernels."""
  return (ex.backend.fused("norm", ex) and _one_device(ex)
          and ex.backend.slots_apart(ex, n_tokens, cfg.n_experts_used, cfg.n_experts))


def no_terms(x: jax.Array, cfg: ModelConfig, ex: Exec) -> layers.Terms:
  """moe_block's terms for x [b, t, d] adding nothing (the same form)."""
  b, t, d = x.shape
  k = cfg.n_experts_used
  apart = slots_apart(cfg, ex, b * t)
  zero = lambda *shape: jnp.zeros(shape, x.dtype)
  gated = gated_terms(cfg, ex)
  return layers.Terms(y=zero(b, t, k, d) if apart else zero(b, t, d),
                      c=zero(b, t, k) if apart else None, s=zero(b, t, d) if gated else None,
                      g=zero(b, t) if gated else None)


def moe_block(h: jax.Array, w: dict, li, cfg: ModelConfig, ex: Exec, state=None, slot: int = 0,
              valid: jax.Array | None = None, gate_logit: jax.Array | None = None):
  """MoE FFN of layer `li` (traced int32 index into the stacks): h [b, t, d] (already normed) ->
  (layers.Terms, state): y, the routed experts' weighted sum (float32 [b, t, d]); where
  slots_apart, their k outputs [b, t, k, d] with their weights c [b, t, k] instead; where
  gated_terms, the shared expert's output s [b, t, d] and its gate logit g [b, t] beside them
  (on a mesh, summed into y). gate_logit [b, t]: the shared expert's gate logit h . shexp.gate,
  where the caller computed it (jaxvt.ffi.norm's fused step); None computes it here. `state` is
  the offload schedule's (Exec.schedule; None without one), threaded through its hooks
  untouched: they say which extra stacks the router's launch multiplies, where the routed
  stacks are read from and what moves after the products. `slot`: the layer's place in its
  period. valid [b, t] bool or None: a padding token (False) is routed
  to no expert (its output is 0), so a bucketed prefill reads only its real tokens' experts."""
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
    ids, wts = route(logits, cfg.n_experts_used, cfg.norm_topk_prob, ex)
    if valid is not None:
      ids = jnp.where(valid.reshape(b * t, 1), ids, -1)
    if sched:
      state, pred = sched.after_route(state, w, li, slot, more[:len(extra)], ex)
    if ex.par is not None and ex.par.size > 1:  # the experts are split over the whole mesh
      ids, wts = local_experts(ids, wts, w["moe.w_gate"].meta.experts)
  with jax.named_scope("experts"):
    apart = slots_apart(cfg, ex, b * t)
    routed = ex.backend.experts(ex, b * t, cfg.n_experts_used, cfg.n_experts, combined=not apart)
    views, kw, layer = (sched.experts(state, w, li, slot, ids) if sched else
                        ({n: w[n] for n in ROUTED}, {}, None))
    (wg, lg), (wu, _), (wd, _) = (views[n].layer_view(li) for n in ROUTED)
    y = routed(x, wg, wu, wd, lg, ids, wts, **kw)  # sharded: this device's experts' partial sum
    k = cfg.n_experts_used
    terms = (layers.Terms(y=y.reshape(b, t, k, d), c=wts.reshape(b, t, k)) if apart else
             layers.Terms(y=y.reshape(b, t, d)))
    if sched:
      state = sched.after_experts(layer, w, li, pred, ex)
  if cfg.shared_ffn_dim:
    with jax.named_scope("shared_expert"):
      s = layers.swiglu_down(gu[0], gu[1], w["shexp.w_down"], li, ex)
      if gate_logit is None:
        # x through the backend's barrier: with kernels XLA:GPU otherwise fuses this dot into the
        # fusion that forms x (the residual's norm), a slower multi-output reduction
        xg = ex.backend.fusion_barrier(x)
        gate_logit = ex.backend.rowdot(xg, w["shexp.gate"][li], ex)  # [T]
      if gated_terms(cfg, ex):
        return terms._replace(s=s.reshape(b, t, d), g=gate_logit.reshape(b, t)), state
      gate = jax.nn.sigmoid(gate_logit.reshape(b * t))
      if ex.par is not None and ex.par.ep > 1:  # s is split over tp only, the experts over both
        y = layers.reduce(y, ex, experts=True) + gate[:, None] * layers.reduce(s, ex)
        return layers.Terms(y=y.reshape(b, t, d)), state
      y = y + gate[:, None] * s  # (one psum for both when experts and s split over tp alone)
      return layers.Terms(y=layers.reduce(y, ex, experts=True).reshape(b, t, d)), state
  if apart:
    return terms, state
  return layers.Terms(y=layers.reduce(y, ex, experts=True).reshape(b, t, d)), state
