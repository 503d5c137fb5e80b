"""Warm prefill times of short prompts under several product rules (layers.Products), in one
process on one loaded model: which kernel each product of a 16-64 token prompt should take.

  python tools/prefill_rules.py MODEL.gguf [--tokens 16,32,64,128] [--offload-gb G --device-gb D]

With --offload-gb the same rules run with host-tier layers: the rule cannot look at the tier
(tokens must not depend on the budget), so a crossover has to suit both tiers.

For each rule and prompt length: the best of 3 warm prefills (after one that compiles), ms and
tok/s. The first rule is the engine's own (GPU_PRODUCTS); the others change a crossover.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

import jaxvt
from jaxvt.model.layers import GPU_PRODUCTS, Products


def _p(**kw) -> Products:
  return dataclasses.replace(GPU_PRODUCTS, **kw)


RULES = {
    "now": GPU_PRODUCTS,
    "grouped>=1024": _p(grouped_slots=1024),
    "grouped>=128": _p(grouped_slots=128),
    "stage>=32": _p(stage_rows=32),
    "tiled>=16 stage>=64": _p(tiled_rows=16, stage_rows=64),
}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("model")
  p.add_argument("--tokens", default="16,32,64,128")
  p.add_argument("--offload-gb", default=0.0)
  p.add_argument("--device-gb", type=float, default=None)
  a = p.parse_args()
  off = a.offload_gb if a.offload_gb == "auto" else float(a.offload_gb)
  eng = jaxvt.load(a.model, max_context=1024, offload_gb=off, device_gb=a.device_gb, force=True)
  rng = np.random.default_rng(0)
  lens = [int(t) for t in a.tokens.split(",")]
  prompts = {n: rng.integers(10, eng.cfg.vocab_size - 10, n).tolist() for n in lens}
  print(f"offload {eng.plan.plan.host_bytes / 2**30:.2f} GiB; ms (tok/s) per warm prefill")
  print(f"{'rule':26} " + " ".join(f"{n:>16}" for n in lens))
  fields = {f.name: getattr(eng, f.name) for f in dataclasses.fields(eng) if f.init}
  for name, rule in RULES.items():
    e = type(eng)(**{**fields, "ex": dataclasses.replace(eng.ex, products=rule)})
    cells = []
    for n in lens:
      e.prefill(prompts[n])[0].block_until_ready()
      best = 1e9
      for _ in range(3):
        t = time.perf_counter()
        e.prefill(prompts[n])[0].block_until_ready()
        best = min(best, time.perf_counter() - t)
      cells.append(f"{best * 1e3:7.1f} ({n / best:6.0f})")
    print(f"{name:26} " + " ".join(f"{c:>16}" for c in cells), flush=True)
  eng.close()


if __name__ == "__main__":
  main()
