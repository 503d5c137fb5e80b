"""Decode rate of generate against the same decode calls read back one at a time (a probe).

  python tools/decode_rate.py [--model F] [--offload-gb B] [--device-gb G] [--tokens 128]

Loads the model once, prefills a 512-token prompt, then times, alternately three times each:
`Engine.generate` (the next decode call sent before the previous one's tokens are read) and the
same sequence of engine.decode_loop_fn calls with every call's tokens read before the next is
sent (generate before 2026-12-02). Prints tok/s of each (the best of three) and their ratio; the
greedy tokens of the two must agree.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxvt
from jaxvt import engine
from jaxvt.bench.arms import no_stops
from jaxvt.sampling import SamplingParams, sample


def serial(eng, ids: list[int], n_tokens: int) -> tuple[list[int], float]:
  """generate's decode calls, each read back before the next is sent: (tokens, decode s)."""
  key = jax.random.key(0)
  logits, cache = eng.prefill(ids)
  key, sub = jax.random.split(key)
  out = [int(sample(logits[None], sub, SamplingParams())[0])]
  t0 = time.perf_counter()
  pos = len(ids)
  while len(out) < n_tokens:
    n = eng.decode_steps(n_tokens - len(out))
    toks, cache, key, _ = engine.decode_loop_fn(
        eng.weights, cache, jnp.asarray([out[-1]], jnp.int32), jnp.int32(pos), key, cfg=eng.cfg,
        ex=eng.ex, kv_len=eng.kv_len(pos + n), params=SamplingParams(), steps=n)
    out += np.asarray(toks)[:, 0].tolist()
    pos += n
  return out[:n_tokens], time.perf_counter() - t0


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/decode_rate.py")
  ap.add_argument("--model", default=None)
  ap.add_argument("--offload-gb", default="0")
  ap.add_argument("--device-gb", type=float, default=None)
  ap.add_argument("--tokens", type=int, default=128)
  a = ap.parse_args(argv)
  budget = a.offload_gb if a.offload_gb == "auto" else float(a.offload_gb)
  with no_stops(jaxvt.load(a.model, offload_gb=budget, device_gb=a.device_gb,
                           max_context=1024)) as eng:
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, 512).tolist()
    eng.warm_up(len(ids), a.tokens)
    serial(eng, ids, a.tokens)  # compiles the one-at-a-time calls' programs
    rates = {"generate": [], "serial": []}
    toks = {}
    for _ in range(3):
      g = eng.generate(ids, max_tokens=a.tokens)
      rates["generate"].append(g.stats.decode_tok_s)
      toks["generate"] = g.tokens
      t, s = serial(eng, ids, a.tokens)
      rates["serial"].append((a.tokens - 1) / s)
      toks["serial"] = t
  best = {k: max(v) for k, v in rates.items()}
  print(f"{eng.path}: offload {budget}; decode tok/s (best of 3): generate "
        f"{best['generate']:.1f} {[round(r, 1) for r in rates['generate']]}, one call at a time "
        f"{best['serial']:.1f} {[round(r, 1) for r in rates['serial']]}; ratio "
        f"{best['generate'] / best['serial']:.3f}; same tokens: {toks['generate'] == toks['serial']}")
  return 0 if toks["generate"] == toks["serial"] else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
