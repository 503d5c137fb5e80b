"""Can a host-tier layer cross the link while other layers compute? (A probe for #15's overlap.)

  python tools/stream_probe.py [--layers 8] [--experts 64] [--matmuls 40]

One jitted lax.scan of `--layers` steps; each step runs a chain of bf16 matmuls on the device
(the other layers' compute) and dequantizes one host-tier layer of Q4_K experts (ops.qdequant:
every byte read over the link, as prefill's staging does). Printed, ms per step: the compute
alone, the host read alone, both on XLA's one stream, and the host read inside
`compute_on("gpu_stream:1")` (XLA's annotated second stream). Overlap shows as the last time
near max(compute, read) instead of their sum. Needs a GPU; run it with and without
XLA_FLAGS=--xla_gpu_experimental_stream_annotation=true.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import compute_on as co

from jaxvt.bench.kernels import random_matrix, stack
from jaxvt.ffi import ops
from jaxvt.gguf.formats import Q4_K
from jaxvt.offload.host_tier import HostTier
from jaxvt.qweight import QWeight


def on_stream(fn, *args):
  """fn(*args) on XLA's annotated second stream (the decorator form of compute_on: compute_on2
  before jax 0.11, compute_on from then on)."""
  deco = getattr(co, "compute_on2", None) or co.compute_on
  return deco(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(fn)(*args)


def best(fn, *args, reps: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  t = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    t.append(time.perf_counter() - t0)
  return min(t)


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/stream_probe.py")
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--experts", type=int, default=64)
  ap.add_argument("--matmuls", type=int, default=40)
  ap.add_argument("--cpu", action="store_true", help="run on the CPU anyway (a check of the script)")
  a = ap.parse_args(argv)
  dev = jax.devices()[0]
  if dev.platform == "cpu" and not a.cpu:
    print("stream_probe: needs a GPU")
    return 2
  rows, cols, L = 512, 2048, a.layers
  raw = np.concatenate([random_matrix(np.random.default_rng(e), Q4_K, rows, cols)
                        for e in range(a.experts)])
  tier = HostTier()
  w = stack(raw, Q4_K, rows, cols, L, tier, dev, experts=a.experts)
  x = jnp.ones((512, 4096), jnp.bfloat16, device=dev) * 0.01
  m = jnp.eye(4096, dtype=jnp.bfloat16, device=dev)

  def compute(x):
    for _ in range(a.matmuls):
      x = jnp.tanh(x @ m)
    return x

  @jax.jit
  def read(data, table, fmts, layer):
    return ops.qdequant(QWeight(data, table, fmts, w.meta), layer)[0, 0, :8].astype(jnp.float32)

  def program(kind: str):
    @jax.jit
    def run(x, data, table, fmts):
      def body(c, l):
        x, acc = c
        if kind in ("compute", "serial", "stream"):
          x = compute(x)
        if kind in ("read", "serial"):
          acc = acc + read(data, table, fmts, l)
        if kind == "stream":
          acc = acc + on_stream(read, data, table, fmts, l)
        return (x, acc), None
      (x, acc), _ = jax.lax.scan(body, (x, jnp.zeros((8,), jnp.float32)), jnp.arange(L))
      return x[0, :8].astype(jnp.float32) + acc
    return run

  mb = raw.size / 2**20
  print(f"{jax.devices()[0].device_kind}; {L} steps, host layer {mb:.1f} MiB, {a.matmuls} matmuls "
        f"of 512x4096x4096 bf16 a step")
  for kind in ("compute", "read", "serial", "stream"):
    try:
      t = best(program(kind), x, w.data, w.table, w.fmts)
      extra = f" ({raw.size * L / t / 1e9:.1f} GB/s of host reads)" if kind != "compute" else ""
      print(f"{kind:8s} {t / L * 1e3:8.3f} ms/step{extra}", flush=True)
    except Exception as e:  # pylint: disable=broad-except  (a probe: say what failed, go on)
      print(f"{kind:8s} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
  tier.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
