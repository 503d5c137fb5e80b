"""Prefill and decode rates of generate on a model (all in device memory), warm: a 512-token and
a 16-token prompt of random ids, 128 greedy tokens. Usage: python tools/gen_rates.py MODEL.gguf"""

import sys
import time

import numpy as np

import jaxvt
from jaxvt.bench.arms import no_stops


def main(path: str) -> None:
  eng = no_stops(jaxvt.load(path, max_context=1024))  # generate exactly max_tokens
  rng = np.random.default_rng(0)
  for n in (512, 16):
    ids = rng.integers(10, eng.cfg.vocab_size - 10, n).tolist()
    t = time.perf_counter()
    eng.generate(ids, max_tokens=128)  # compiles
    first = time.perf_counter() - t
    g = eng.generate(ids, max_tokens=128)
    s = g.stats
    print(f"prompt {n}: first generate {first:.1f} s; warm prefill {s.prefill_seconds * 1e3:.1f} ms "
          f"({s.prefill_tok_s:.1f} tok/s), decode {s.decode_tok_s:.1f} tok/s "
          f"({s.generated_tokens} tokens, {eng.decode_chunk} per dispatch)")
  eng.close()


if __name__ == "__main__":
  main(sys.argv[1])
