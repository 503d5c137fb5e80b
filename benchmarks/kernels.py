"""Kernel throughput: qmatmul GB/s from the host tier and the device tier against the link.

  python -m benchmarks.kernels            # GPU if the extension and JAX see one, else CPU
  python -m benchmarks.kernels --quick

For each format and matrix shape it builds L layers holding the same valid random blocks at
different addresses (L sized so the layers together exceed 256 MiB, far beyond the GPU's L2 and
the CPU's L3), runs one jitted `lax.scan` over them with a traced layer index, and reports weight
bytes read per second. The same run measures the DMA copy rate (the link's practical ceiling)
and a plain streaming read of mapped pinned memory, so the ratios come from one machine state.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import engine, ffi
from jaxvt.ffi import ops
from jaxvt.gguf.formats import BF16, FORMATS, Q4_1, Q4_K, Q6_K, Q8_0
from benchmarks.arms import KindTier
from benchmarks.cli import parser_of, run
from jaxvt.qweight import HOST_BIT, QMeta, QWeight, split_u64

# The formats measured, with the byte offsets of each block's f16 scales (random bytes there
# could be inf or NaN; they are set to small finite scales).
SCALES = {Q4_K: (0, 2), Q6_K: (208,), Q4_1: (0, 2), Q8_0: (0,), BF16: ()}
SHAPES = [(2048, 512), (4096, 4096), (14336, 4096), (4096, 14336)]  # rows x cols
MIB = 1 << 20


def parser() -> argparse.ArgumentParser:
  ap = parser_of("kernels", __doc__)
  ap.add_argument("--quick", action="store_true", help="fewer shapes and batches")
  ap.add_argument("--total-mib", type=int, default=256, help="bytes of layers per case")
  ap.add_argument("--coherent", action="store_true", help="HIP fine-grained host memory")
  ap.add_argument("--cpu-gemv", action="store_true", help="only time the CPU GEMV kernel alone")
  ap.add_argument("--matvec", action="store_true",
                  help="only the GPU matvec kernel alone under ggml's arithmetic: whole rows "
                       "through the bulk-copy engine against the per-warp windows")
  ap.add_argument("--l2", action="store_true",
                  help="only the GPU matvec kernel alone against the same after an L2 prefetch "
                       "launch of its own or of the next launch's matrix")
  return ap


def random_matrix(rng, fmt: int, rows: int, cols: int) -> np.ndarray:
  """Valid random blocks, uint8 [rows * row_bytes]."""
  be, bb, scales = FORMATS[fmt].block_elems, FORMATS[fmt].block_bytes, SCALES[fmt]
  if fmt == BF16:
    x = (rng.standard_normal(rows * cols, dtype=np.float32) * 0.02)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
  nb = rows * cols // be
  raw = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
  for off in scales:
    raw[:, off:off + 2] = (rng.uniform(0.5, 1.5, nb) * 0.01).astype("<f2").view(np.uint8).reshape(nb, 2)
  return raw.reshape(-1)


def stack(raw: np.ndarray, fmt: int, rows: int, cols: int, layers: int, tier, device,
          experts: int = 0) -> QWeight:
  """`layers` copies of raw (a matrix, or `experts` matrices of rows x cols): in `tier` (host)
  when given, else device-tier slots."""
  table = np.zeros(layers, np.uint64)
  fmts = np.full(layers, fmt, np.int32)
  if tier is not None:
    for l in range(layers):
      buf = tier.alloc(raw.size)
      buf.array[:] = raw
      table[l] = buf.device_address
    fmts |= HOST_BIT
    data = jnp.zeros((1, 1), jnp.uint8, device=device)
  else:
    table[:] = np.arange(layers)
    data = jax.device_put(np.broadcast_to(raw, (layers, raw.size)), device)
  meta = QMeta(rows, cols, experts, (fmt,), layers, tuple(range(layers)) if tier is not None else ())
  return QWeight(data, jax.device_put(split_u64(table), device), jax.device_put(fmts, device), meta)


def best_scan_time(product, n_layers: int, x: jax.Array, reps: int) -> tuple[float, object]:
  """Best wall seconds of `reps` runs of one jitted lax.scan that calls product(x, l) for every
  layer l (after a compiling run); also returns a thunk that runs it once more."""
  @jax.jit
  def run(x):
    def body(acc, l):
      y = product(x, l)
      return acc + y.reshape(y.shape[0], -1)[:, 0], None
    return jax.lax.scan(body, jnp.zeros((x.shape[0],), jnp.float32),
                        jnp.arange(n_layers, dtype=jnp.int32))[0]

  once = lambda: run(x).block_until_ready()
  once()
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    once()
    best = min(best, time.perf_counter() - t0)
  return best, once


def time_scan(w: QWeight, batch: int, device, reps: int, staged: bool = False) -> float:
  """Seconds for one pass of qmatmul over every layer of w; staged: instead stage each layer to
  the device as bf16 (ops.qdequant reads its bytes once) and multiply there (a GEMM)."""
  x = jax.device_put(jnp.ones((batch, w.meta.cols), jnp.float32) * 1e-3, device)
  mode = engine.exec_for(device.platform, True, None).numerics  # jaxvt's arithmetic there

  def product(x, l):
    if not staged:
      return ops.qmatmul(x, w, l, mode)
    return jnp.dot(x.astype(jnp.bfloat16), ops.qdequant(w, l).T,
                   preferred_element_type=jnp.float32)

  return best_scan_time(product, w.meta.n_layers, x, reps)[0]


def cpu_gemv(threads: tuple[int, ...] = (1, 2)) -> None:
  """The CPU GEMV kernel alone (no XLA), on the shapes that set jaxvt's CPU decode speed."""
  dbg = ffi.debug_extension()  # the probes (measure_*, bench_cpu_gemv)
  ext = ffi.extension()
  rng = np.random.default_rng(0)
  n0 = ext.cpu_threads()
  try:
    for th in threads:
      ext.set_cpu_threads(th)
      for fmt, rows, cols in [(3, 1536, 576), (3, 576, 1536), (12, 4096, 4096), (14, 4096, 4096)]:
        raw = random_matrix(rng, fmt, rows, cols)
        for b in (1, 4):
          iters = max(3, int(2e8 / raw.size))
          t = min(dbg.bench_cpu_gemv(fmt, raw.ctypes.data, rows, cols, b, iters) for _ in range(3))
          print(f"CPU {ext.cpu_isa()} {th} thr {FORMATS[fmt].name} {rows}x{cols} batch {b}: "
                f"{t * 1e6:8.1f} us  {raw.size / t / 1e9:5.2f} GB/s", flush=True)
  finally:
    ext.set_cpu_threads(n0)


