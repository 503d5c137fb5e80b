"""Where a load's time goes: a timeline of placing each weight (a probe for #16's first token).

  python tools/load_timeline.py --model F [--warm] [--cache DIR] [--offload-gb B]

Times Python's and JAX's start, then `jaxvt.load(F)` as the CLI calls it (with --warm, the first
token's programs compiled while the weights load, as `python -m jaxvt.run` does; --cache: the
compilation cache's directory), recording each weight's thread, start and end. Prints the load's
own account (Engine.load_times: making the device arrays, waiting for staging buffers, reading,
uploading), the weights that ended last, and how many weights were being placed at once.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import collections  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402

T_JAX = time.perf_counter()
import jaxvt  # noqa: E402
from jaxvt import loader  # noqa: E402
from jaxvt.offload import host_tier  # noqa: E402

T_JAXVT = time.perf_counter()
EVENTS: list[tuple[str, str, float, float]] = []  # (weight, thread, start, end)


def instrument() -> None:
  """Each weight's thread, start and end (loader.place_weight, wrapped)."""
  place_weight = loader.place_weight

  def timed(model, d, *a, **k):
    t = time.perf_counter()
    try:
      return place_weight(model, d, *a, **k)
    finally:
      EVENTS.append((d.name, threading.current_thread().name, t, time.perf_counter()))
  loader.place_weight = timed


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/load_timeline.py")
  ap.add_argument("--model", required=True)
  ap.add_argument("--warm", action="store_true")
  ap.add_argument("--cache", default=None)
  ap.add_argument("--offload-gb", default="0")
  ap.add_argument("--cpu-staging", action="store_true",
                  help="on the CPU backend, place through CPU staging buffers (a check of the tool)")
  a = ap.parse_args(argv)
  if a.cpu_staging:
    host_tier.staging_for = lambda platform, n, piece: host_tier.Staging(n, piece, "cpu")
  t_dev = time.perf_counter()
  jax.devices()
  t_dev = time.perf_counter() - t_dev
  instrument()
  warm = None
  if a.warm:
    warm = lambda early: early.warm_up(len(early.encode_prompt("The capital of France is")), 1)
  budget = a.offload_gb if a.offload_gb == "auto" else float(a.offload_gb)
  t = time.perf_counter()
  eng = jaxvt.load(a.model, offload_gb=budget, compile_cache=a.cache or False, while_loading=warm)
  t_load = time.perf_counter() - t
  weights = list(EVENTS)
  p0 = min(e[2] for e in weights)
  print(f"python+jax import {T_JAX - T0:.2f} s, jaxvt import {T_JAXVT - T_JAX:.2f} s, backend "
        f"{t_dev:.2f} s; load {t_load:.2f} s (placing {eng.place_seconds:.2f} s, its first weight "
        f"from {p0 - t:.2f} s; warm {eng.warm_seconds:.2f} s; check {eng.check_seconds:.2f} s)")
  lt = eng.load_times
  for k in ("arrays", "wait", "read", "upload", "host"):
    n = getattr(lt, k + "_bytes")
    rate = (f", {n / getattr(lt, k) / 1e9:.1f} GB/s a thread" if n and getattr(lt, k) and
            k != "arrays" else "")
    print(f"  {k:7s} {getattr(lt, k):7.2f} thread-s, {n / 2**30:6.2f} GiB{rate}")
  print(f"  weights {sum(e[3] - e[2] for e in weights):7.2f} thread-s over {len(weights)}")
  print("weights that ended last (start-end s from placing's start, thread):")
  for what, th, s, e in sorted(weights, key=lambda w: w[3])[-8:]:
    print(f"  {s - p0:6.2f}-{e - p0:6.2f} {th:14s} {what}")
  edges = sorted([(w[2] - p0, 1) for w in weights] + [(w[3] - p0, -1) for w in weights])
  busy, level, last = collections.Counter(), 0, 0.0
  for x, d in edges:
    busy[level] += x - last
    level, last = level + d, x
  print("seconds with N weights being placed: " +
        ", ".join(f"{n}: {busy[n]:.2f}" for n in sorted(busy)))
  eng.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
