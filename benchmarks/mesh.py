"""python -m benchmarks.mesh: tensor parallelism against one device, with and without offload.

The offload sweep's model (benchmarks.offload.MODEL: Qwen3.6-35B-A3B's
architecture and tensor layout, valid random Q4_K_M-like weights, ~19 GiB, written by
jaxvt.synth when missing) is placed by `jaxvt.load(model, mesh=M, offload_gb=B, force=True)`
for every mesh M of `--meshes` ("1": one device, no mesh; "tp=2": both GPUs of a 2-GPU host; a
mesh of two axes is written with "+": "tp=2+ep=2"; "/Np" runs the mesh over N processes, each
with its share of the devices, joined by `jax.distributed.initialize` over a loopback
coordinator: "tp=2/2p" is one GPU a process, as over two hosts) and every per-device budget B of `--budgets`
(GiB, "auto": the planner's pick, "all": every offloadable weight, i.e. a budget above what the
plan can move, `Plan.max_useful_budget`). Each point is measured as an offload sweep point is: a
warm-up generate (compiles) then a timed one, a `--prompt`-token random prompt (prefill tok/s)
and `--gen` greedy tokens (decode tok/s); its greedy tokens are kept, and a sharded point's are
compared with the one-device point's at the same budget label.

Each point runs in a child process of its own (`--child I`), one after the other, after one
(`--child -1`) that lists the devices and, before the model is written, refuses a mesh larger
than they allow. So the parent never touches a GPU, a crash costs one point, each point's peak
memory is its own, and with `--device-gb N` the children's XLA pool is capped at N GiB per GPU
as the offload sweep caps it (XLA_PYTHON_CLIENT_MEM_FRACTION, set before JAX starts) while the
planner plans for N GiB. A point whose placement repeats one already measured on the same mesh
(where the model fits, "auto" offloads nothing, as "0") only plans, and repeats that row's
numbers. Points run budget by budget (one device, then each mesh), so that a time limit that
comes first skips whole comparisons; what ran is written (section `mesh` of docs/BENCHMARKS.md,
or `--out`), and every row with its tokens to $OUT/mesh_runs.json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import re
import socket
import sys
import time

import jax
import numpy as np

import jaxvt
from benchmarks import arms, report
from benchmarks.cli import parser_of, run
from benchmarks.offload import (MODEL, Child, GiB, ensure_model, gpu_lock, pool_fraction,
                                 print_row, warm_up)
from jaxvt import JaxvtError
from jaxvt.parallel import mesh as mesh_mod

ALL_GIB = 1024.0  # "all": a per-device budget above any plan's max_useful_budget


def parser() -> argparse.ArgumentParser:
  ap = parser_of("mesh", __doc__, child=int)
  ap.add_argument("--model", default=MODEL)
  ap.add_argument("--meshes", default="1,tp=2",
                  help="comma list; 1 = one device, no mesh; join two axes with +: tp=2+ep=2")
  ap.add_argument("--budgets", default="0,auto,all",
                  help="comma list of per-device offload GiB, auto, all (every offloadable weight)")
  ap.add_argument("--device-gb", type=float, default=None,
                  help="emulate a card of this many GiB per device (XLA pool cap + planner)")
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--gen", type=int, default=128)
  ap.add_argument("--time-limit", type=int, default=480)
  ap.add_argument("--out", default="docs/BENCHMARKS.md",
                  help="the file whose mesh section to write")
  ap.add_argument("--section", default="mesh",
                  help="the section's name (e.g. mesh-cpu: another machine's table beside it)")
  ap.add_argument("--known", default="{}", help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)  # a /Np point's child
  ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
  ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  return ap


@dataclasses.dataclass
class Point:
  mesh: str  # "1" (one device) or the mesh, "tp=2"
  budget: str  # the --budgets label: GiB per device, "auto" or "all"
  ok: bool = False
  note: str = ""
  devices: int = 1
  placement: str = ""  # digest of which weights the plan put where
  same_as: str = ""  # the budget label, same mesh, whose placement this point repeats
  safe: bool = True  # the planner's verdict (run with force either way)
  host_gib: float = 0.0  # per device
  device_gib: float = 0.0  # weights in each device's memory
  prefill_tok_s: float = 0.0
  decode_tok_s: float = 0.0
  gen_tokens: int = 0
  tokens: list = dataclasses.field(default_factory=list)
  load_s: float = 0.0  # jaxvt.load: open, plan, place (and XLA's memory analysis, one device)
  compile_s: float = 0.0  # the warm-up generate
  measure_s: float = 0.0
  peak_gib: float = 0.0  # the largest device's peak


class _Repeat(Exception):
  """Raised from `on_plan`: the placement of the budget label in args[0] (not loaded again)."""


# ---- the points -------------------------------------------------------------------------------

def parse_meshes(text: str) -> list[str]:
  """'1,tp=2,tp=2+ep=2,tp=2/2p' -> ['1', 'tp=2', 'tp=2,ep=2', 'tp=2/2p'] (each mesh as
  jaxvt.parallel.mesh names it; /Np: over N processes, N dividing the mesh's devices)."""
  out = []
  for item in text.split(","):
    if not item.strip():
      continue
    item, _, procs = item.strip().partition("/")
    spec = mesh_mod.parse(item.replace("+", " "))
    label = str(spec) if spec else "1"
    if procs:
      n = int(procs[:-1]) if procs[:-1].isdigit() and procs.endswith("p") else 0
      if n < 2 or spec is None or spec.size % n:
        raise JaxvtError(f"--meshes {text!r}: '/{procs}' must be /Np with N >= 2 processes "
                         f"dividing the mesh's devices; write e.g. tp=2/2p")
      label += f"/{n}p"
    if label not in out:
      out.append(label)
  if not out:
    raise JaxvtError(f"--meshes {text!r} names no mesh; write e.g. --meshes 1,tp=2")
  return out


def parse_budgets(text: str) -> list[str]:
  """'0,auto,all,4' -> the labels, each GiB >= 0, 'auto' or 'all'."""
  out = []
  for item in (b.strip() for b in text.split(",")):
    if not item:
      continue
    if item not in ("auto", "all"):
      try:
        ok = 0 <= float(item) < float("inf")
      except ValueError:
        ok = False
      if not ok:
        raise JaxvtError(f"--budgets {text!r}: '{item}' is not GiB >= 0, 'auto' or 'all'")
    if item not in out:
      out.append(item)
  if not out:
    raise JaxvtError(f"--budgets {text!r} names no budget; write e.g. --budgets 0,auto,all")
  return out


def points(args) -> list[tuple[str, str]]:
  """(mesh, budget) in run order: budget by budget, each mesh in --meshes order."""
  if args.prompt < 1 or args.gen < 2:
    raise JaxvtError(f"--prompt must be >= 1 and --gen >= 2 (decode tok/s counts the tokens "
                     f"after the first), got {args.prompt} and {args.gen}")
  if args.device_gb is not None and args.device_gb <= 0:
    raise JaxvtError(f"--device-gb must be positive (got {args.device_gb})")
  meshes = parse_meshes(args.meshes)
  return [(m, b) for b in parse_budgets(args.budgets) for m in meshes]


def mesh_size(label: str) -> int:
  return 1 if label == "1" else mesh_mod.parse(mesh_arg(label)).size


def mesh_arg(label: str) -> str:
  """The --mesh of a label ('tp=2/2p' -> 'tp=2')."""
  return label.partition("/")[0]


def processes(label: str) -> int:
  """How many processes a label's point runs over ('tp=2/2p' -> 2)."""
  _, _, procs = label.partition("/")
  return int(procs[:-1]) if procs else 1


def budget_gib(label: str) -> float | str:
  return "auto" if label == "auto" else ALL_GIB if label == "all" else float(label)


def placement_key(plan) -> str:
  return hashlib.sha1(repr(plan.kinds).encode()).hexdigest()[:16]


# ---- one point, in a child ----------------------------------------------------------------------

def measure(args, mesh: str, budget: str, known: dict) -> Point:
  """Loads, warms up and times one point in this process; `known`: {placement: budget label}
  of this mesh's points measured before (a repeated placement is not loaded)."""

  r = Point(mesh, budget, devices=mesh_size(mesh))

  def on_plan(placed):
    p = placed.plan
    r.placement, r.devices = placement_key(p), placed.devices
    r.host_gib, r.device_gib = p.host_bytes / GiB, p.device_bytes / GiB
    r.safe = placed.breakdown.headroom >= placed.breakdown.slack
    if r.placement in known:
      raise _Repeat(known[r.placement])

  t0 = time.perf_counter()
  eng = None
  try:
    eng = jaxvt.load(args.model, max_context=args.prompt + args.gen + 8,
                     offload_gb=budget_gib(budget), device_gb=args.device_gb, force=True,
                     mesh=None if mesh == "1" else mesh_arg(mesh), on_plan=on_plan)
    arms.no_stops(eng)  # timed runs generate exactly their token counts
    r.load_s = time.perf_counter() - t0
    r.safe = eng.memory.headroom >= eng.memory.slack  # after XLA's own analysis (one device)
    ids = np.random.default_rng(0).integers(10, eng.cfg.vocab_size - 10, args.prompt).tolist()
    t1 = time.perf_counter()
    if eng.ex.par.size == 1:
      warm_up(eng, ids, overlap=r.safe)  # the offload sweep's: prefill and decode compile at once
    else:  # one program at a time (two programs' collectives never interleave on the devices),
      # and the very programs the timed generate runs, so that none compiles inside it
      eng.generate(ids, max_tokens=args.gen)
    t2 = time.perf_counter()
    g = eng.generate(ids, max_tokens=args.gen)
    r.compile_s, r.measure_s = t2 - t1, time.perf_counter() - t2
    r.prefill_tok_s, r.decode_tok_s = g.stats.prefill_tok_s, g.stats.decode_tok_s
    r.tokens, r.gen_tokens = list(g.tokens), len(g.tokens)
    devs = [d for d in eng.ex.par.devices if d in jax.local_devices()]
    r.peak_gib = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in devs) / GiB
    r.ok = True
  except _Repeat as e:
    r.same_as, r.ok, r.load_s = str(e.args[0]), True, time.perf_counter() - t0
  except (JaxvtError, RuntimeError, MemoryError, ValueError) as e:  # e.g. out of memory
    r.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    r.load_s = r.load_s or time.perf_counter() - t0
  finally:
    if eng is not None:  # the arrays that read the host tier go before its buffers
      eng.weights = {}
      gc.collect()
      eng.close()
  return r


