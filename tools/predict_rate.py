"""Decode rate with the next host-tier layer's likeliest experts copied ahead, by variant (a probe).

  python tools/predict_rate.py [--model F] [--offload-gb B] [--device-gb G] [--tokens 128]
                               [--variants off,2:6,2:4,3:8] [--rounds 3] [--prompt 512]
                               [--max-context 1024] [--pattern exps]

Loads the model once at the budget (max context 1024 by default, the sweep's), then generates
--tokens greedy tokens after a --prompt-token prompt under each variant H:D[:S][@B][/K][+c] of
Products.predict_after_host : predict_after_device [: predict_sets]
("off": 0:0; @B the inline fetch with B blocks an expert; /K the counts scaled per layer for K
host-tier routed stacks, predict_scale; +c XLA's concurrent command-buffer scheduling:
jaxvt.bench.profile.predict_exec), in rounds (each variant once a round, the first round
compiles), and prints each variant's decode tok/s (the best round, and every round), its first
round's seconds (the programs' compile with it), the routed experts' host-tier layers, and
whether its tokens equal the first variant's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import jaxvt
from jaxvt.bench.arms import no_stops
from jaxvt.bench.profile import predict_exec


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/predict_rate.py")
  ap.add_argument("--model", default=None)
  ap.add_argument("--offload-gb", default="0")
  ap.add_argument("--device-gb", type=float, default=None)
  ap.add_argument("--tokens", type=int, default=128)
  ap.add_argument("--variants", default="off,2:6")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--max-context", type=int, default=1024)
  ap.add_argument("--pattern", default="", help="offload patterns, e.g. exps (every routed expert)")
  a = ap.parse_args(argv)
  budget = a.offload_gb if a.offload_gb == "auto" else float(a.offload_gb)
  names = a.variants.split(",")
  pattern = tuple(p for p in a.pattern.split(",") if p)
  with no_stops(jaxvt.load(a.model, offload_gb=budget, device_gb=a.device_gb,
                           max_context=a.max_context, offload_pattern=pattern)) as eng:
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, a.prompt).tolist()
    base = eng.ex
    exs = {}
    for n in names:
      exs[n] = predict_exec(base, n)
    host = {n[6:]: list(eng.weights[n].meta.host_layers)
            for n in ("moe.w_gate", "moe.w_up", "moe.w_down") if n in eng.weights}
    gib = math.ceil(eng.plan.plan.budget_bytes / 2**30 * 1e4) / 1e4 if eng.plan is not None else 0.0
    rates = {n: [] for n in names}
    toks, first_s = {}, {}
    for _ in range(a.rounds + 1):  # the first round compiles each
      for n in names:
        eng.ex = exs[n]
        t0 = time.perf_counter()
        g = eng.generate(ids, max_tokens=a.tokens)
        first_s.setdefault(n, time.perf_counter() - t0)
        rates[n].append(g.stats.decode_tok_s)
        toks[n] = g.tokens
    eng.ex = base
  first = names[0]
  print(f"{eng.path}: offload {budget} = budget {gib:.4f} GiB (device {a.device_gb}); routed "
        "experts' host-tier layers: " + "; ".join(f"{n} {h} ({len(h)})" for n, h in host.items()))
  ok = True
  for n in names:
    same = toks[n] == toks[first]
    ok &= same
    print(f"  predict {n:>5}: decode {max(rates[n][1:]):7.2f} tok/s "
          f"{[round(r, 2) for r in rates[n][1:]]}; x{max(rates[n][1:]) / max(rates[first][1:]):.3f}"
          f" of {first}; first round {first_s[n]:.2f} s; same tokens as {first}: {same}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
