"""Time of one attention decode step between the projections at the Qwen3.6-35B-A3B shape (16
heads over 2 kv heads of 256, 64 rotary dims, gate, q/k norm), fused (jaxvt.ffi.attn.attn_step,
Products.attn_fused) against the model's jnp path (jaxvt.model.layers.attend, the XLA kernels),
at several positions: python tools/attn_probe.py [--positions 100,600,2000,8000] [--steps 200]

Each arm runs `steps` steps in one jitted loop over the 10 attention layers' cache stacks (the
decode program's shape: the layer index traced, the stacks carried and donated); prints
microseconds per step and the largest difference of o between the arms at the last step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.ffi import attn
from jaxvt.model.layers import Exec, attend
from jaxvt.model_fns import KV_BUCKETS, bucket

H, K, D, A = 16, 2, 256, 10
PARAMS = dict(theta=1e7, rope_dim=64, interleaved=False, eps=1e-6, gate=True, qk_norm=True)


def arm(fused: bool, steps: int, kv_len: int):
  """A jitted loop of `steps` decode steps on layers i % A; returns (o, k_cache, v_cache)."""

  def step(i, carry, x):
    _, kc, vc = carry
    ai = (i % A).astype(jnp.int32)
    if fused:
      return attn.attn_step(x["q"], x["k"], x["v"], x["qn"], x["kn"], kc, vc, ai, x["pos"],
                            kv_len=kv_len, **PARAMS)
    o, kc, vc = attend(x["q"][:, None], x["k"][:, None], x["v"][:, None], x["qn"][ai],
                       x["kn"][ai], kc, vc, ai, x["pos"][:, None], kv_len=kv_len,
                       ex=Exec(kernels=True, numerics="q8"), **PARAMS)
    return o[:, 0], kc, vc

  def run(x, kc, vc):
    o = jnp.zeros((1, H * D), jnp.float32)
    return jax.lax.fori_loop(0, steps, lambda i, c: step(i, c, x), (o, kc, vc))

  return jax.jit(run, donate_argnums=(1, 2))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--positions", default="100,600,2000,8000")
  ap.add_argument("--steps", type=int, default=200)
  args = ap.parse_args()
  positions = [int(p) for p in args.positions.split(",")]
  S = max(bucket(p + 1, KV_BUCKETS, 1 << 30) for p in positions)
  rng = np.random.default_rng(0)
  n = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
  print(f"{jax.devices()[0].device_kind}: cache of {S} positions, {A} layers, {args.steps} steps")
  print(f"{'position':>9} {'kv_len':>7} {'fused us':>9} {'jnp us':>9} {'max |do|':>9}")
  for pos in positions:
    kv_len = bucket(pos + 1, KV_BUCKETS, S)
    x = dict(q=n(1, H * 2 * D), k=n(1, K * D), v=n(1, K * D), qn=1 + 0.1 * n(A, D),
             kn=1 + 0.1 * n(A, D), pos=jnp.asarray([pos], jnp.int32))
    out, us = [], []
    caches = rng.standard_normal((2, A, 1, S, K, D)).astype(np.float32)
    for fused in (True, False):
      fn = arm(fused, args.steps, kv_len)
      kc, vc = jnp.asarray(caches[0]), jnp.asarray(caches[1])
      o, kc, vc = fn(x, kc, vc)  # compile and warm up
      jax.block_until_ready(o)
      t = time.perf_counter()
      o, kc, vc = fn(x, kc, vc)
      jax.block_until_ready(o)
      us.append((time.perf_counter() - t) / args.steps * 1e6)
      out.append(np.asarray(o))
      del kc, vc
    del caches
    diff = float(np.abs(out[0] - out[1]).max())
    print(f"{pos:>9} {kv_len:>7} {us[0]:>9.1f} {us[1]:>9.1f} {diff:>9.2e}")


if __name__ == "__main__":
  main()
