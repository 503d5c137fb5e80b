"""Prefill rate with host-tier expert layers copied ahead of their turn, and without (a probe).

  python tools/prefill_rate.py [--model F] [--offload-gb B] [--device-gb G] [--prompt 512]
                               [--max-context 1024] [--ahead-only] [--pattern REGEX,...]
                               [--rings N]

Loads the model once at the budget, then times the prompt's prefill (compiled and warm) under
the engine's own rule (Products.prefetch_per_expert on a GPU) and the same rule with prefetching off,
alternately, five times each; prints tok/s (the best of five) of each, the host-tier layers of
the routed experts, and whether the logits of the two are equal bit for bit. `--ahead-only`
times the engine's rule alone (best and median of five); the line ends with the device's peak
memory (GiB in use at most, of the pool). `--rings N` times one more rule, alternately with the
others: the engine's with Products.prefetch_rings N (rings taking adjacent host-tier layers in
turns), its logits checked against the engine's rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import jax
import numpy as np

import jaxvt


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/prefill_rate.py")
  ap.add_argument("--model", default=None)
  ap.add_argument("--offload-gb", default="0")
  ap.add_argument("--device-gb", type=float, default=None)
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--max-context", type=int, default=1024, help="the sweep's: prompt + 136")
  ap.add_argument("--ahead-only", action="store_true")
  ap.add_argument("--pattern", default="", help="offload patterns, e.g. exps (every routed expert)")
  ap.add_argument("--rings", type=int, default=0, help="also time Products.prefetch_rings N")
  a = ap.parse_args(argv)
  budget = a.offload_gb if a.offload_gb == "auto" else float(a.offload_gb)
  pattern = tuple(p for p in a.pattern.split(",") if p)
  with jaxvt.load(a.model, offload_gb=budget, device_gb=a.device_gb, max_context=a.max_context,
                  offload_pattern=pattern) as eng:
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, a.prompt).tolist()
    on = eng.ex
    off = dataclasses.replace(on, products=dataclasses.replace(on.products, prefetch_per_expert=0))
    host = eng.weights["moe.w_gate"].meta.host_layers if "moe.w_gate" in eng.weights else ()
    # up to 0.0001 GiB above the budget, so --offload-gb with the printed value places the same
    gib = math.ceil(eng.plan.plan.budget_bytes / 2**30 * 1e4) / 1e4 if eng.plan is not None else 0.0
    rules = [("ahead", on)]
    if a.rings:
      rules.append((f"ahead, {a.rings} rings",
                    dataclasses.replace(on, products=dataclasses.replace(
                        on.products, prefetch_rings=a.rings))))
    if not a.ahead_only:
      rules.append(("in place", off))
    rates, logits = {name: [] for name, _ in rules}, {}
    for _ in range(6):  # the first round compiles each
      for name, ex in rules:
        eng.ex = ex
        t0 = time.perf_counter()
        lg, _ = eng.prefill(ids)
        lg = np.asarray(lg)
        rates[name].append(len(ids) / (time.perf_counter() - t0))
        logits[name] = lg
    eng.ex = on
    st = jax.devices()[0].memory_stats() or {}
  best = {k: max(v[1:]) for k, v in rates.items()}
  peak = (f"; device peak {st.get('peak_bytes_in_use', 0) / 2**30:.2f} of "
          f"{st.get('bytes_limit', 0) / 2**30:.2f} GiB")
  same = all(np.array_equal(logits["ahead"], v) for v in logits.values())
  each = ", ".join(f"{k} best {best[k]:.1f} median {float(np.median(v[1:])):.1f} "
                   f"{[round(r, 1) for r in v[1:]]}" for k, v in rates.items())
  ratio = (f"; ratio ahead / in place {best['ahead'] / best['in place']:.3f}"
           if "in place" in best else "")
  print(f"{eng.path}: offload {budget} = budget {gib:.4f} GiB (device {a.device_gb}, context "
        f"{a.max_context}); routed experts' host-tier layers {list(host)}; prefill {a.prompt} "
        f"tok/s: {each}{ratio}; same logits: {same}{peak}")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