def child(args) -> None:
  """`--child -1`: a META line (the devices JAX sees), or an ERROR line when a mesh of --meshes
  needs more of them; `--child I`: point I of `points(args)` in this process, its RUN line."""
  pts = points(args)
  if args.child < 0:
    try:
      for m in dict.fromkeys(m for m, _ in pts):
        if m != "1":
          mesh_mod.build(mesh_mod.parse(mesh_arg(m)))
    except JaxvtError as e:
      print(f"ERROR {e}", flush=True)
      return
    devs = jax.devices()
    kinds = collections.Counter(f"{d.device_kind} ({d.platform})" for d in devs)
    meta = dict(devices=", ".join(f"{n} x {k}" for k, n in kinds.items()), count=len(devs),
                machine=report.machine())
    print("META " + json.dumps(meta), flush=True)
    return
  mesh, budget = pts[args.child]
  if args.coordinator:  # one process of a /Np point: its share of the devices
    per = mesh_size(mesh) // args.num_processes
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               local_device_ids=list(range(args.process_id * per,
                                                           (args.process_id + 1) * per)))
  lead = args.process_id == 0
  lock = gpu_lock() if lead and jax.devices()[0].platform != "cpu" else contextlib.nullcontext()
  with lock:
    r = measure(args, mesh, budget, json.loads(args.known))
  if lead:
    print_row(r)


