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

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxvt.ffi import grouped, numerics, ops, prefetch
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
STAGE = {"moe.w_gate": "gate", "moe.w_up": "up", "moe.w_down": "down"}
NEXT_ROUTER = "moe.router@next"  # decode's view of layer l + 1's router at index l (next_router)


class Rings(NamedTuple):
  """What a call carries through its layer scan for host-tier routed experts: `layers` (prefill:
  start_rings, whole layers copied ahead; a tuple of rings per stack) and `experts` (decode:
  start_expert_rings, the next host-tier layer's predicted experts copied ahead; one set of
  rings, or two that alternate by layer). Either may be empty."""
  layers: dict
  experts: tuple[dict, ...]


def prefetched(w: dict, cfg: ModelConfig, ex: Exec, n_tokens: int) -> tuple[str, ...]:
  """The routed-expert stacks whose host-tier layers a call of n_tokens tokens copies to the
  device ahead of their turn (Products.prefetch_per_expert; one device)."""
  p = ex.products.prefetch_per_expert
  if (not cfg.is_moe or not ex.kernels or not p or n_tokens * cfg.n_experts_used < p * cfg.n_experts
      or (ex.par is not None and ex.par.size > 1)):
    return ()
  # a weight type that moves layers itself (bench arms) keeps its own path
  return tuple(n for n in ROUTED if type(w[n]) is QWeight and w[n].meta.any_host)


def predicted(w: dict, cfg: ModelConfig, ex: Exec, n_tokens: int) -> tuple[str, ...]:
  """The routed-expert stacks whose host-tier layers a call of n_tokens tokens reads partly from
  decode expert rings (Products.predict_after_host / predict_after_device; one token, one device,
  the per-slot experts kernels)."""
  p = ex.products
  if (not cfg.is_moe or not ex.kernels or n_tokens != 1
      or not (p.predict_after_host or p.predict_after_device)
      or p.experts(cfg.n_experts_used) != "matvec" or (ex.par is not None and ex.par.size > 1)):
    return ()
  return tuple(n for n in ROUTED if type(w[n]) is QWeight and w[n].meta.any_host)


def start_expert_rings(w: dict, names: tuple[str, ...], sets: int) -> tuple[dict, ...]:
  """`sets` sets (1 or 2) of empty decode expert rings, one ring per stack of `names` (none
  without names)."""
  if not names:
    return ()
  return tuple({n: prefetch.new_expert_ring(w[n].meta) for n in names} for _ in range(sets))


def next_router(w: dict) -> dict:
  """w with NEXT_ROUTER: the router stack seen one layer on (index l reads layer l + 1's router;
  the last index wraps to layer 0, whose prediction targets no layer). Built once, outside the
  layer scan: the same data, its table and formats rolled."""
  r = w["moe.router"]
  return dict(w, **{NEXT_ROUTER: dataclasses.replace(r, table=jnp.roll(r.table, -1, axis=0),
                                                     fmts=jnp.roll(r.fmts, -1))})


def ring_parts(meta, rings: int) -> int:
  """The rings a stack's host-tier layers take turns in (Products.prefetch_rings): `rings`
  where two of its host-tier layers are adjacent (one ring could not receive the second while
  the first runs), else 1."""
  h = sorted(meta.host_layers)
  return max(1, min(rings, len(h))) if any(b - a == 1 for a, b in zip(h, h[1:])) else 1


def start_rings(w: dict, names: tuple[str, ...], rings: int = 1) -> dict:
  """name -> a tuple of rings (ring_parts of them) per stack of `names`, each already receiving
  its first host-tier layer: the copies in the order their layers are needed (one fetch after
  another: one stream copies them in the order it is asked)."""
  parts = {n: ring_parts(w[n].meta, rings) for n in names}
  first = {(n, k): prefetch.schedule(w[n].meta, k, parts[n])[0]
           for n in names for k in range(parts[n])}
  out, after = {}, None
  for n, k in sorted(first, key=lambda nk: (first[nk] < 0, first[nk])):
    out.setdefault(n, [None] * parts[n])[k] = after = prefetch.fetch(
        prefetch.new_ring(w[n].meta), w[n], first[n, k], after, first=True, part=k,
        parts=parts[n])
  return {n: tuple(r) for n, r in out.items()}


def join_rings(x: jax.Array, rings: Rings) -> jax.Array:
  """x once no copy into `rings` is still under way (prefetch.join on every ring)."""
  for r in (*(r for rs in rings.layers.values() for r in rs),
            *(r for s in rings.experts for r in s.values())):
    x = prefetch.join(x, r)
  return x


