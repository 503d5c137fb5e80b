"""A long prompt on an emulated card: python tools/long_prompt.py --model F [--tokens 8192]
[--device-gb 16] [--offload-gb auto] [--repeats 1]

Loads F as jaxvt.load does (the planner's budget and its XLA memory check at this context),
prefills `--tokens` random token ids (in chunks of the plan's prefill chunk) and generates 8
tokens, then prints the budget, the chunks, the rates, and the device's peak memory against its
pool. Run it with XLA_PYTHON_CLIENT_MEM_FRACTION set to the emulated card's share of the GPU
(tools/h200_session.sh does), so that an out-of-memory error is real. Exit status 1 on an error.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import jaxvt
from jaxvt.bench.arms import no_stops
from jaxvt.errors import JaxvtError
from jaxvt.model_fns import prefill_chunks


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/long_prompt.py")
  ap.add_argument("--model", required=True)
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--device-gb", type=float, default=None)
  ap.add_argument("--offload-gb", default="auto")
  ap.add_argument("--gen", type=int, default=8)
  a = ap.parse_args(argv)
  budget = a.offload_gb if a.offload_gb == "auto" else float(a.offload_gb)
  t = time.perf_counter()
  try:
    eng = no_stops(jaxvt.load(a.model, offload_gb=budget, device_gb=a.device_gb,
                              max_context=a.tokens + a.gen))
  except JaxvtError as e:
    print(f"load refused: {e}")
    return 1
  with eng:
    print(f"loaded in {time.perf_counter() - t:.1f} s: {eng.plan.plan.host_bytes / 2**30:.2f} GiB "
          f"in the host tier, prefill chunk {eng.prefill_chunk}, max context {eng.max_context}")
    chunks = list(prefill_chunks(a.tokens, 0, eng.prefill_chunk, eng.max_context))
    print(f"{len(chunks)} prefill calls: {[(off, m, T) for off, m, T in chunks]}")
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, a.tokens).tolist()
    try:
      g = eng.generate(ids, max_tokens=a.gen)
    except Exception as e:  # pylint: disable=broad-except  (an OOM is the finding)
      print(f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
      return 1
    s = g.stats
    st = jax.devices()[0].memory_stats() or {}
    print(f"ok: {a.tokens} prompt tokens, {len(g.tokens)} generated; compile {s.compile_seconds:.1f} s, "
          f"prefill {s.prefill_tok_s:.1f} tok/s, decode {s.decode_tok_s:.1f} tok/s; device peak "
          f"{st.get('peak_bytes_in_use', 0) / 2**30:.2f} of {st.get('bytes_limit', 0) / 2**30:.2f} GiB")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