# ---- the run ------------------------------------------------------------------------------------

def _child_cmd(args, i: int, known: dict) -> list[str]:
  cmd = [sys.executable, "-m", "benchmarks.mesh", "--child", str(i), "--model", args.model,
         "--meshes", args.meshes, "--budgets", args.budgets, "--prompt", str(args.prompt),
         "--gen", str(args.gen), "--known", json.dumps(known)]
  return cmd + (["--device-gb", str(args.device_gb)] if args.device_gb is not None else [])


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_point(args, i: int, mesh: str, known: dict, env: dict, err, log,
               deadline: float) -> Child:
  """Point i's child, or (a /Np mesh) its N children joined over a loopback coordinator, each
  with its share of the devices (CPU: XLA's fake-device count; GPU: local_device_ids); the
  child of process 0 is returned (the others print no row)."""
  n = processes(mesh)
  if n == 1:
    return Child(_child_cmd(args, i, known), env, err(i), log, row=Point).wait(deadline)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+",
                 f"--xla_force_host_platform_device_count={mesh_size(mesh) // n}",
                 os.environ.get("XLA_FLAGS", ""))
  co = f"127.0.0.1:{_free_port()}"
  kids = [Child(_child_cmd(args, i, known) + ["--coordinator", co, "--num-processes", str(n),
                                              "--process-id", str(k)],
                {**env, "XLA_FLAGS": flags}, err(f"{i}.{k}") if k else err(i),
                log if k == 0 else (lambda line: None), row=Point) for k in range(n)]
  for c in kids:
    c.wait(deadline)
  return kids[0]


