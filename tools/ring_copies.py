"""Copies of decode's expert rings in the compiled decode step (a probe).

  python tools/ring_copies.py [--model F] [--offload-gb B] [--device-gb G] [--predict H:D[:S]]

A fetch's copy lands in its ring after the call returns (on a GPU, on a stream of jaxvt's own),
so the experts kernels must read that very buffer: a copy XLA makes of a ring (a loop carry,
say) would hold what the ring held when copied. Loads the model at the budget, compiles
engine.decode_fn with the given Products.predict_after_* and prints every instruction of the
optimized HLO that copies a buffer of a ring's size, and the count of expert fetch calls.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp

import jaxvt
from jaxvt import engine
from jaxvt.bench.profile import predict_exec
from jaxvt.ffi import prefetch
from jaxvt.model import decoder


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/ring_copies.py")
  ap.add_argument("--model", default=None)
  ap.add_argument("--offload-gb", type=float, default=0.0)
  ap.add_argument("--device-gb", type=float, default=None)
  ap.add_argument("--predict", default="2:2")
  a = ap.parse_args(argv)
  with jaxvt.load(a.model, offload_gb=a.offload_gb, device_gb=a.device_gb, max_context=256,
                  force=True) as eng:
    ex = predict_exec(eng.ex, a.predict)
    cache = jax.eval_shape(lambda: decoder.init_cache(eng.cfg, 1, 256))
    one = (jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))
    hlo = engine.decode_fn.lower(eng.weights, cache, *one, cfg=eng.cfg, ex=ex,
                                 kv_len=256).compile().as_text()
    sizes = {prefetch.XHEADER + prefetch.XSLOTS * prefetch.expert_slot_bytes(eng.weights[n].meta)
             for n in ("moe.w_gate", "moe.w_up", "moe.w_down") if n in eng.weights}
  print(f"{eng.path}: predict {a.predict}; ring sizes {sorted(sizes)}; "
        f"{hlo.count('jaxvt_prefetch_experts')} expert fetch calls in the optimized HLO")
  n = 0
  for line in hlo.splitlines():
    if any(f"u8[{s}]" in line for s in sizes) and re.search(r"\b(copy|copy-start)\(", line):
      n += 1
      print("  " + line.strip()[:200])
  print(f"{n} ring-sized copies")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
