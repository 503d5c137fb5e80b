"""When host-tier routed experts move to the device: the schedule wrapped around the MoE block.

The model (jaxvt.model.moe) says what a MoE layer computes; this module decides where the
routed experts' bytes are read from. Two moves, both reading the same bytes the in-place kernels
would, so the logits do not change:

- prefill (many tokens): each host-tier layer of a routed stack is copied whole into a device
  ring ahead of its turn while the layers before it compute (`start_rings`; a stack whose
  host-tier layers include adjacent ones takes them in turns in `ring_parts` rings);
- decode (one token): layer l + 1's router applied to layer l's MoE input names the experts
  l + 1 will likely use; where l + 1 is a host-tier layer its likeliest experts are copied into
  expert rings before it runs (`start_expert_rings`, the router seen one layer on: `next_router`).

With an expert cache in the weights (jaxvt.offload.expert_cache; calls of few routed slots:
decode's, and a prefill short enough for Products.routed_per_expert) each host-tier layer's call
first decides which of its experts the cache holds (`expert_cache.assign`), and its experts
kernels read those from the cache and fill it with the others as they read them (each expert a
call fills crosses the bus once, however many of its tokens route to it).

`ExpertSchedule` is what the model calls (through `Exec.schedule`): `begin` before the layer scan
returns the weights it reads and the state (`Rings`, a pytree carried through the scan), the
per-layer hooks thread that state, and `end` joins the copies still under way. How much moves is
the device's tuning row (jaxvt.ffi.tuning.Products).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxvt.ffi import expert_cache, prefetch
from jaxvt.model.config import ModelConfig
from jaxvt.model.moe import route
from jaxvt.offload.expert_cache import CACHE
from jaxvt.qweight import QWeight

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


def prefetched(w: dict, cfg: ModelConfig, ex, n_tokens: int) -> tuple[str, ...]:
  """The routed-expert stacks whose host-tier layers a call of n_tokens tokens copies to the
  device ahead of their turn (Products.prefetch_per_expert; one device)."""
  p = ex.products.prefetch_per_expert
  slots = n_tokens * cfg.n_experts_used
  if (not cfg.is_moe or not ex.kernels or not p or slots < p * cfg.n_experts
      or ex.products.routed(slots, cfg.n_experts) or (ex.par is not None and ex.par.size > 1)):
    return ()
  # a weight type that moves layers itself (a benchmark's comparison arm) keeps its own path
  return tuple(n for n in ROUTED if type(w[n]) is QWeight and w[n].meta.any_host)


def predicted(w: dict, cfg: ModelConfig, ex, n_tokens: int) -> tuple[str, ...]:
  """The routed-expert stacks whose host-tier layers a call of n_tokens tokens reads partly from
  decode expert rings (Products.predict_after_host / predict_after_device; one token, one device,
  the per-slot experts kernels)."""
  p = ex.products
  if (not cfg.is_moe or not ex.kernels or n_tokens != 1
      or not (p.predict_after_host or p.predict_after_device)
      or p.experts(cfg.n_experts_used, cfg.n_experts) != "matvec"
      or (ex.par is not None and ex.par.size > 1)):
    return ()
  return tuple(n for n in ROUTED if type(w[n]) is QWeight and w[n].meta.any_host)


def cached(w: dict, cfg: ModelConfig, ex, n_tokens: int) -> bool:
  """Whether a call of n_tokens tokens reads host-tier routed experts through the expert cache
  the weights carry: few enough routed slots for the per-slot experts kernels (a decode step, a
  batch of them, or a prefill short enough for Products.routed_per_expert), no layer rings
  (prefill copies whole layers instead), one device."""
  slots = n_tokens * cfg.n_experts_used
  return (CACHE in w and cfg.is_moe and bool(ex.kernels) and slots < expert_cache.MAX_CALL_SLOTS
          and ex.products.experts(slots, cfg.n_experts) == "matvec"
          and not prefetched(w, cfg, ex, n_tokens)
          and (ex.par is None or ex.par.size == 1))


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


class _Layer(NamedTuple):
  """One MoE layer's view of the state between the hooks."""
  rings: Rings
  slot: int  # the layer's place in its period: picks the expert ring set it reads
  read: dict  # the experts kernels' outputs by product ("gate_up", "down"): a ring's last reader