def _failed(c: Child, mesh: str, budget: str) -> Point:
  """The row of a child that printed none: killed at the time limit, or crashed."""
  if c.p.returncode is not None and c.p.returncode < 0:
    note = f"killed (signal {-c.p.returncode}; the time limit or a crash)"
    return Point(mesh, budget, devices=mesh_size(mesh), note=note)
  with open(c.err_path) as f:
    tail = [l.strip() for l in f.read().splitlines() if l.strip()]
  last = tail[-1][:160] if tail else "no output"
  return Point(mesh, budget, devices=mesh_size(mesh),
               note=f"child exited {c.p.returncode}: {last}")


def main(args) -> str:
  t_start = time.time()
  log = lambda s: print(s, flush=True)
  pts = points(args)
  env = {}
  if args.device_gb is not None:
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = pool_fraction(args.device_gb)
  deadline = t_start + args.time_limit - 10
  out_dir = os.environ.get("OUT", "/tmp")
  err = lambda i: os.path.join(out_dir, f"mesh_{'devices' if i == -1 else i}.err")
  c = Child(_child_cmd(args, -1, {}), env, err(-1), log).wait(deadline)  # before the model
  if "error" in c.info:
    raise JaxvtError(c.info["error"])
  meta = c.info.get("meta")
  if not meta:
    raise RuntimeError(f"the device check {_failed(c, '1', '').note}")
  ensure_model(args.model, log)
  rows: list[Point] = []
  skipped, took = [], []
  for i, (mesh, budget) in enumerate(pts):
    est = 1.1 * max(took) if took else 0.0  # the longest point so far
    if time.time() + est > deadline:
      skipped.append(f"{mesh} at {budget}")
      log(f"SKIP {mesh} {budget}")
      continue
    known = {r.placement: r.budget for r in rows
             if r.mesh == mesh and r.ok and r.placement and not r.same_as}
    t = time.perf_counter()
    c = _run_point(args, i, mesh, known, env, err, log, deadline)
    r = c.runs[0] if c.runs else _failed(c, mesh, budget)
    if r.same_as:
      src = next(o for o in rows if o.mesh == mesh and o.budget == r.same_as)
      for k in ("prefill_tok_s", "decode_tok_s", "tokens", "gen_tokens", "peak_gib"):
        setattr(r, k, getattr(src, k))
    else:
      took.append(time.perf_counter() - t)
    log(f"POINT {mesh} {budget}: load {r.load_s:.1f} s, compile+warm-up {r.compile_s:.1f} s, "
        f"measure {r.measure_s:.1f} s, total {time.perf_counter() - t:.1f} s")
    rows.append(r)
  body = render(rows, meta, args, report.stamp(), time.time() - t_start, skipped)
  report.write_section(args.section, body, args.out)
  with open(os.path.join(out_dir, "mesh_runs.json"), "w") as f:
    json.dump(dict(meta=meta, skipped=skipped, rows=[dataclasses.asdict(r) for r in rows]), f,
              indent=1)
  return body


# ---- the section ------------------------------------------------------------------------------

def _vs_one(r: Point, rows: list[Point]) -> tuple[str, str, str]:
  """(prefill x, decode x, tokens) of a mesh row against the one-device row, same budget label."""
  base = next((o for o in rows if o.mesh == "1" and o.budget == r.budget and o.ok), None)
  if r.mesh == "1" or base is None or not r.ok:
    return "", "", ""
  ratio = lambda a, b: f"{a / b:.2f}x" if b else ""
  n = min(len(r.tokens), len(base.tokens))
  diff = next((i for i in range(n) if r.tokens[i] != base.tokens[i]), None)
  same = ("same" if diff is None and len(r.tokens) == len(base.tokens) else
          f"differ from token {diff if diff is not None else n}")
  return ratio(r.prefill_tok_s, base.prefill_tok_s), ratio(r.decode_tok_s, base.decode_tok_s), same


