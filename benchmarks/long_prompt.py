"""python -m benchmarks.long_prompt: a long prompt at --offload-gb auto on an emulated card.

  XLA_PYTHON_CLIENT_MEM_FRACTION=F python -m benchmarks.long_prompt --model M [--tokens 8192]
      [--device-gb 16] [--offload-gb auto] [--gen 8] [--write]

Loads M as jaxvt.load does (the planner's budget and its XLA memory check at this context),
prefills `--tokens` random token ids (in chunks of the plan's prefill chunk) and generates
`--gen` tokens, then reports the budget, the prefill calls, the rates, and the device's peak
memory against its pool. Run it with XLA_PYTHON_CLIENT_MEM_FRACTION set to the emulated card's
share of the GPU (tools/gpu_session.sh does), so that running out of memory is real. Exit status
1 when the load is refused or the run fails; `--write` writes the `long-prompt` section.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

import jaxvt
from benchmarks import report
from benchmarks.arms import no_stops
from benchmarks.cli import parser_of, run


def parser() -> argparse.ArgumentParser:
  ap = parser_of("long_prompt", __doc__)
  ap.add_argument("--model", required=True)
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--device-gb", type=float, default=None)
  ap.add_argument("--offload-gb", default="auto")
  ap.add_argument("--gen", type=int, default=8)
  ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
  return ap


def main(args) -> str:
  budget = args.offload_gb if args.offload_gb == "auto" else float(args.offload_gb)
  t = time.perf_counter()
  try:
    eng = no_stops(jaxvt.load(args.model, offload_gb=budget, device_gb=args.device_gb,
                              max_context=args.tokens + args.gen))
  except jaxvt.JaxvtError as e:
    raise SystemExit(f"load refused: {e}")
  with eng:
    load_s = time.perf_counter() - t
    host = eng.plan.plan.host_bytes / 2**30
    calls = -(-args.tokens // eng.prefill_chunk)
    print(f"loaded in {load_s:.1f} s: {host:.2f} GiB in the host tier, prefill chunk "
          f"{eng.prefill_chunk}, max context {eng.max_context}", flush=True)
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, args.tokens).tolist()
    try:
      g = eng.generate(ids, max_tokens=args.gen)
    except Exception as e:  # pylint: disable=broad-except  (running out of memory is the finding)
      raise SystemExit(f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    s = g.stats
    st = jax.devices()[0].memory_stats() or {}
    peak, pool = st.get("peak_bytes_in_use", 0) / 2**30, st.get("bytes_limit", 0) / 2**30
  frac = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset")
  card = f" --device-gb {args.device_gb:g}" if args.device_gb is not None else ""
  out = ["## A long prompt at --offload-gb auto\n",
         f"Command: `XLA_PYTHON_CLIENT_MEM_FRACTION={frac} python -m benchmarks.long_prompt "
         f"--model {os.path.basename(args.model)} --tokens {args.tokens} --offload-gb "
         f"{args.offload_gb}{card} --gen {args.gen}`  ",
         f"Machine: {report.machine()}  ", f"Date: {report.stamp()}\n",
         "| prompt tokens | host tier GiB | prefill calls x chunk | prefill tok/s | decode tok/s "
         "| compile s | device peak / pool GiB |", "|---|---|---|---|---|---|---|",
         f"| {args.tokens} | {host:.2f} | {calls} x {eng.prefill_chunk} | {s.prefill_tok_s:.1f} | "
         f"{s.decode_tok_s:.1f} | {s.compile_seconds:.1f} | {peak:.2f} / {pool:.2f} |"]
  return report.publish("long-prompt", out, args.write)


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  sys.exit(cli())
