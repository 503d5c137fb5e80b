"""python -m benchmarks.tier: the host tier's read rate against the link, in one run.

host_linear (`ops.qmatmul` on host-tier layers) for Q4_K, Q6_K, Q4_1, Q8_0 and BF16 matrices of
LLM shapes at batch 1, 4 and 16, and host_moe (`ops.qmatmul_experts` with top-8 of 256 Q4_K
experts, Qwen3.6-35B-A3B's expert shapes) counting only the routed experts' bytes. Each rate is
weight bytes read per second, divided by the same run's cudaMemcpy host->device rate.
Layers are replicated at distinct addresses so every call reads memory the GPU has not cached.
"""

from __future__ import annotations

import argparse
import sys


import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import engine, ffi
from benchmarks import kernels as kb
from benchmarks import products
from benchmarks import report
from benchmarks.cli import parser_of, run
from benchmarks.arms import KINDS
from benchmarks.profile import device_seconds
from jaxvt.ffi import ops
from jaxvt.gguf.formats import FORMATS
from jaxvt.offload.host_tier import HostTier
from jaxvt.qweight import QWeight

MIB = 1 << 20


def parser() -> argparse.ArgumentParser:
  ap = parser_of("tier", __doc__)
  ap.add_argument("--total-mib", type=int, default=256)
  ap.add_argument("--grid", action="store_true", help="kernel-alone grid-size probe (GPU)")
  ap.add_argument("--kinds", action="store_true", help="host memory kinds probe (GPU)")
  ap.add_argument("--products", nargs="?", const="all", default=None,
                  choices=("all", "dense", "experts"),
                  help="in place / tiled / staged products by rows (jaxvt.ffi.tuning.Products' crossovers)")
  return ap


def expert_stack(rng, tier: HostTier, layers: int, experts: int, rows: int, cols: int, device):
  """`layers` host-tier copies of `experts` random Q4_K matrices of rows x cols, and one
  expert's bytes."""
  raw = kb.random_matrix(rng, 12, experts * rows, cols)
  return kb.stack(raw, 12, rows, cols, layers, tier, device, experts=experts), raw.size // experts


def time_experts(w: QWeight, ids: jax.Array, device, reps: int = 3) -> tuple[float, float]:
  """Seconds for one pass of qmatmul_experts over every layer (fresh routing per layer): the
  whole scan, and the experts kernels alone (device events of a profiler trace; 0 if none)."""
  T, k = ids.shape[1:]
  x = jax.device_put(jnp.ones((T, w.meta.cols), jnp.float32) * 1e-3, device)
  mode = engine.exec_for(device.platform, True, None).numerics  # jaxvt's arithmetic there
  best, once = kb.best_scan_time(lambda x, l: ops.qmatmul_experts(x, w, l, ids[l], mode),
                                 w.meta.n_layers, x, reps)
  return best, device_seconds(once, "experts")


def crossover(rng, device, dma: float, rows: int = 4096, cols: int = 4096, layers: int = 16) -> str:
  """Host-tier Q4_K layer at growing batch: read in place by the matvec kernel (which re-reads
  the weights once per 16 rows of x) vs staged (qdequant to bf16 on the device, then a GEMM)."""
  raw = kb.random_matrix(rng, 12, rows, cols)
  lines = [f"### Reading in place vs staging, by batch (Q4_K {rows} x {cols}, host tier)\n",
           "| batch | in place ms/layer | staged ms/layer | faster |", "|---|---|---|---|"]
  with HostTier() as tier:
    w = kb.stack(raw, 12, rows, cols, layers, tier, device)
    for b in (1, 8, 16, 32, 64, 128, 256, 512):
      a = kb.time_scan(w, b, device, reps=3) / layers * 1e3
      s = kb.time_scan(w, b, device, reps=3, staged=True) / layers * 1e3
      lines.append(f"| {b} | {a:.3f} | {s:.3f} | {'in place' if a <= s else 'staged'} |")
    del w
  return "\n".join(lines)


