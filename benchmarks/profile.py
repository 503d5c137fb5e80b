"""python -m benchmarks.profile: where a decode step's device time goes, against its roofline.

Loads a model (the embedded default, or --model; --offload-gb / --device-gb as for jaxvt.run),
and for each row count of --rows (1: after a prefill of a short prompt; more: that many
sequences at the prompt's position) compiles one decode step, times `--steps` of them on the wall
clock, then traces the same steps with jax.profiler (a Perfetto JSON trace) and sums the
device-side events per kernel: how many kernels a step launches, how much of the step the device
is busy, and for every kernel the bytes a call reads (from the compiled program's HLO:
benchmarks.step_bytes) and its achieved GB/s. The step's roofline is the bytes a step must read
on the device (every weight once, the routed experts the rows pick, the KV cache and DeltaNet
state) over the bandwidth a plain copy kernel measures in the same run; step/roofline is that
time over the step's. Nothing is written to docs/BENCHMARKS.md; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxvt
from benchmarks import step_bytes
from benchmarks.cli import parser_of, run
from jaxvt import engine as eng_mod


def parser() -> argparse.ArgumentParser:
  ap = parser_of("profile", __doc__)
  ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
  ap.add_argument("--offload-gb", type=float, default=0.0)
  ap.add_argument("--device-gb", type=float, default=None)
  ap.add_argument("--prompt", type=int, default=32)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--rows", default="1", help="decode rows (sequences) a step, e.g. 1,8")
  ap.add_argument("--mesh", default=None, help="shard over local devices, as jaxvt.run --mesh")
  ap.add_argument("--prefill", action="store_true", help="profile one prefill of the prompt")
  ap.add_argument("--predict", default=None,
                  help="H:D[:S]: Products.predict_after_host, predict_after_device (predict_sets)")
  ap.add_argument("--products", default=None,
                  help="FIELD=VALUE[,...]: the tuning row's fields replaced (e.g. fused_norm=0, "
                       "the step without the fused residual norm)")
  return ap


def products_exec(ex, spec: str):
  """ex with the tuning row's fields replaced as spec says ("fused_norm=0,attn_chunk=64"); a
  field's value is parsed as its type (bool: 0/1/true/false)."""
  fields = {f.name: f for f in dataclasses.fields(ex.products)}
  over = {}
  for item in filter(None, spec.split(",")):
    name, _, value = item.partition("=")
    if name not in fields or not value:
      raise SystemExit(f"profile: --products takes FIELD=VALUE with FIELD one of "
                       f"{', '.join(fields)}; got {item!r}")
    kind = type(getattr(ex.products, name))
    over[name] = (value.lower() in ("1", "true", "yes") if kind is bool else kind(value))
  return dataclasses.replace(ex, products=dataclasses.replace(ex.products, **over))


def device_events(trace: dict, host_fallback: bool = True) -> list[dict]:
  """Complete ('X') events of device processes (names like '/device:GPU:0'); with none and
  `host_fallback`, XLA's host ops (the CPU backend), so the tool still says something there."""
  names = {}
  for e in trace.get("traceEvents", []):
    if e.get("ph") == "M" and e.get("name") == "process_name":
      names[e.get("pid")] = str(e.get("args", {}).get("name", ""))
  pids = {p for p, n in names.items() if "/device:" in n and "CPU" not in n.upper()}
  if not pids and host_fallback:
    pids = {p for p, n in names.items() if "XLA" in n or "/host:CPU" in n}
  return [e for e in trace.get("traceEvents", [])
          if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e]


def trace(fn, log_dir: str) -> dict:
  """Runs fn() under jax.profiler and returns the Perfetto trace (a dict); raises OSError,
  RuntimeError or ValueError when no trace could be made."""
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    fn()
  files = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise OSError("the profiler wrote no Perfetto trace")
  with gzip.open(files[0], "rt") as f:
    return json.load(f)


def device_seconds(fn, match: str) -> float:
  """Seconds the device spent in kernels whose name contains `match` while fn() ran; 0 when the
  profiler is unavailable or saw no device (e.g. on the CPU)."""
  with tempfile.TemporaryDirectory() as d:
    try:
      t = trace(fn, d)
    except (OSError, RuntimeError, ValueError):
      return 0.0
  return sum(float(e["dur"]) for e in device_events(t, host_fallback=False)
             if match in str(e.get("name"))) / 1e6


