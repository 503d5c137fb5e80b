"""python -m jaxvt.bench offload: the origin's experiment on a GPU, with jaxvt's design.

A model with Qwen3.6-35B-A3B's exact architecture and tensor layout and valid random weights
(Q4_K_M-like formats, ~19 GiB) is written to local disk (jaxvt.gguf.synth) and loaded through
the normal GGUF path. Arms, each in its own process (the device cap is set before JAX starts):

  device      every weight in device memory, no cap (the GPU holds the whole model)
  sweep       jaxvt's host tier under an emulated 16 GiB card (XLA's pool capped with
              XLA_PYTHON_CLIENT_MEM_FRACTION, and --device-gb 16 for the planner), over offload
              budgets from the smallest the planner calls safe up to everything, plus forced
              unsafe budgets below it
  jax_pinned  routed experts in JAX's pinned_host memory kind, copied to the device per use
              (device_put inside the layer scan: the documented way), and jaxvt's host tier at
              the same placement

Each run: a 512-token prompt (prefill tok/s), then 128 greedy tokens (decode tok/s), the host
bytes read per token, the planner's predicted ms/token, and the device pool's peak use.
The sweep stops adding budgets when `--time-limit` is near; what ran is written.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import time

GiB = 1 << 30
MODEL = "/tmp/jaxvt-qwen36-35b-a3b-shape.gguf"


@dataclasses.dataclass
class Run:
  arm: str
  budget_gib: float
  ok: bool
  note: str = ""
  safe: bool = True
  host_gib: float = 0.0
  host_mb_per_token: float = 0.0
  device_read_gb: float = 0.0
  prefill_tok_s: float = 0.0
  decode_tok_s: float = 0.0
  predicted_ms: float = 0.0
  peak_gib: float = 0.0
  pool_gib: float = 0.0
  load_s: float = 0.0


def _measure(path, arm, budget, device_gb, prompt_len, gen, pattern=(), host_kind="host"):
  import jax
  import numpy as np

  import jaxvt
  from jaxvt.errors import JaxvtError
  r = Run(arm, budget, False)
  try:
    t0 = time.perf_counter()
    eng = jaxvt.load(path, max_context=prompt_len + gen + 8, offload_gb=budget, device_gb=device_gb, force=True,
                     offload_pattern=pattern, host_kind=host_kind)
    r.load_s = time.perf_counter() - t0
  except (JaxvtError, RuntimeError, MemoryError) as e:
    r.note = f"load failed: {str(e).splitlines()[0][:160]}"
    return r
  try:
    p = eng.plan
    r.safe = p.breakdown.headroom >= p.breakdown.slack
    r.host_gib = p.plan.host_bytes / GiB
    r.host_mb_per_token = p.plan.host_read_bytes / 1e6
    if host_kind == "jax_pinned":  # device_put copies whole offloaded tensors every token
      r.host_mb_per_token = p.plan.host_bytes / 1e6
      r.note = "copies every offloaded tensor per token"
    r.device_read_gb = p.plan.device_read_bytes / 1e9
    r.predicted_ms = p.prediction.ms_per_step
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, prompt_len).tolist()
    eng.generate(ids, max_tokens=3, stop_at_eos=False)  # compiles prefill and decode
    g = eng.generate(ids, max_tokens=gen, stop_at_eos=False)
    r.prefill_tok_s, r.decode_tok_s = g.stats.prefill_tok_s, g.stats.decode_tok_s
    st = jax.devices()[0].memory_stats() or {}
    r.peak_gib = st.get("peak_bytes_in_use", 0) / GiB
    r.pool_gib = st.get("bytes_limit", 0) / GiB
    r.ok = True
  except Exception as e:  # an unsafe budget may run out of device memory: that is a result
    r.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  finally:
    eng.close()
    del eng
    gc.collect()
  return r


def child(args) -> None:
  """One arm in this process; prints one JSON line per run."""
  out = lambda r: print("RUN " + json.dumps(dataclasses.asdict(r)), flush=True)
  if args.child == "device":
    from jaxvt import ffi
    import jax
    import jax.numpy as jnp
    ext = ffi.extension()
    x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB device copy: HBM read+write rate
    f = jax.jit(lambda x: x + 1)
    f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
      y = f(x)
    y.block_until_ready()
    hbm = 10 * 2 * x.nbytes / (time.perf_counter() - t) / 1e9
    del x, y
    print("RATES " + json.dumps(dict(dma=ext.measure_dma_h2d(1 << 30, 5), hbm=hbm)), flush=True)
    out(_measure(args.model, "device", 0.0, None, args.prompt, args.gen))
    return
  if args.child == "jax_pinned":
    for kind in ("jax_pinned", "host"):
      out(_measure(args.model, kind if kind == "jax_pinned" else "jaxvt@experts", 64.0, 16.0,
                   args.prompt, args.gen, pattern=("exps",), host_kind=kind))
    return
  # the sweep: the smallest safe budget first, then everything, then the rest in 1 GiB steps
  from jaxvt.offload import placement
  import dataclasses as dc
  from jaxvt import loader
  from jaxvt.gguf.names import gguf_name
  from jaxvt.gguf.reader import open_gguf
  from jaxvt.model.config import from_gguf_metadata
  from jaxvt.model.declare import declare
  gf = open_gguf(args.model)
  cfg = from_gguf_metadata(gf.metadata)
  cfg = dc.replace(cfg, tied_embeddings=gguf_name(cfg.arch, "lm_head") not in gf.tensors)
  decls = declare(cfg)
  placed = placement.plan_for_engine(cfg, decls, loader.unit_bytes(gf, cfg.arch, decls),
                                     device_gb=16.0, force=True,
                                     max_context=args.prompt + args.gen + 8)
  safe = placed.safe_budget / GiB
  top = placed.plan.max_useful_budget / GiB
  del gf
  budgets = [round(safe + 0.05, 2), round(top, 2)]
  b = int(safe) + 1.0
  while b < top:
    budgets.append(b)
    b += 1.0
  if safe >= 1.0:  # below the safe range: forced, to show the cliff
    budgets.append(round(safe - 1.0, 2))
  deadline = time.time() + args.time_limit
  print(f"SWEEP safe {safe:.2f} top {top:.2f} budgets {budgets}", flush=True)
  for b in budgets:
    if time.time() > deadline:
      print(f"SKIP {b} (time limit)", flush=True)
      continue
    out(_measure(args.model, "jaxvt", b, 16.0, args.prompt, args.gen))


def _spawn(arm: str, args, env_extra: dict, timeout: float) -> tuple[list[Run], dict]:
  env = dict(os.environ, **env_extra)
  cmd = [sys.executable, "-m", "jaxvt.bench", "offload", "--child", arm, "--model", args.model,
         "--prompt", str(args.prompt), "--gen", str(args.gen), "--time-limit",
         str(int(timeout * 0.8))]
  runs, rates = [], {}
  try:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    text = p.stdout
    if p.returncode:
      print(p.stderr[-2000:], file=sys.stderr)
  except subprocess.TimeoutExpired as e:
    text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
  for line in text.splitlines():
    if line.startswith("RUN "):
      runs.append(Run(**json.loads(line[4:])))
    elif line.startswith("RATES "):
      rates = json.loads(line[6:])
    print(line, flush=True)
  return runs, rates


def main(args) -> str:
  from jaxvt.bench import report
  t_start = time.time()
  if not os.path.exists(args.model):
    from jaxvt.gguf import synth
    t = time.time()
    synth.write_model(args.model, synth.qwen36_35b_a3b_config(n_nextn=1), "q4_k_m", seed=0)
    print(f"wrote {args.model}: {os.path.getsize(args.model) / GiB:.2f} GiB in "
          f"{time.time() - t:.0f} s", flush=True)
  import jax
  total = None
  try:
    import subprocess as sp
    mib = sp.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                 capture_output=True, text=True).stdout.split()[0]
    total = float(mib) * (1 << 20)
  except Exception:
    pass
  frac = f"{(16.0 * GiB) / (total * 0.9765) if total else 0.115:.4f}"
  left = lambda: args.time_limit - (time.time() - t_start)
  dev_runs, rates = _spawn("device", args, {}, timeout=max(60, left() * 0.25))
  pin_runs, _ = _spawn("jax_pinned", args, {"XLA_PYTHON_CLIENT_MEM_FRACTION": frac},
                       timeout=max(60, left() * 0.3))
  sweep, _ = _spawn("sweep", args, {"XLA_PYTHON_CLIENT_MEM_FRACTION": frac},
                    timeout=max(60, left() - 20))
  runs = dev_runs + pin_runs + sweep
  body = render(runs, rates, frac, os.path.getsize(args.model) / GiB, args, report.machine(),
                report.stamp())
  _plot(runs, "docs/offload_sweep.png")
  body += "\n\n![offload sweep](offload_sweep.png)\n"
  report.write_section("offload", body)
  return body


def render(runs: list[Run], rates: dict, frac: str, model_gib: float, args, machine: str,
           date: str) -> str:
  """The markdown table of a sweep."""
  dma, hbm = rates.get("dma", 0.0), rates.get("hbm", 0.0)
  lines = [f"## Offload sweep: Qwen3.6-35B-A3B-shaped model in an emulated 16 GiB card\n",
           f"Command: `python -m jaxvt.bench offload --time-limit {args.time_limit}`  ",
           f"Machine: {machine}  ", f"Date: {date}\n",
           f"Model: {model_gib:.2f} GiB file (Q4_K_M-like synthetic "
           f"weights, 40 trunk layers + MTP block). 16 GiB card: XLA pool fraction {frac}. "
           f"Same run: DMA host->device {dma:.1f} GB/s, device copy {hbm:.0f} GB/s. Prompt "
           f"{args.prompt} tokens, {args.gen} greedy tokens. Roofline = host bytes/DMA + device "
           "bytes/device copy rate.\n",
           "| arm | budget GiB | safe | host GiB | host MB/tok | prefill tok/s | decode tok/s | "
           "ms/tok | predicted ms | roofline ms | peak/pool GiB | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in runs:
    ms = 1e3 / r.decode_tok_s if r.decode_tok_s else 0.0
    roof = (r.host_mb_per_token * 1e6 / (dma * 1e9) + r.device_read_gb / hbm) * 1e3 if dma and hbm else 0
    lines.append(f"| {r.arm} | {r.budget_gib:.2f} | {'yes' if r.safe else 'NO'} | "
                 f"{r.host_gib:.2f} | {r.host_mb_per_token:.0f} | {r.prefill_tok_s:.1f} | "
                 f"{r.decode_tok_s:.2f} | {ms:.1f} | {r.predicted_ms:.1f} | {roof:.1f} | "
                 f"{r.peak_gib:.2f}/{r.pool_gib:.2f} | {r.note} |")
  return "\n".join(lines)


def _plot(runs: list[Run], path: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  fig, ax = plt.subplots(figsize=(7, 4))
  sw = sorted([r for r in runs if r.arm == "jaxvt" and r.ok], key=lambda r: r.budget_gib)
  if sw:
    ax.plot([r.budget_gib for r in sw], [r.decode_tok_s for r in sw], "o-", label="jaxvt measured")
    ax.plot([r.budget_gib for r in sw], [1e3 / r.predicted_ms for r in sw], "x--",
            label="jaxvt predicted")
  for r in runs:
    if r.ok and r.arm != "jaxvt":
      ax.axhline(r.decode_tok_s, ls=":", color="gray")
      ax.annotate(r.arm, (0, r.decode_tok_s), fontsize=8)
  ax.set_xlabel("--offload-gb (GiB in the host tier)")
  ax.set_ylabel("decode tok/s")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