def _row(r: Point, rows: list[Point]) -> str:
  px, dx, toks = _vs_one(r, rows)
  notes = [r.note] if r.note else []
  if r.same_as:
    notes.append(f"the placement of budget {r.same_as}: its numbers, not run again")
  if r.ok and not r.safe:
    notes.append("unsafe by the planner (run with force)")
  t = f"{r.load_s:.0f}/{r.compile_s:.0f}/{r.measure_s:.0f}" if r.ok and not r.same_as else (
      f"{r.load_s:.0f}/-/-")
  rates = (f"{r.prefill_tok_s:.1f} | {r.decode_tok_s:.2f}" if r.ok else " | ")
  return (f"| {r.mesh} | {r.devices} | {r.budget} | {r.host_gib:.2f} | {r.device_gib:.2f} | "
          f"{rates} | {px} | {dx} | {toks} | {t} | {r.peak_gib:.2f} | {'; '.join(notes)} |")


def render(rows: list[Point], meta: dict, args, date: str, total_s: float,
           skipped: list[str]) -> str:
  """The markdown section: setup, then one row per point in run order."""
  default = os.path.abspath(args.model) == os.path.abspath(MODEL)
  name = "Qwen3.6-35B-A3B-shaped model" if default else f"`{os.path.basename(args.model)}`"
  size = os.path.getsize(args.model) / GiB if os.path.exists(args.model) else 0.0
  synth = " (jaxvt.synth: Q4_K_M-like random weights, MTP block)" if default else ""
  cmd = (f"python -m benchmarks.mesh --meshes {args.meshes} --budgets {args.budgets} "
         f"--prompt {args.prompt} --gen {args.gen} --time-limit {args.time_limit}")
  cmd += f" --device-gb {args.device_gb:g}" if args.device_gb is not None else ""
  cmd += "" if default else f" --model {args.model}"
  section = getattr(args, "section", "mesh")
  cmd += "" if section == "mesh" else f" --section {section}"
  card = (f"an emulated {args.device_gb:g} GiB card per device (XLA's pool capped, the planner "
          f"told --device-gb {args.device_gb:g})" if args.device_gb is not None else
          "each device's whole memory")
  lines = [f"## Tensor parallelism: {name}, one device vs a mesh\n",
           f"Command: `{cmd}` ({total_s:.0f} s in all; on a 2-GPU machine "
           "`bash tools/gpu_session.sh mesh`)  ",
           f"Machine: {meta['machine']}  ", f"Devices: {meta['devices']}  ", f"Date: {date}\n",
           f"Model: {size:.2f} GiB file{synth}. Prompt {args.prompt} random tokens, then "
           f"{args.gen} greedy tokens; a warm-up generate before the timed one. Memory: {card}. "
           "Budgets are per device (`--offload-gb`, as with `--mesh`): auto = the planner's "
           "pick, all = every offloadable weight. host / device GiB: each device's weights in "
           "the host tier / in its memory. vs 1 device: the mesh row's tok/s over the "
           "one-device row's at the same budget label; tokens: whether its greedy tokens are "
           "the one-device row's. Times: load (open, plan, place) / compile + warm-up / timed "
           "generate, seconds, each point in a fresh process. peak: the largest device's peak "
           "(of process 0's, for a mesh over N processes, written /Np: each process has its "
           "share of the devices, joined by jax.distributed over a loopback coordinator).\n",
           "| mesh | devices | budget | host GiB/dev | device GiB/dev | prefill tok/s | "
           "decode tok/s | prefill vs 1 device | decode vs 1 device | tokens | "
           "load/compile/measure s | peak GiB | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  lines += [_row(r, rows) for r in rows]
  if skipped:
    lines.append(f"\nNot run (the time limit came first): {', '.join(skipped)}.")
  return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
  """The parent (every point, one child each), or with --child one point in this process."""
  return run(main, parser(), argv, child=child)


if __name__ == "__main__":
  sys.exit(cli())