def moe_block(h: jax.Array, w: dict, li, cfg: ModelConfig, ex: Exec, rings: Rings | None = None,
              ring_set: int = 0):
  """MoE FFN of layer `li` (traced int32 index into the stacks). h [b, t, d] (already normed)
  -> float32 [b, t, d]. With `rings` returns (y, rings): rings.layers (start_rings, prefill) give
  the routed experts layer `li` from a ring where it holds it, then each ring fetches its
  stack's next host-tier layer; rings.experts[ring_set] (start_expert_rings, decode; w from
  next_router) gives them the experts it holds for `li`, and layer li + 1's most likely experts
  (its router applied to this layer's input) are fetched where li + 1 is a host-tier layer: into
  the same set after the down product, or with two sets into the other one, right after the
  router when this layer is device-tier (the bus idle), after the down product when it is
  host-tier (its own experts fill the bus until then)."""
  b, t, d = h.shape
  x = h.reshape(b * t, d).astype(jnp.float32)
  sets = () if rings is None else list(rings.experts)
  xr = sets[ring_set] if sets else {}
  into = (ring_set + 1) % len(sets) if sets else 0
  with jax.named_scope("router"):
    # The router, the next layer's (decode prediction) and the shared expert's gate / up read
    # the same x: one launch where they can.
    shared = ["shexp.w_gate", "shexp.w_up"] if cfg.shared_ffn_dim else []
    p = ex.products
    nxt = [NEXT_ROUTER] if xr else []
    logits, *more = layers.linear_many(x, [w[n] for n in ["moe.router", *nxt, *shared]], li, ex)
    gu = more[len(nxt):]
    # Whole [T, E] logits on every device (the router is replicated), routed before the split.
    fused = ex.kernels and ex.products.fused_route
    ids, wts = route(logits, cfg.n_experts_used, cfg.norm_topk_prob, fused=fused)
    if xr:  # layer li + 1's likeliest experts, most likely first
      pred, _ = route(more[0], p.predicted_ids(), False, fused)
      if len(sets) == 2:  # the other set has no reader left: after a device-tier layer, now
        sets[into] = prefetch.fetch_experts(sets[into], w, li + 1, pred[0], after=pred,
                                            n_host=p.predict_after_host,
                                            n_device=p.predict_after_device, when="after_device",
                                            inline=p.predict_inline, blocks=p.predict_blocks,
                                            scale=p.predict_scale)
    if ex.par is not None and ex.par.size > 1:  # the experts are split over the whole mesh
      ids, wts = local_experts(ids, wts, w["moe.w_gate"].meta.experts)
  with jax.named_scope("experts"):
    routed = _routed(ex, b * t, cfg.n_experts_used, cfg.n_experts)
    views = {n: w[n] for n in ROUTED}
    lr = {} if rings is None else dict(rings.layers)
    for n in lr:  # waits (on the device) for layer li's copy where a ring has it
      got = []
      for r in lr[n]:
        r, views[n] = prefetch.take(r, views[n], li)
        got.append(r)
      lr[n] = got
    (wg, lg), (wu, _), (wd, _) = (views[n].layer_view(li) for n in ROUTED)
    read = {}  # the products' outputs: a ring's last reader is done once its output exists
    kw = {"on_read": read.__setitem__} if lr or xr else {}
    if xr:
      kw["rings"] = {STAGE[n]: r for n, r in xr.items()}
    y = routed(x, wg, wu, wd, lg, ids, wts, **kw)  # sharded: this device's experts' partial sum
    for n in lr:  # then the ring that held layer li fetches its next host-tier layer: gate's
      # and up's as soon as their product is done, while down's runs
      after, parts = read["down" if n == "moe.w_down" else "gate_up"], len(lr[n])
      to = [jnp.asarray(prefetch.schedule(w[n].meta, k, parts)[1])[li] for k in range(parts)]
      lr[n] = tuple(prefetch.fetch(r, w[n], to[k], after=after, part=k, parts=parts)
                    for k, r in enumerate(lr[n]))
    if xr:  # after the down product (the last reader of this layer's rings)
      sets[into] = prefetch.fetch_experts(sets[into], w, li + 1, pred[0], after=read["down"],
                                          n_host=p.predict_after_host,
                                          n_device=p.predict_after_device,
                                          when="after_host" if len(sets) == 2 else "any",
                                          inline=p.predict_inline, blocks=p.predict_blocks,
                                          scale=p.predict_scale)
    rings = None if rings is None else Rings(lr, tuple(sets))
  if cfg.shared_ffn_dim:
    with jax.named_scope("shared_expert"):
      s = layers.swiglu_down(gu[0], gu[1], w["shexp.w_down"], li, ex)
      # x through a barrier: XLA:GPU otherwise fuses this dot into the fusion that forms x (the
      # residual's norm), a multi-output reduction of 3.8 us a layer on the H200 (2026-12-02);
      # the value is the same
      xg = jax.lax.optimization_barrier(x) if ex.kernels else x
      gate = jax.nn.sigmoid(jnp.dot(xg, w["shexp.gate"][li].astype(jnp.float32),
                                    precision=jax.lax.Precision.HIGHEST))  # [T]
      if ex.par is not None and ex.par.ep > 1:  # s is split over tp only, the experts over both
        y = layers.reduce(y, ex, experts=True) + gate[:, None] * layers.reduce(s, ex)
        y = y.reshape(b, t, d)
        return y if rings is None else (y, rings)
      y = y + gate[:, None] * s  # (one psum for both when experts and s split over tp alone)
  y = layers.reduce(y, ex, experts=True).reshape(b, t, d)
  return y if rings is None else (y, rings)