def summarize(events: list[dict], steps: int, top: int = 25) -> tuple[str, float, int]:
  """A table of the costliest event names per step; returns (table, busy us/step, events/step)."""
  tot, cnt = collections.Counter(), collections.Counter()
  for e in events:
    name = str(e["name"])[:70]
    tot[name] += float(e["dur"])
    cnt[name] += 1
  busy = sum(tot.values()) / max(steps, 1)
  n = sum(cnt.values()) / max(steps, 1)
  lines = [f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  name"]
  for name, us in tot.most_common(top):
    lines.append(f"{us / steps:9.1f} {cnt[name] / steps:10.1f} {us / cnt[name]:8.2f}  {name}")
  return "\n".join(lines), busy, int(round(n))


def _profiled(fn, steps: int, top: int, out: list[str]):
  """(table, busy us/step, events/step) of fn()'s device events, or None with a line in out
  when no trace can be taken."""
  with tempfile.TemporaryDirectory() as d:
    try:
      tr = trace(fn, d)
    except (OSError, RuntimeError, ValueError) as e:
      out.append(f"no trace: {type(e).__name__}: {e}")
      return None
  return summarize(device_events(tr), steps, top)


def _prefill(eng, ids, args, mesh) -> str:
  """Where one prefill of the prompt spends its device time (after two warm-up prefills)."""
  def once():
    logits, _ = eng.prefill(ids)
    logits.block_until_ready()
  once()
  once()
  t0 = time.perf_counter()
  once()
  wall_ms = (time.perf_counter() - t0) * 1e3
  out = [f"prefill of {len(ids)} tokens, mesh {mesh or 'none'}, offload "
         f"{eng.plan.plan.host_bytes / 2**30:.2f} GiB: wall {wall_ms:.1f} ms "
         f"({len(ids) / wall_ms * 1e3:.1f} tok/s)"]
  got = _profiled(once, 1, args.top, out)
  if got:
    table, busy, n = got
    out += [f"device busy {busy / 1e3:.1f} ms over {n} events (all devices)", table]
  eng.close()
  return "\n".join(out)


def predict_products(products, spec: str):
  """products with predict_after_host, predict_after_device (and predict_sets) from "H:D[:S]"
  ("off": 0:0); "...@B": the inline fetch (predict_inline) with B blocks an expert (0: the
  default); "/K": the counts for a layer with K host-tier routed stacks, scaled per layer
  (predict_scale; without it the counts as given). Exec.concurrent is set apart (predict_exec)."""
  spec, _, scale = spec.partition("/")
  spec, _, blocks = spec.partition("@")
  v = [0, 0] if spec == "off" else [int(a) for a in spec.split(":")]
  if len(v) not in (2, 3):
    raise ValueError(f"predict variant {spec!r}: H:D or H:D:S")
  kw = dict(predict_after_host=v[0], predict_after_device=v[1], predict_inline=bool(blocks),
            predict_blocks=int(blocks or 0), predict_scale=int(scale or 0))
  if len(v) > 2:
    kw["predict_sets"] = v[2]
  return dataclasses.replace(products, **kw)


def predict_exec(ex, spec: str):
  """ex with predict_products(spec), and concurrent scheduling where spec ends in "+c" (e.g.
  "off+c", "2:2:1@16+c", "2:2@8/3+c": GPU_PRODUCTS' rule)."""
  spec, c = (spec[:-2], True) if spec.endswith("+c") else (spec, False)
  return dataclasses.replace(ex, products=predict_products(ex.products, spec), concurrent=c)


def bytes_table(events: list[dict], reads: dict[str, int], steps: int, top: int):
  """Per kernel (its name and the bytes a call reads), the time and achieved GB/s of a step's
  device events; reads maps HLO instruction names (step_bytes.hlo_read_bytes) to bytes. An event
  is matched by its trace's hlo_op, else by its own name. Returns (table, the share of device
  time whose bytes are known, bytes per step)."""
  norm = {step_bytes.normalized(k): v for k, v in reads.items()}
  tot, cnt = collections.Counter(), collections.Counter()
  known_us = all_us = per_step = 0.0
  for e in events:
    args = e.get("args") or {}
    op = str(args.get("hlo_op", "") or "")
    b = reads.get(op, norm.get(step_bytes.normalized(op or str(e["name"]))))
    key = (str(e["name"])[:60], -1 if b is None else int(b))
    tot[key] += float(e["dur"])
    cnt[key] += 1
    all_us += float(e["dur"])
    if b is not None:
      known_us += float(e["dur"])
      per_step += b / steps
  lines = [f"{'us/step':>8} {'calls':>6} {'us/call':>8} {'KB/call':>9} {'GB/s':>7}  kernel"]
  for (name, b), us in tot.most_common(top):
    n = cnt[(name, b)]
    kb = f"{b / 1e3:9.1f}" if b >= 0 else f"{'?':>9}"
    gbs = f"{b * n / us / 1e3:7.0f}" if b >= 0 and us > 0 else f"{'?':>7}"
    lines.append(f"{us / steps:8.1f} {n / steps:6.1f} {us / n:8.2f} {kb} {gbs}  {name}")
  return "\n".join(lines), known_us / max(all_us, 1e-9), per_step


def _decode_profile(eng, args, rows: int, copy: float) -> list[str]:
  """One rows-wide decode step: wall time, then the kernel table with bytes and GB/s, and the
  step against its roofline (token bytes in the device tier over the copy bandwidth)."""
  if rows == 1:
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, args.prompt).tolist()
    _, cache = eng.prefill(ids)
  else:  # rows sequences at the prompt's position (their cache's earlier positions are zeros)
    cache = eng.new_cache(rows)
  pos = args.prompt
  key = jax.random.key(0)
  params = jaxvt.SamplingParams()
  kw = dict(cfg=eng.cfg, ex=eng.ex, params=params)
  toks = jnp.full((rows, 1), 7, jnp.int32)

  # one compiled program for every step (kv_len covering the last one), so the trace's kernels
  # carry the names of the HLO whose bytes are counted
  kv_len = eng.kv_len(pos + 2 * args.steps + 4)
  fn = eng_mod.decode_sample_fn.lower(eng.weights, cache, toks, jnp.full((rows, 1), pos, jnp.int32),
                                      key, kv_len=kv_len, **kw).compile()
  try:
    reads = step_bytes.hlo_read_bytes(fn.as_text(), eng.weights)
  except (ValueError, IndexError) as e:  # the table then has no bytes; the rest still says something
    print(f"no bytes from the HLO: {type(e).__name__}: {e}", file=sys.stderr)
    reads = {}

  def step(cache, pos):
    return fn(eng.weights, cache, toks, jnp.full((rows, 1), pos, jnp.int32), key)

  for _ in range(3):  # compile and warm up
    out, cache = step(cache, pos)
    pos += 1
  out.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(args.steps):
    out, cache = step(cache, pos)
    pos += 1
  out.block_until_ready()
  wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
  tb = step_bytes.token_bytes(eng.weights, cache, eng.cfg, rows, pos + args.steps // 2)
  res = [f"rows {rows}: wall {wall_ms:.2f} ms/step ({rows / wall_ms * 1e3:.1f} tok/s, "
         f"{args.steps} steps)"]

  def steps():
    nonlocal out, cache, pos
    for _ in range(args.steps):
      out, cache = step(cache, pos)
      pos += 1
    out.block_until_ready()

  with tempfile.TemporaryDirectory() as d:
    try:
      events = device_events(trace(steps, d))
    except (OSError, RuntimeError, ValueError) as e:
      return res + [f"no trace: {type(e).__name__}: {e}"]
  _, busy, n = summarize(events, args.steps, args.top)
  table, known, per_step = bytes_table(events, reads, args.steps, args.top)
  roof_ms = tb["device"] / (copy * 1e9) * 1e3 if copy else 0.0
  res += [f"device busy {busy / 1e3:.2f} ms/step over {n} kernels/step "
          f"({busy / 1e3 / wall_ms:.0%} of the wall time); bytes known for {known:.0%} of it: "
          f"{per_step / 1e6:.1f} MB/step read by the kernels",
          f"roofline: a step must read {tb['device'] / 1e6:.1f} MB on the device (weights "
          f"{(tb['weights'] - tb['host']) / 1e6:.1f}, KV/state {tb['state'] / 1e6:.1f}; "
          f"{tb['host'] / 1e6:.1f} MB more in the host tier, not in this roofline) = "
          f"{roof_ms:.3f} ms at the copy's {copy:.0f} GB/s; step/roofline "
          f"{roof_ms / max(wall_ms, 1e-9):.3f} (wall), {roof_ms / max(busy / 1e3, 1e-9):.3f} "
          f"(device busy)", table]
  return res


def main(args) -> str:
  mesh = getattr(args, "mesh", None)
  rows = [int(r) for r in str(getattr(args, "rows", "1")).split(",")]
  eng = jaxvt.load(args.model, max_context=args.prompt + args.steps * 3 + 16,
                   offload_gb=args.offload_gb, device_gb=args.device_gb, force=True, mesh=mesh)
  if getattr(args, "predict", None):
    eng.ex = predict_exec(eng.ex, args.predict)
  if getattr(args, "products", None):
    eng.ex = products_exec(eng.ex, args.products)
  if getattr(args, "prefill", False):
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, args.prompt).tolist()
    return _prefill(eng, ids, args, mesh)
  copy = step_bytes.copy_gbps() if jax.default_backend() != "cpu" else 0.0
  out = [f"model {eng.path}: {eng.cfg.arch}, {eng.cfg.n_layers} layers; predict "
         f"{getattr(args, 'predict', None) or 'default'}; products "
         f"{getattr(args, 'products', None) or 'default'}; offload "
         f"{eng.plan.plan.host_bytes / 2**30:.2f} GiB; predicted "
         f"{eng.plan.prediction.ms_per_step:.2f} ms/step; device {jax.devices()[0].device_kind}; "
         f"copy {copy:.0f} GB/s (read + written)"]
  for r in rows:
    out += _decode_profile(eng, args, r, copy)
  eng.close()
  return "\n".join(out)


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  sys.exit(cli())