def grid_sweep(ext, dma: float) -> str:
  """The matvec kernel alone (CUDA events, no XLA) against the streaming read, by grid size:
  which launch geometry reads host memory fastest (GPU only)."""
  dbg = ffi.debug_extension()  # the probes (measure_*, bench_cpu_gemv)
  sms = ext.gpu_sm_count()
  caps = [0, sms, 4 * sms, 16 * sms]
  lines = ["### Grid-size probe (kernel alone, CUDA events; GB/s, % of cudaMemcpy)\n",
           "| kernel | " + " | ".join("default" if c == 0 else f"{c // sms}/SM" for c in caps)
           + " |", "|---|" + "---|" * len(caps)]
  cells = [f"{dbg.measure_zero_copy_read(256 * MIB, 10, False, c):.1f}" for c in caps]
  lines.append("| stream read 256 MiB | " + " | ".join(cells) + " |")
  try:  # the bulk-copy engine (CUDA sm_90+): 2 blocks per SM by default
    cells = [f"{dbg.measure_zero_copy_read(256 * MIB, 10, False, c, bulk=True):.1f}" for c in caps]
    lines.append("| bulk-copy read 256 MiB | " + " | ".join(cells) + " |")
  except RuntimeError as e:
    lines.append(f"| bulk-copy read 256 MiB | {str(e).splitlines()[0]} |" + " |" * (len(caps) - 1))
  for fmt, rows, cols, batch in [(12, 14336, 4096, 1), (12, 4096, 4096, 1), (14, 4096, 4096, 1),
                                 (3, 4096, 4096, 1), (8, 4096, 4096, 1), (30, 4096, 4096, 1),
                                 (12, 2048, 512, 1), (12, 14336, 4096, 4), (12, 14336, 4096, 16)]:
    name = FORMATS[fmt].name
    cells = []
    for c in caps:
      gbs = dbg.measure_host_gemv(fmt, rows, cols, batch, copies=8, iters=24, grid_cap=c)
      cells.append(f"{gbs:.1f} ({100 * gbs / dma:.0f}%)")
    lines.append(f"| {name} {rows}x{cols} b{batch} | " + " | ".join(cells) + " |")
  lines += ["", "### Device tier, kernel alone (batch 1)\n",
            "| matrix | MiB | GB/s | us per call |", "|---|---|---|---|"]
  for fmt, rows, cols in [(12, 8192, 2048), (12, 2048, 4096), (12, 512, 2048), (12, 2048, 512),
                          (14, 2048, 2048), (14, 248320, 2048)]:
    name, be, bb = FORMATS[fmt].name, FORMATS[fmt].block_elems, FORMATS[fmt].block_bytes
    mib = rows * cols // be * bb / MIB
    copies = max(2, min(16, int(1024 // mib)))
    gbs = dbg.measure_host_gemv(fmt, rows, cols, 1, copies=copies, iters=4 * copies,
                                device_tier=True)
    lines.append(f"| {name} {rows}x{cols} | {mib:.1f} | {gbs:.0f} | {mib * MIB / gbs / 1e3:.1f} |")
  return "\n".join(lines)


def kinds_probe(ext) -> str:
  """Each way of allocating host-tier memory (HostTier kind): copy and streaming-read rates, at
  256 MiB and at a small matrix's size, and the matvec kernel alone on the shapes that read
  slowest (GPU only). % is of the best 256 MiB cudaMemcpy of any kind."""
  dbg = ffi.debug_extension()  # the probes (measure_*, bench_cpu_gemv)
  small = 2048 * 512 // 256 * 144  # a Q4_K 2048 x 512 matrix's bytes
  shapes = [(12, 4096, 14336), (14, 4096, 4096), (12, 14336, 4096), (12, 2048, 512)]
  rows = {}
  for kind, k in KINDS.items():
    r = [dbg.measure_dma_h2d(256 * MIB, 5, k), dbg.measure_zero_copy_read(256 * MIB, 10, False, 0, k),
         dbg.measure_dma_h2d(small, 200, k), dbg.measure_zero_copy_read(small, 200, False, 0, k)]
    try:
      r += [dbg.measure_zero_copy_read(n, it, False, 0, k, bulk=True)
            for n, it in ((256 * MIB, 10), (small, 200))]
    except RuntimeError:  # no bulk-copy engine
      r += [float("nan")] * 2
    r += [dbg.measure_host_gemv(f, rr, c, 1, copies=8, iters=24, kind=k) for f, rr, c in shapes]
    r += [dbg.measure_host_gemv(12, 4096, 14336, b, copies=8, iters=24, kind=k) for b in (4, 16)]
    rows[kind] = r
  ref = max(r[0] for r in rows.values())
  names = ["cudaMemcpy 256 MiB", "stream read 256 MiB", f"cudaMemcpy {small / MIB:.2f} MiB",
           f"stream read {small / MIB:.2f} MiB", "bulk-copy read 256 MiB",
           f"bulk-copy read {small / MIB:.2f} MiB"]
  names += [f"{FORMATS[f].name} {rr}x{c} b1" for f, rr, c in shapes]
  names += [f"Q4_K 4096x14336 b{b}" for b in (4, 16)]
  lines = [f"### Host memory kinds (kernel alone; GB/s, % of the best cudaMemcpy, {ref:.1f})\n",
           "| read | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
  for i, name in enumerate(names):
    lines.append(f"| {name} | " + " | ".join(f"{rows[k][i]:.1f} ({100 * rows[k][i] / ref:.0f}%)"
                                              for k in KINDS) + " |")
  return "\n".join(lines)


def main(args) -> str:
  dbg = ffi.debug_extension()  # the probes (measure_*, bench_cpu_gemv)
  if getattr(args, "products", None):
    return products.main(args)
  ext = ffi.extension()
  gpu = bool(ext.gpu_platform()) and ext.gpu_device_count() > 0
  if getattr(args, "kinds", False):
    if not gpu:
      return "the host-memory kinds probe needs a GPU"
    return kinds_probe(ext)
  if getattr(args, "grid", False):
    if not gpu:
      return "the grid-size probe needs a GPU"
    dma = dbg.measure_dma_h2d(256 * MIB, 5)
    return grid_sweep(ext, dma) + "\n\n" + crossover(np.random.default_rng(0),
                                                      jax.devices()[0], dma)
  device = jax.devices("gpu" if gpu else "cpu")[0]
  n = args.total_mib * MIB
  dma = dbg.measure_dma_h2d(n, 5)
  zc = dbg.measure_zero_copy_read(n, 5, False)
  batches = (1, 4, 16)
  rng = np.random.default_rng(0)
  link = "cudaMemcpy H2D" if gpu else "memcpy"
  out = [f"## Host tier read rate ({device.device_kind})\n",
         f"Command: `python -m benchmarks.tier --total-mib {args.total_mib}`  ",
         f"Machine: {report.machine()}  ", f"Date: {report.stamp()}\n",
         f"Same run: {link} {dma:.1f} GB/s; streaming read of mapped pinned memory "
         f"{zc:.1f} GB/s. Rates are weight bytes per second; % is of the {link} rate.\n",
         "### host_linear (qmatmul, host-tier weights)\n",
         "In an XLA layer scan (what a model step sees: one custom call per layer, the scan's "
         "loop and a fusion between calls) and, on a GPU, the kernel alone (CUDA events around "
         "back-to-back launches over distinct copies).\n",
         "| format | rows x cols | MiB | " + " | ".join(f"batch {b} GB/s (%)" for b in batches)
         + (" | kernel alone, " + ", ".join(f"b{b}" for b in batches) + " GB/s (%)" if gpu else "")
         + " |", "|---|---|---|" + "---|" * (len(batches) + gpu)]
  for fmt in kb.SCALES:
    name = FORMATS[fmt].name
    for rows, cols in kb.SHAPES:
      raw = kb.random_matrix(rng, fmt, rows, cols)
      layers = max(2, min(512, -(-n // raw.size)))
      with HostTier() as tier:
        w = kb.stack(raw, fmt, rows, cols, layers, tier, device)
        cells = []
        for b in batches:
          gbs = raw.size * layers / kb.time_scan(w, b, device, reps=3) / 1e9
          cells.append(f"{gbs:.1f} ({100 * gbs / dma:.0f}%)")
        del w
      if gpu:
        alone = [dbg.measure_host_gemv(fmt, rows, cols, b, copies=8, iters=24) for b in batches]
        cells.append(", ".join(f"{g:.1f} ({100 * g / dma:.0f}%)" for g in alone))
      out.append(f"| {name} | {rows} x {cols} | {raw.size / MIB:.1f} | " + " | ".join(cells)
                 + " |")
  E, k, rows, cols = 256, 8, 512, 2048
  out += ["", f"### host_moe (qmatmul_experts: top-{k} of {E} Q4_K experts, {rows} x {cols} "
          "each; gate/up shape of Qwen3.6-35B-A3B)\n",
          "| tokens | distinct experts read / layer | bytes read / layer | GB/s (%) in the scan "
          "| kernel time only (profiler) GB/s (%) |", "|---|---|---|---|---|"]
  with HostTier() as tier:
    layers = 24
    w, ebytes = expert_stack(rng, tier, layers, E, rows, cols, device)
    for T in (1, 4, 16):
      ids_np = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
                         for _ in range(layers)]).astype(np.int32)
      distinct = np.mean([len(np.unique(ids_np[l])) for l in range(layers)])
      t, tk = time_experts(w, jax.device_put(ids_np, device), device)
      read = distinct * ebytes
      gbs, gk = read * layers / t / 1e9, read * layers / tk / 1e9 if tk else 0.0
      out.append(f"| {T} | {distinct:.1f} | {read / MIB:.2f} MiB | {gbs:.1f} "
                 f"({100 * gbs / dma:.0f}%) | {gk:.1f} ({100 * gk / dma:.0f}%) |")
    del w
  out += ["", crossover(rng, device, dma)]
  if gpu:
    out += ["", grid_sweep(ext, dma), "", kinds_probe(ext)]
  return report.publish(f"tier-{device.platform}", out)


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  sys.exit(cli())
