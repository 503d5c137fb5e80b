"""What the load's device-arrays program (loader._device_arrays) costs, piece by piece (#16 item 3).

  python tools/arrays_probe.py --model F --cache DIR   # run twice: the second is a cached run

A cached CLI run spent 1.6 s of its 4.4 s load making the device arrays of every stack (18.68 GiB,
one program). This separates what that is: the process's first program (a one-element jit: the
backend's lazy start on its first execution), then the device-arrays program traced, lowered,
compiled (or loaded from the compilation cache under DIR) and run.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import jax
import jax.numpy as jnp

from jaxvt import loader, programs
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.model import sharding


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/arrays_probe.py")
  ap.add_argument("--model", required=True)
  ap.add_argument("--cache", required=True)
  ap.add_argument("--overlap", action="store_true",
                  help="the first program on a thread while this one opens the file and builds "
                       "its tokenizer (does the backend's start hold the GIL?)")
  a = ap.parse_args(argv)
  programs.use_compile_cache(a.cache)
  t = time.perf_counter()
  jax.devices()
  print(f"backend {time.perf_counter() - t:.3f} s")
  first = lambda: jax.jit(lambda: jnp.ones((1,), jnp.float32))().block_until_ready()
  t = time.perf_counter()
  if a.overlap:
    th = threading.Thread(target=first)
    th.start()
  else:
    first()
  t1 = time.perf_counter()
  model = loader.open_model(a.model)
  Tokenizer.from_gguf(a.model)
  t2 = time.perf_counter()
  if a.overlap:
    th.join()
  print(f"first program (one element){' on a thread' if a.overlap else ''} {t1 - t:.3f} s; "
        f"open + tokenizer {t2 - t1:.3f} s; both {time.perf_counter() - t:.3f} s")
  par = sharding.one_device()
  abstract = loader.abstract_weights(model, loader.all_device, par)
  shapes = {n: w.data.shape for n, w in abstract.items()
            if isinstance(w, loader.QWeight) and len(w.meta.host_layers) < w.meta.n_layers}
  names = sorted(shapes)
  make = jax.jit(lambda: [jnp.full(shapes[n], i % 251 + 1, jnp.uint8) for i, n in enumerate(names)],
                 out_shardings=jax.sharding.SingleDeviceSharding(par.devices[0]))
  t = time.perf_counter()
  lowered = make.lower()
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  arrays = compiled()
  jax.block_until_ready(arrays)
  t3 = time.perf_counter()
  gib = sum(x.nbytes for x in arrays) / 2**30
  print(f"device arrays: {len(arrays)} stacks, {gib:.2f} GiB: trace+lower {t1 - t:.3f} s, "
        f"compile or cache {t2 - t1:.3f} s, run {t3 - t2:.3f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
