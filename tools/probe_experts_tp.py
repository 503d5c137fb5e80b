"""The routed-experts kernel as one device of a tp=2 mesh sees it (GPU; run on the lent H200):
512 tokens, top-8 of 256 Q4_K experts of Qwen3.6-35B-A3B's shapes, of which this device holds
experts 0-127. Times ops.qmatmul_experts for one device holding all 256 experts, and for the
sharded device with the slots of the other device's experts routed to local expert 0 (weight 0:
the old scheme) or routed nowhere (id -1: jaxvt.model.moe.local_experts).
  python tools/probe_experts_tp.py
"""
import time
import numpy as np, jax
from jaxvt.bench import kernels as kb
from jaxvt.ffi import ops
from jaxvt.qweight import QMeta, QWeight, split_u64

def run(rows, cols, ids_np, E, reps=5):
  dev = jax.devices()[0]
  rng = np.random.default_rng(0)
  raw = kb.random_matrix(rng, 12, E * rows, cols)
  w = QWeight(jax.device_put(raw.reshape(1, -1), dev), jax.device_put(split_u64(np.zeros(1, np.uint64)), dev),
              jax.device_put(np.array([12], np.int32), dev), QMeta(rows, cols, E, (12,), 1, ()))
  T, k = ids_np.shape
  x = jax.device_put(np.ones((T, k, cols) if cols != 2048 else (T, cols), np.float32) * 1e-3, dev)
  ids = jax.device_put(ids_np, dev)
  f = jax.jit(lambda x, ids: ops.qmatmul_experts(x, w, 0, ids, "f32"))
  f(x, ids).block_until_ready()
  t = time.perf_counter()
  for _ in range(reps):
    y = f(x, ids)
  y.block_until_ready()
  return (time.perf_counter() - t) / reps * 1e3

rng = np.random.default_rng(1)
T, k = 512, 8
g = np.stack([rng.choice(256, k, replace=False) for _ in range(T)]).astype(np.int32)
for rows, cols in [(512, 2048), (2048, 512)]:
  one = run(rows, cols, g, 256)
  local = g - 128 * 0  # device 0 of tp=2 holds experts 0..127
  mine = local < 128
  old = run(rows, cols, np.where(mine, local, 0).astype(np.int32), 128)
  new = run(rows, cols, np.where(mine, local, -1).astype(np.int32), 128)
  print(f"experts {rows}x{cols}, 512 tokens top-8: one device (256 experts) {one:.2f} ms; tp=2 device 0 "
        f"(128 experts, {100 * (~mine).mean():.0f}% of slots elsewhere): foreign slots on expert 0 {old:.2f} ms, "
        f"routed nowhere (-1) {new:.2f} ms", flush=True)