# A decode step's matrices on the Qwen3.6-35B-A3B shape (format, rows, cols): an expert's gate /
# up and down, the shared expert's down, the attention output, the DeltaNet in-projections, the
# output head.
STEP_SHAPES = [(Q4_K, 512, 2048), (Q4_K, 2048, 512), (Q6_K, 2048, 512), (Q6_K, 2048, 4096),
               (Q6_K, 12352, 2048), (Q6_K, 248320, 2048)]


def matvec_paths() -> None:
  """The GPU matvec kernel alone (CUDA events around back-to-back launches over distinct copies,
  so no launch finds its matrix in L2), ggml's arithmetic, device and host tier: the bulk-copy
  path (the default where the device has the engine) against the per-warp windows (bulk=0)."""
  dbg = ffi.debug_extension()
  print("| matrix | MiB | tier | rows | windows GB/s (us) | bulk GB/s (us) | bulk / windows |")
  print("|---|---|---|---|---|---|---|")
  for fmt, rows, cols in STEP_SHAPES:
    name, be, bb = FORMATS[fmt].name, FORMATS[fmt].block_elems, FORMATS[fmt].block_bytes
    nbytes = rows * cols // be * bb
    copies = max(2, min(64, int((1 << 30) // nbytes)))
    for tier, device_tier in (("device", True), ("host", False)):
      if not device_tier and nbytes > 64 * MIB:
        continue
      for batch in (1, 8) if device_tier else (1,):
        def rate(bulk):
          return max(dbg.measure_host_gemv(fmt, rows, cols, batch, copies=copies,
                                           iters=2 * copies, device_tier=device_tier, ggml=True,
                                           bulk=bulk) for _ in range(3))
        w, b = rate(0), rate(-1)
        us = lambda g: nbytes / g / 1e3
        print(f"| {name} {rows}x{cols} | {nbytes / MIB:.2f} | {tier} | {batch} | {w:.0f} "
              f"({us(w):.1f}) | {b:.0f} ({us(b):.1f}) | {b / w:.2f} |", flush=True)


def l2_ahead() -> None:
  """The GPU matvec kernel at one row (device tier, ggml's arithmetic, distinct copies so that
  nothing is in L2 by chance) against the same launches each after an L2 prefetch launch
  (kernels_gpu.h launch_l2_prefetch) of its own matrix or of the next launch's (whose bytes would
  stream while this matvec runs), and the prefetch launches alone; microseconds a launch. "matvec
  from L2": the pair with its own prefetch less the prefetch alone."""
  dbg = ffi.debug_extension()
  print("| matrix | MiB | matvec us | prefetch alone us | prefetch own + matvec us "
        "| matvec from L2 us | prefetch next + matvec us | next / matvec |")
  print("|---|---|---|---|---|---|---|---|")
  for fmt, rows, cols in STEP_SHAPES[:-1]:
    name, be, bb = FORMATS[fmt].name, FORMATS[fmt].block_elems, FORMATS[fmt].block_bytes
    nbytes = rows * cols // be * bb
    copies = max(4, min(64, int((1 << 30) // nbytes)))

    def us(l2, only=False):
      gbs = max(dbg.measure_host_gemv(fmt, rows, cols, 1, copies=copies, iters=2 * copies,
                                      device_tier=True, ggml=True, l2=l2, l2_only=only)
                for _ in range(3))
      return nbytes / gbs / 1e3
    base, alone, own, nxt = us(-1), us(0, True), us(0), us(1)
    print(f"| {name} {rows}x{cols} | {nbytes / MIB:.2f} | {base:.2f} | {alone:.2f} | {own:.2f} "
          f"| {own - alone:.2f} | {nxt:.2f} | {nxt / base:.2f} |", flush=True)


def main(args) -> None:
  """Prints one line per format, shape and tier (nothing is written to docs/BENCHMARKS.md)."""
  dbg = ffi.debug_extension()  # the probes (measure_*, bench_cpu_gemv)
  if args.cpu_gemv:
    cpu_gemv()
    return
  if args.matvec:
    matvec_paths()
    return
  if args.l2:
    l2_ahead()
    return
  ext = ffi.extension()
  gpu = bool(ext.gpu_platform()) and ext.gpu_device_count() > 0
  device = jax.devices("gpu" if gpu else "cpu")[0]
  print(f"device {device.device_kind} ({device.platform}); CPU kernels: {ext.cpu_isa()}, "
        f"{ext.cpu_threads()} threads")
  n = args.total_mib * MIB
  dma = dbg.measure_dma_h2d(n, 5)
  zc = dbg.measure_zero_copy_read(n, 5, args.coherent)
  print(f"{'DMA H2D' if gpu else 'memcpy'} {dma:.1f} GB/s; streaming read of "
        f"{'mapped pinned' if gpu else 'host'} memory {zc:.1f} GB/s")
  rng = np.random.default_rng(0)
  shapes = SHAPES[:2] if args.quick else SHAPES
  batches = (1, 8) if args.quick else (1, 4, 16)
  tiers = ("host", "device") if gpu else ("host",)
  print(f"{'format':6} {'rows x cols':>12} {'MiB':>6} {'tier':>6} "
        + " ".join(f"{'b' + str(b) + ' GB/s':>10} {'%DMA':>5}" for b in batches))
  for fmt in SCALES:
    name = FORMATS[fmt].name
    for rows, cols in shapes:
      raw = random_matrix(rng, fmt, rows, cols)
      layers = max(2, min(512, -(-n // raw.size)))
      for tier_name in tiers:
        with KindTier("pinned", coherent=args.coherent) as tier:
          w = stack(raw, fmt, rows, cols, layers, tier if tier_name == "host" else None, device)
          cells = []
          for b in batches:
            t = time_scan(w, b, device, reps=3)
            gbs = raw.size * layers / t / 1e9
            cells.append(f"{gbs:10.1f} {100 * gbs / dma:5.0f}")
          print(f"{name:6} {rows:>5} x {cols:<5} {raw.size / MIB:6.1f} {tier_name:>6} "
                + " ".join(cells), flush=True)
          del w


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  sys.exit(cli())
