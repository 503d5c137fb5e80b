"""How predictable a MoE model's routing is during decode: could an expert cache or a prefetch
hide the host tier's link time (#14)?

  python tools/routing_probe.py --model F [--tokens 64] [--prompt TEXT]

Runs greedy decode on the CPU, one decode program a token (Engine.decode_step), with every MoE
block's router input (the normed x) and logits recorded (a jax.debug.callback wrapped around
jaxvt.model.moe.moe_block; the compilation cache and export store off, so the recorded program
is the one traced here), then reports per layer, over the decode tokens:

  * reuse: the share of a token's top-k experts that the previous token also used;
  * an LRU cache of C experts per layer, filled by the experts used: its hit rate;
  * prediction from the layer before: top-k (and top-2k) of layer L+1's router applied to layer
    L's router input (known before layer L's experts run): the share of layer L+1's actual
    top-k among them; and the share of the 2 and 4 most likely predicted experts that layer
    L+1 then uses (what a prefetch of that many would waste);
  * prediction from two layers before (layer L+2's router on layer L's input, a copy with two
    layers of compute to hide behind): the share of its 2 and 4 most likely that L+2 uses;
  * chance: k / E.

The router weights come from the file (F32); nothing else is approximated.
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--model", required=True)
  p.add_argument("--tokens", type=int, default=64)
  p.add_argument("--prompt", default="The capital of France is")
  a = p.parse_args(argv)

  import jax
  import jaxvt
  from jaxvt.gguf.reader import open_gguf
  from jaxvt.model import moe

  calls = []  # (layer, x [T, d], logits [T, E]) in call order
  stash = []
  orig_route, orig_block = moe.route, moe.moe_block

  def route(logits, *args, **kwargs):
    stash.append(logits)
    return orig_route(logits, *args, **kwargs)

  def block(h, w, li, cfg, ex, rings=None, ring_set=0):
    stash.clear()
    out = orig_block(h, w, li, cfg, ex, rings, ring_set)
    x = h.reshape(-1, h.shape[-1]).astype(np.float32)
    jax.debug.callback(lambda l, xx, lg: calls.append((int(l), np.asarray(xx), np.asarray(lg))),
                       li, x, stash[0])
    return out

  moe.route, moe.moe_block = route, block
  eng = jaxvt.load(a.model, max_context=max(256, a.tokens + 64), compile_cache=False)
  cfg = eng.cfg
  k, E, L = cfg.n_experts_used, cfg.n_experts, cfg.n_layers
  ids = eng.tokenizer.encode(a.prompt)
  logits, cache = eng.prefill(ids)
  by_layer = collections.defaultdict(list)  # layer -> [(x [d], logits [E])], one per token
  for t in range(a.tokens):  # greedy, one decode program a token: its records are its own
    token = int(np.argmax(np.asarray(logits)))
    calls.clear()
    logits, cache = eng.decode_step(cache, token, len(ids) + t)
    np.asarray(logits)  # the step (and its callbacks) done
    layers = sorted(l for l, _, _ in calls)
    if layers != list(range(L)):
      raise SystemExit(f"token {t}: MoE blocks recorded for layers {layers}, not 0..{L - 1}")
    for l, x, lg in calls:
      by_layer[l].append((x[0], lg[0]))
  n = a.tokens
  topk = lambda v, m=k: set(np.argsort(-v, kind="stable")[:m].tolist())
  used = {l: [topk(lg) for _, lg in by_layer[l][:n]] for l in range(L)}
  gf = open_gguf(a.model)
  R = {l: np.asarray(gf.tensors[f"blk.{l}.ffn_gate_inp.weight"].data, np.float32).reshape(E, -1)
       for l in range(L)}
  print(f"{a.model}: {L} layers, top-{k} of {E} experts, {n} greedy decode tokens after "
        f"{len(ids)} prompt tokens; chance {k / E:.3f}")
  print("| layer | reuse from the token before | LRU 16 | LRU 32 | LRU 64 | predicted from the "
        f"layer before, top {k} | top {2 * k} | top 2 used | top 4 used | two layers before, "
        "top 2 used | top 4 used |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for l in range(L):
    reuse = np.mean([len(used[l][t] & used[l][t - 1]) / k for t in range(1, n)])
    lru = []
    for C in (16, 32, 64):
      cache, hits = collections.OrderedDict(), 0
      for t in range(n):
        for e in sorted(used[l][t]):
          if e in cache:
            hits += 1
            cache.move_to_end(e)
          else:
            cache[e] = True
            if len(cache) > C:
              cache.popitem(last=False)
      lru.append(hits / (n * k))
    pred = ["-"] * 4
    if l > 0:
      guess = [R[l] @ by_layer[l - 1][t][0] for t in range(n)]
      pred = [f"{np.mean([len(topk(guess[t], m) & used[l][t]) / k for t in range(n)]):.3f}"
              for m in (k, 2 * k)]
      pred += [f"{np.mean([len(topk(guess[t], m) & used[l][t]) / m for t in range(n)]):.3f}"
               for m in (2, 4)]
    pred += ["-"] * 2
    if l > 1:
      guess2 = [R[l] @ by_layer[l - 2][t][0] for t in range(n)]
      pred[4:] = [f"{np.mean([len(topk(guess2[t], m) & used[l][t]) / m for t in range(n)]):.3f}"
                  for m in (2, 4)]
    print(f"| {l} | {reuse:.3f} | " + " | ".join([f"{h:.3f}" for h in lru] + pred) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
