"""How many of the experts copied ahead a decode step then routes to (a probe).

  python tools/predict_hits.py [--model F] [--offload-gb B] [--device-gb G] [--predict 2:4]
                               [--tokens 32] [--max-context 256]

Loads the model at the budget, prefills a 64-token prompt, then runs --tokens greedy decode steps
of jaxvt.model.decoder.forward with Products.predict_after_* set, recording (ordered debug
callbacks) every MoE layer's routed experts and every expert fetch's target and ring header
(the predicted experts it asked for). Prints, over the host-tier layers that received a fetch,
the mean count of experts asked for, of those the layer then routed to (hits), and the hits'
share of the layer's routed slots; and per layer kind (after a host-tier / a device-tier layer).
"""

from __future__ import annotations

import argparse
import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxvt
from jaxvt.bench.profile import predict_exec
from jaxvt.ffi import prefetch
from jaxvt.model import decoder, moe


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/predict_hits.py")
  ap.add_argument("--model", default=None)
  ap.add_argument("--offload-gb", type=float, default=0.0)
  ap.add_argument("--device-gb", type=float, default=None)
  ap.add_argument("--predict", default="2:4")
  ap.add_argument("--tokens", type=int, default=32)
  ap.add_argument("--max-context", type=int, default=256)
  a = ap.parse_args(argv)
  events: list[tuple] = []
  route, fetch = moe.route, prefetch.fetch_experts

  def routed(logits, k, renormalise, fused=False):
    ids, w = route(logits, k, renormalise, fused)
    if renormalise or k == cfg.n_experts_used:  # the layer's own routing (not a prediction)
      jax.debug.callback(lambda i: events.append(("route", np.asarray(i).reshape(-1).tolist())),
                         ids, ordered=True)
    return ids, w

  def fetched(rings, ws, target, ids, after=None, **kw):
    out = fetch(rings, ws, target, ids, after, **kw)
    head = next(iter(out.values()))[:96]
    jax.debug.callback(lambda t, h: events.append(("fetch", int(t), np.asarray(h).copy())),
                       jnp.asarray(target), head, ordered=True)
    return out

  with jaxvt.load(a.model, offload_gb=a.offload_gb, device_gb=a.device_gb,
                  max_context=a.max_context, force=True) as eng:
    cfg = eng.cfg
    ex = predict_exec(eng.ex, a.predict)
    host = set(eng.weights["moe.w_gate"].meta.host_layers)
    ids = np.random.default_rng(0).integers(10, cfg.vocab_size - 10, 64).tolist()
    logits, cache = eng.prefill(ids)
    moe.route, prefetch.fetch_experts = routed, fetched
    try:
      step = jax.jit(lambda w, c, t, p: decoder.forward(w, c, t, p, cfg, ex, a.max_context))
      pos = len(ids)
      tok = int(np.argmax(np.asarray(logits)))
      for _ in range(a.tokens):
        lg, cache = step(eng.weights, cache, jnp.asarray([[tok]], jnp.int32),
                         jnp.asarray([[pos]], jnp.int32))
        tok, pos = int(np.argmax(np.asarray(lg)[0, -1])), pos + 1
    finally:
      moe.route, prefetch.fetch_experts = route, fetch
  jax.effects_barrier()
  # walk the events: a layer's routing, then the fetches its block made (targets layer + 1)
  stats = collections.defaultdict(lambda: [0, 0, 0, 0])  # kind -> [layers, asked, hits, slots]
  pending: dict[int, list[int]] = {}  # target layer -> the experts asked for
  layer = -1
  for ev in events:
    if ev[0] == "fetch":
      _, t, h = ev
      i32 = h.view(np.int32)
      if i32[1] == t and i32[2] > 0:
        pending[t] = [e for e in i32[8:8 + i32[2]].tolist() if e >= 0]
      continue
    layer = (layer + 1) % cfg.n_layers
    asked = pending.pop(layer, None)
    if asked is None or layer not in host:
      continue
    kind = "after host" if layer - 1 in host else "after device"
    s = stats[kind]
    s[0] += 1
    s[1] += len(asked)
    s[2] += len(set(asked) & set(ev[1]))
    s[3] += len(ev[1])
  print(f"{eng.path}: predict {a.predict}; {a.tokens} tokens; host-tier layers of the routed "
        f"experts {sorted(host)}")
  for kind, (n, asked, hits, slots) in sorted(stats.items()):
    print(f"  {kind}: {n} layer steps; asked {asked / n:.2f} experts, routed to {hits / n:.2f} "
          f"of them ({hits / max(asked, 1):.0%}); {hits / max(slots, 1):.0%} of the routed slots")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