@dataclasses.dataclass(frozen=True)
class ExpertSchedule:
  """The hooks jaxvt.model.moe.moe_block calls (Exec.schedule), and the scan's begin and end.
  Static and hashable; what it does is read from the Exec's tuning row."""

  def begin(self, w: dict, cfg: ModelConfig, ex, n_tokens: int, period: int):
    """Before the layer scan of a call of n_tokens tokens over a period of `period` layers:
    (the weights the scan reads, the state it carries). Two sets of expert rings alternate by
    layer where a period's layers are even (a layer's parity is then its place in the period's)."""
    sets = 2 if period % 2 == 0 and ex.products.predict_sets == 2 else 1
    use_cache = cached(w, cfg, ex, n_tokens)
    if CACHE in w and not use_cache:  # the call reads the host tier as without a cache
      w = {k: v for k, v in w.items() if k != CACHE}
    predict = () if use_cache and not ex.products.predict_with_cache else predicted(
        w, cfg, ex, n_tokens)
    rings = Rings(start_rings(w, prefetched(w, cfg, ex, n_tokens), ex.products.prefetch_rings),
                  start_expert_rings(w, predict, sets))
    return (next_router(w) if rings.experts else w), rings

  def end(self, x: jax.Array, rings: Rings) -> jax.Array:
    """After the scan: x once every copy has landed."""
    return join_rings(x, rings)

  def router_inputs(self, rings: Rings, slot: int) -> tuple[str, ...]:
    """The stacks the layer's router launch multiplies by x beside the router (decode's next
    router where experts are predicted)."""
    return (NEXT_ROUTER,) if rings.experts and rings.experts[slot % len(rings.experts)] else ()

  def after_route(self, rings: Rings, w: dict, li, slot: int, extra: list, ex):
    """After the router: where this layer predicts the next one's experts, their ids (and, with
    two ring sets, the copy into the set no layer reads now). Returns (rings, predicted ids)."""
    if not extra:
      return rings, None
    p = ex.products
    pred, _ = route(extra[0], p.predicted_ids(), False, ex)
    sets = list(rings.experts)
    if len(sets) == 2:  # the other set has no reader left: after a device-tier layer, now
      into = (slot + 1) % 2
      sets[into] = prefetch.fetch_experts(sets[into], w, li + 1, pred[0], after=pred,
                                          n_host=p.predict_after_host,
                                          n_device=p.predict_after_device, when="after_device",
                                          inline=p.predict_inline, blocks=p.predict_blocks,
                                          scale=p.predict_scale)
    return rings._replace(experts=tuple(sets)), pred

  def experts(self, rings: Rings, w: dict, li, slot: int, ids):
    """The routed stacks layer `li` reads (a ring's copy where one holds it; waits on the
    device for that copy) and the experts kernels' extra arguments (with an expert cache: its
    decisions for the routed `ids`). Returns (views by name, kwargs, the layer's state for
    after_experts)."""
    views = {n: w[n] for n in ROUTED}
    lr = dict(rings.layers)
    for n in lr:
      got = []
      for r in lr[n]:
        r, views[n] = prefetch.take(r, views[n], li)
        got.append(r)
      lr[n] = got
    sets = rings.experts
    xr = sets[slot % len(sets)] if sets else {}
    read = {}
    kw = {"on_read": read.__setitem__} if lr or xr else {}
    if xr:
      kw["rings"] = {STAGE[n]: r for n, r in xr.items()}
    if CACHE in w:
      kw["cache"] = w[CACHE].operands(expert_cache.assign(ids, li, w[CACHE].stab))
    return views, kw, _Layer(rings._replace(layers=lr), slot, read)

  def after_experts(self, layer: _Layer, w: dict, li, pred, ex) -> Rings:
    """After the experts' products: each ring that held layer li fetches its stack's next
    host-tier layer (gate's and up's as soon as their product is done, while down's runs), and
    the predicted experts of layer li + 1 are fetched after the down product."""
    rings, read = layer.rings, layer.read
    lr = rings.layers
    for n in lr:
      after, parts = read["down" if n == "moe.w_down" else "gate_up"], len(lr[n])
      to = [jnp.asarray(prefetch.schedule(w[n].meta, k, parts)[1])[li] for k in range(parts)]
      lr[n] = tuple(prefetch.fetch(r, w[n], to[k], after=after, part=k, parts=parts)
                    for k, r in enumerate(lr[n]))
    sets = list(rings.experts)
    if sets and sets[layer.slot % len(sets)]:
      p = ex.products
      into = (layer.slot + 1) % len(sets)
      sets[into] = prefetch.fetch_experts(sets[into], w, li + 1, pred[0], after=read["down"],
                                          n_host=p.predict_after_host,
                                          n_device=p.predict_after_device,
                                          when="after_host" if len(sets) == 2 else "any",
                                          inline=p.predict_inline, blocks=p.predict_blocks,
                                          scale=p.predict_scale)
    return Rings(lr, tuple(sets))
