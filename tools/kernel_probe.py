"""Device time of each decode-step product of the Qwen3.6-35B-A3B shapes (device tier), from a
profiler trace: python tools/kernel_probe.py [--batch B] [--layers L]

Each product runs in a jitted lax.scan over L layers that hold the same valid random blocks at
different addresses (more than the GPU's L2 together), so every call reads its bytes from HBM.
Prints, per product: kernel name, calls, microseconds per call and weight GB/s.
"""

from __future__ import annotations

import argparse
import collections
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.bench import profile
from jaxvt.bench import kernels as kb
from jaxvt.ffi import ops
from jaxvt.gguf.formats import FORMATS
from jaxvt.qweight import QMeta, QWeight, split_u64

Q4_K, Q6_K, F32 = 12, 14, 0


def raw_for(rng, fmt, rows, cols):
  if fmt == F32:
    return (rng.standard_normal(rows * cols).astype(np.float32) * 0.02).view(np.uint8)
  return kb.random_matrix(rng, fmt, rows, cols)


def dense(rng, fmt, rows, cols, layers, dev):
  return kb.stack(raw_for(rng, fmt, rows, cols), fmt, rows, cols, layers, None, dev)


def experts(rng, fmt, e, rows, cols, layers, dev):
  raw = raw_for(rng, fmt, e * rows, cols)
  data = jax.device_put(np.broadcast_to(raw, (layers, raw.size)), dev)
  meta = QMeta(rows, cols, e, (fmt,), layers)
  return QWeight(data, jax.device_put(split_u64(np.arange(layers)), dev),
                 jax.device_put(np.full(layers, fmt, np.int32), dev), meta)


def nbytes(w: QWeight) -> int:
  f = FORMATS[w.meta.formats[0]]
  be, bb = f.block_elems, f.block_bytes
  return max(w.meta.experts, 1) * w.meta.rows * w.meta.cols // be * bb


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--modes", default="f32,q8")
  p.add_argument("--only", default="", help="run only the products whose name contains this")
  p.add_argument("--no-trace", action="store_true",
                 help="run each product 3 times without jax.profiler (to run under ncu)")
  a = p.parse_args()
  dev = jax.devices()[0]
  rng = np.random.default_rng(0)
  L, B = a.layers, a.batch
  x2048 = jax.device_put(rng.standard_normal((B, 2048)).astype(np.float32), dev)
  x4096 = jax.device_put(rng.standard_normal((B, 4096)).astype(np.float32), dev)
  x512 = jax.device_put(rng.standard_normal((B, 512)).astype(np.float32), dev)
  ids = jax.device_put(np.stack([rng.choice(256, 8, replace=False) for _ in range(B)]).astype(np.int32), dev)
  xe = jax.device_put(rng.standard_normal((B, 8, 512)).astype(np.float32), dev)
  cases = {
      "gdn in (multi 8192+4096+32+32 x 2048 Q6_K)": (
          [dense(rng, Q6_K, r, 2048, L, dev) for r in (8192, 4096, 32, 32)], x2048, "multi"),
      "gdn out (2048 x 4096 Q6_K)": ([dense(rng, Q6_K, 2048, 4096, L, dev)], x4096, "one"),
      "attn qkv (multi 8192+512+512 x 2048 Q6_K)": (
          [dense(rng, Q6_K, r, 2048, L, dev) for r in (8192, 512, 512)], x2048, "multi"),
      "router+shexp gate/up (multi F32 256, Q6_K 512+512 x 2048)": (
          [dense(rng, F32, 256, 2048, L, dev)] + [dense(rng, Q6_K, 512, 2048, L, dev)] * 2,
          x2048, "multi"),
      "router alone (F32 256 x 2048)": ([dense(rng, F32, 256, 2048, L, dev)], x2048, "one"),
      "shexp gate/up alone (multi Q6_K 512+512 x 2048)": (
          [dense(rng, Q6_K, 512, 2048, L, dev)] * 2, x2048, "multi"),
      "shexp down (2048 x 512 Q6_K)": ([dense(rng, Q6_K, 2048, 512, L, dev)], x512, "one"),
      "experts gate+up (2 x 8 of 256 x 512 x 2048 Q4_K)": (
          [experts(rng, Q4_K, 256, 512, 2048, L, dev) for _ in range(2)], x2048, "experts2"),
      "experts down (8 of 256 x 2048 x 512 Q4_K)": (
          [experts(rng, Q4_K, 256, 2048, 512, L, dev)], xe, "experts"),
      "lm_head (248320 x 2048 Q6_K)": ([dense(rng, Q6_K, 248320, 2048, 1, dev)], x2048, "one"),
  }
  print(f"batch {B}, {L} layers per scan; device {dev.device_kind}"
        + (f"; grids of {a.waves} waves" if a.waves else ""))
  print(f"{'product':58} {'mode':4} {'kernel':30} {'calls':>5} {'us/call':>8} {'GB/s':>7}")
  for (name, (ws, x, kind)), mode in [(c, m) for c in cases.items() for m in a.modes.split(",")]:
    if a.only and a.only not in name:
      continue
    n = ws[0].meta.n_layers

    @functools.partial(jax.jit, static_argnames=("kind", "mode"))
    def run(x, ws, ids, kind, mode):
      def body(acc, l):
        if kind == "multi":
          ys = ops.qmatmul_multi(x, ws, l, mode)
        elif kind == "one":
          ys = [ops.qmatmul(x, ws[0], l, mode)]
        elif kind == "experts2":
          ys = list(ops.qmatmul_experts2(x, ws[0], ws[1], l, ids, mode))
        else:
          ys = [ops.qmatmul_experts(x, ws[0], l, ids, mode)]
        return acc + sum(jnp.sum(y) for y in ys), None
      return jax.lax.scan(body, jnp.float32(0), jnp.arange(n, dtype=jnp.int32))[0]

    go = lambda: run(x, ws, ids, kind=kind, mode=mode).block_until_ready()
    go()
    if a.no_trace:
      go()
      go()
      print(f"{name:58} {mode:4} ran")
      continue
    with tempfile.TemporaryDirectory() as d:
      tr = profile.trace(go, d)
    per = collections.defaultdict(list)
    for e in profile.device_events(tr, host_fallback=False):
      if "jaxvt" in str(e["name"]):
        per[str(e["name"]).split("(")[0].split("::")[-1][:30]].append(float(e["dur"]))
    read = sum(nbytes(w) for w in ws)
    if kind.startswith("experts"):
      read = read * 8 * B // 256  # only the routed experts' bytes
    for k, durs in per.items():
      us = float(np.median(durs))
      print(f"{name:58} {mode:4} {k:30} {len(durs):5d} {us:8.2f} {read / us / 1e3:7.0f}")


if __name__ == "__main__":
  main()
