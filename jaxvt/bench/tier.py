"""python -m jaxvt.bench tier: the host tier's read rate against the link, in one run.

host_linear (`ops.qmatmul` on host-tier layers) for Q4_K, Q6_K, Q4_1, Q8_0 and BF16 matrices of
LLM shapes at batch 1, 4 and 16, and host_moe (`ops.qmatmul_experts` with top-8 of 256 Q4_K
experts, Qwen3.6-35B-A3B's expert shapes) counting only the routed experts' bytes. Each rate is
weight bytes read per second, divided by the same run's cudaMemcpy host->device rate.
Layers are replicated at distinct addresses so every call reads memory the GPU has not cached.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi
from jaxvt.ffi import kernel_bench as kb
from jaxvt.ffi import ops
from jaxvt.offload.host_tier import HostTier
from jaxvt.qweight import HOST_BIT, QMeta, QWeight, split_u64

MIB = 1 << 20


def expert_stack(rng, tier: HostTier, layers: int, experts: int, rows: int, cols: int, device):
  raw = kb.random_matrix(rng, 12, experts * rows, cols)
  table = np.zeros(layers, np.uint64)
  for l in range(layers):
    buf = tier.alloc(raw.size)
    buf.array[:] = raw
    table[l] = buf.device_address
  fmts = np.full(layers, 12 | HOST_BIT, np.int32)
  meta = QMeta(rows, cols, experts, (12,), layers, tuple(range(layers)))
  w = QWeight(jnp.zeros((1, 1), jnp.uint8, device=device), jax.device_put(split_u64(table), device),
              jax.device_put(fmts, device), meta)
  return w, raw.size // experts


def time_experts(w: QWeight, ids: jax.Array, device, reps: int = 3) -> float:
  """Seconds for one pass of qmatmul_experts over every layer (fresh routing per layer)."""
  T, k = ids.shape[1:]
  x = jax.device_put(jnp.ones((T, w.meta.cols), jnp.float32) * 1e-3, device)

  @jax.jit
  def run(x, ids):
    def body(acc, l):
      y = ops.qmatmul_experts(x, w, l, ids[l])
      return acc + y[:, 0, 0], None
    return jax.lax.scan(body, jnp.zeros((T,), jnp.float32),
                        jnp.arange(w.meta.n_layers, dtype=jnp.int32))[0]

  run(x, ids).block_until_ready()
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    run(x, ids).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return best


def main(args) -> str:
  from jaxvt.bench import report
  ext = ffi.extension()
  gpu = bool(ext.gpu_platform()) and ext.gpu_device_count() > 0
  device = jax.devices("gpu" if gpu else "cpu")[0]
  n = args.total_mib * MIB
  dma = ext.measure_dma_h2d(n, 5)
  zc = ext.measure_zero_copy_read(n, 5, False)
  batches = (1, 4, 16)
  rng = np.random.default_rng(0)
  link = "cudaMemcpy H2D" if gpu else "memcpy"
  out = [f"## Host tier read rate ({device.device_kind})\n",
         f"Command: `python -m jaxvt.bench tier --total-mib {args.total_mib}`  ",
         f"Machine: {report.machine()}  ", f"Date: {report.stamp()}\n",
         f"Same run: {link} {dma:.1f} GB/s; streaming read of mapped pinned memory "
         f"{zc:.1f} GB/s. Rates are weight bytes per second; % is of the {link} rate.\n",
         "### host_linear (qmatmul, host-tier weights)\n",
         "| format | rows x cols | MiB | " + " | ".join(f"batch {b} GB/s (%)" for b in batches)
         + " |", "|---|---|---|" + "---|" * len(batches)]
  for fmt, (name, *_r) in kb.FORMATS.items():
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
      out.append(f"| {name} | {rows} x {cols} | {raw.size / MIB:.1f} | " + " | ".join(cells)
                 + " |")
  E, k, rows, cols = 256, 8, 512, 2048
  out += ["", f"### host_moe (qmatmul_experts: top-{k} of {E} Q4_K experts, {rows} x {cols} "
          "each; gate/up shape of Qwen3.6-35B-A3B)\n",
          "| tokens | distinct experts read / layer | bytes read / layer | GB/s (%) |",
          "|---|---|---|---|"]
  with HostTier() as tier:
    layers = 24
    w, ebytes = expert_stack(rng, tier, layers, E, rows, cols, device)
    for T in (1, 4, 16):
      ids_np = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
                         for _ in range(layers)]).astype(np.int32)
      distinct = np.mean([len(np.unique(ids_np[l])) for l in range(layers)])
      t = time_experts(w, jax.device_put(ids_np, device), device)
      read = distinct * ebytes
      gbs = read * layers / t / 1e9
      out.append(f"| {T} | {distinct:.1f} | {read / MIB:.2f} MiB | {gbs:.1f} "
                 f"({100 * gbs / dma:.0f}%) |")
    del w
  body = "\n".join(out)
  report.write_section(f"tier-{device.platform}", body)
  return body
