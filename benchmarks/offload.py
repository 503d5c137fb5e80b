"""python -m benchmarks.offload: a 35B MoE model in an emulated 16 GiB GPU, budget by budget.

A model with Qwen3.6-35B-A3B's exact architecture and tensor layout and valid random weights
(Q4_K_M-like formats, ~19 GiB) is written to local disk (jaxvt.synth) and loaded through
the normal GGUF path. Arms (jaxvt's own each in a child process: the device cap is set before
JAX starts):

  device      every weight in device memory, no cap (the GPU holds the whole model)
  sweep       jaxvt's host tier under an emulated 16 GiB card (XLA's pool capped with
              XLA_PYTHON_CLIENT_MEM_FRACTION, and --device-gb 16 for the planner): `auto`, the
              smallest safe budget, everything, JAX's pinned_host memory kind (device_put
              inside the layer scan) with jaxvt's host tier at the same placement, and the
              budgets between in steps of at most 1 GiB
  forced      the forced unsafe budgets below the safe range, last, in a process of their own
              (one that runs out of memory while loading must not take later points with it)
  llama.cpp   llama-bench on the same file (--llama-bench PATH, or /tmp/llama-build's): all
              layers on the GPU, `-ot exps=CPU`, and `--n-cpu-moe N` near jaxvt's auto budget

One sweep process serves every budget: it opens the file once (jaxvt.engine's public steps:
open_model once, then plan and place per budget) and keeps one pinned host copy of each tensor it
ever offloads (benchmarks.arms.KeptTier), so a budget point costs the device upload, the
compile and the measurement. Each point is a warm-up generate (compiles)
then a timed one: a 512-token prompt (prefill tok/s), 128 greedy tokens (decode tok/s).
Children hold a file lock from their first use of the GPU to their end, so one child's setup
overlaps the other's measurement but no two ever use the GPU at once. Points run in an order
that spreads coverage (benchmarks.offload_report.plan_points); when `--time-limit` is near, the
rest are skipped and what ran is written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import gc
import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import arms, offload_llama, offload_report, report
from benchmarks.cli import child_env, parser_of, run
from benchmarks.offload_report import Run, plan_points
from jaxvt import JaxvtError, SamplingParams, engine, ffi, synth
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.model.presets import qwen36_35b_a3b_config

GiB = 1 << 30
MODEL = "/tmp/jaxvt-qwen36-35b-a3b-shape.gguf"
LOCK = "/tmp/jaxvt-bench-gpu.lock"
LLAMA_BENCH = "/tmp/llama-build/bin/llama-bench"  # tools/build_llamacpp.sh's output
LLAMA_RESERVE_S = 160  # kept for the llama.cpp arm (3 llama-bench runs, 4 more timing decode alone)
SHORT_PROMPT = 16  # the device arm's short prompt (llama-bench -p 16 times the same)
PREFILL_REPEATS = 3  # warm prefills of the prompt per point (the median is reported)
PINNED_GEN = 16  # the JAX pinned_host arm copies every expert per token: fewer tokens suffice


def parser() -> argparse.ArgumentParser:
  ap = parser_of("offload", __doc__, child=str)
  ap.add_argument("--model", default=MODEL,
                  help="the model file (written by jaxvt.synth when missing at the default path)")
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--gen", type=int, default=128)
  ap.add_argument("--time-limit", type=int, default=540)
  ap.add_argument("--device-gb", type=float, default=16.0, help="the emulated card's GiB")
  ap.add_argument("--llama-bench", default=None,
                  help=f"llama-bench binary (default: {LLAMA_BENCH} if built)")
  ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
  ap.add_argument("--points", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--after", default="", help=argparse.SUPPRESS)
  return ap


@contextlib.contextmanager
def gpu_lock(path: str = LOCK):
  """Held while a child uses the GPU (load, compile, measure)."""
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


class Session:
  """One opened model file; `measure` places it at a budget and times it."""

  def __init__(self, path: str, prompt: int, gen: int, device_gb: float | None):
    t = time.perf_counter()
    self.path, self.prompt, self.gen, self.device_gb = path, prompt, gen, device_gb
    self.model = engine.open_model(path)
    self.cfg = self.model.cfg
    self.tokenizer = arms.NoStops(Tokenizer.from_gguf_metadata(self.model.gguf.metadata))
    self.ids = np.random.default_rng(0).integers(10, self.cfg.vocab_size - 10, prompt).tolist()
    self.max_context = prompt + gen + 8
    self.tier = None
    self.auto = None  # the plan of `auto` (plan)
    self.par = engine.layout(self.cfg)  # one device: the 1 x 1 mesh on JAX's first
    self.open_s = time.perf_counter() - t

  def plan(self, budget, pattern=()):
    """The plan of a point. `auto` is chosen as jaxvt.load chooses it: from XLA's memory
    analysis of each candidate's prefill program (engine.xla_workspace_of), not the estimate
    alone, which can give a budget the CLI refuses (XLA then rematerializes that budget's
    prefill to fit)."""
    if budget == "auto" and not pattern and self.auto is not None:
      return self.auto  # facts() and the auto point: one round of XLA's analysis
    wo = None
    if budget == "auto" and self.par.size == 1:
      dev = self.par.devices[0]
      ex = engine.exec_for(dev.platform, ffi.available(dev.platform), self.par)
      wo = engine.xla_workspace_of(self.model, ex, self.max_context)
    p = engine.plan(self.model, offload_gb=budget, device_gb=self.device_gb, force=True,
                    max_context=self.max_context, offload_pattern=pattern, mesh=self.par,
                    workspace_of=wo)
    if budget == "auto" and not pattern:
      self.auto = p
    return p

  def facts(self) -> dict:
    """Budgets (GiB) the planner gives this file, and the bytes of one layer's routed experts.
    The smallest safe budget is auto's where XLA's analysis put auto above the estimate's."""
    base = self.plan(0.0)
    routed = {d.name for d in self.model.decls if d.role == "routed_experts"}  # a str enum
    exps = [u for u in self.model.units if u.name in routed and u.layer is not None]
    n = len({u.layer for u in exps}) or 1
    auto = self.plan("auto").plan.host_bytes / GiB
    return dict(safe=max((base.safe_budget or 0) / GiB, auto),
                top=base.plan.max_useful_budget / GiB,
                auto=auto,
                expert_layer_bytes=sum(u.nbytes for u in exps) / n, n_layers=self.cfg.n_layers,
                routed=sum(u.nbytes for u in self.model.units if u.name in routed) / GiB)

  def weights(self, placed, pinned: bool = False) -> dict:
    """The weights as `placed` puts them: jaxvt's host tier (this session's KeptTier), or with
    `pinned` JAX's pinned_host memory kind for the stacks the plan offloads."""
    if not pinned:
      if placed.host_bytes:
        self.tier = self.tier or arms.KeptTier()
      return engine.place(self.model, placed, self.par, host=self.tier)
    stacks = arms.pinned_stacks(self.model, placed.placement)
    whole = NamedSharding(self.par.mesh, P())
    rest = dataclasses.replace(self.model, decls=[d for d in self.model.decls
                                                  if d.name not in stacks])
    on_device = engine.place(rest, placed, self.par)  # the plan puts every one on the device
    return {d.name: arms.place_pinned(self.model, d, whole) if d.name in stacks
            else on_device[d.name] for d in self.model.decls}

  def engine(self, budget, host_kind: str = "host", pattern=()):
    """An Engine placed as jaxvt.load(offload_gb=budget, force=True) places it, from the file
    opened once and this session's kept host tier; host_kind "jax_pinned": the pinned_host arm."""
    t = time.perf_counter()
    placed = self.plan(budget, pattern)
    weights = self.weights(placed, pinned=host_kind == "jax_pinned")
    jax.block_until_ready(weights)
    dev = self.par.devices[0]
    ex = engine.exec_for(dev.platform, ffi.available(dev.platform), self.par)
    return engine.Engine(cfg=self.cfg, ex=ex, weights=weights, tokenizer=self.tokenizer,
                         max_context=self.max_context, path=self.path,
                         load_seconds=time.perf_counter() - t, plan=placed)

  def measure(self, arm: str, budget, *, forced: bool = False, host_kind: str = "host",
              pattern=(), gen: int | None = None, short: int = 0) -> Run:
    """One point; `short` > 0 also times a warm prefill of the prompt's first `short` tokens."""
    gen = min(gen or self.gen, self.gen)
    r = Run(arm, 0.0, False, gen_tokens=gen, auto=budget == "auto", forced=forced)
    t0 = time.perf_counter()
    eng = None
    try:
      eng = self.engine(budget, host_kind, pattern)
      r.load_s = time.perf_counter() - t0
      p = eng.plan
      r.budget_gib = p.plan.host_bytes / GiB if budget == "auto" or pattern else float(budget)
      r.safe = p.breakdown.headroom >= p.breakdown.slack
      r.host_gib = p.plan.host_bytes / GiB
      r.host_mb_per_token = p.plan.host_read_bytes / 1e6
      if host_kind == "jax_pinned":  # device_put copies whole offloaded tensors every token
        r.host_mb_per_token = p.plan.host_bytes / 1e6
      r.device_read_gb = p.plan.device_read_bytes / 1e9
      r.predicted_ms = p.prediction.ms_per_step
      t1 = time.perf_counter()
      warm_up(eng, self.ids, overlap=not forced)
      t2 = time.perf_counter()
      g = eng.generate(self.ids, max_tokens=gen)
      r.compile_s, r.measure_s = t2 - t1, time.perf_counter() - t2
      # prefill: the median of three warm prompts (one prefill is a tenth of a second: a single
      # one moved by a few percent between runs); llama-bench's pp is the mean of its -r runs
      pre = [g.stats.prefill_tok_s] + [eng.generate(self.ids, max_tokens=1).stats.prefill_tok_s
                                       for _ in range(PREFILL_REPEATS - 1)]
      r.prefill_tok_s, r.decode_tok_s = float(np.median(pre)), g.stats.decode_tok_s
      if short:
        eng.generate(self.ids[:short], max_tokens=1)  # compiles the short prompt's bucket
        r.prefill16_tok_s = max(eng.generate(self.ids[:short], max_tokens=1).stats.prefill_tok_s
                                for _ in range(3))
      st = jax.devices()[0].memory_stats() or {}
      r.peak_gib = st.get("peak_bytes_in_use", 0) / GiB
      r.in_use_gib = st.get("bytes_in_use", 0) / GiB
      r.pool_gib = st.get("bytes_limit", 0) / GiB
      r.ok = True
    except (JaxvtError, RuntimeError, MemoryError, ValueError) as e:  # an unsafe budget may
      r.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"  # run out: a result
      if not r.load_s:
        r.load_s = time.perf_counter() - t0
    finally:
      # Closed, not left to the collector: a point that failed mid-run (an unsafe budget out of
      # memory) would keep its weights alive, and every later point of the sweep would then run
      # out of memory too.
      if eng is not None:
        eng.close()
      del eng
      gc.collect()
    return r


def warm_up(eng, ids: list[int], overlap: bool) -> None:
  """Compiles and runs once what a timed `eng.generate(ids, ...)` runs (one device): a generate
  of one token (prefill, first sample) and two decode chunks (engine.decode_loop_fn). With
  `overlap` the two run on two threads, so their compiles overlap (XLA compiles without the GIL); the forced unsafe points
  run them one after the other, so that the warm-up's device memory is what a plain run needs.
  `eng` generates to max_tokens (arms.NoStops)."""
  n = len(ids)
  errors = []

  def first():
    eng.generate(ids, max_tokens=1)

  def step():  # the decode calls generate makes: a cache over the mesh, as prefill returns it;
    # the first call's token from the host, the next one's as the first returns it
    cache, token, pos = eng.new_cache(1), jnp.asarray([1], jnp.int32), n
    key = engine.row_key(0, SamplingParams())
    steps = eng.decode_chunk
    for _ in range(2):
      toks, cache, key, token = engine.decode_loop_fn(
          eng.weights, cache, token, jnp.int32(pos), key, cfg=eng.cfg, ex=eng.ex,
          kv_len=eng.kv_len(pos + steps), params=SamplingParams(), steps=steps)
      pos += steps
    int(toks[0, 0])

  def guarded(f):
    try:
      f()
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  if overlap:
    ts = [threading.Thread(target=guarded, args=(f,)) for f in (first, step)]
    for t in ts:
      t.start()
    for t in ts:
      t.join()
    if errors:
      raise errors[0]
  else:
    first()
    step()


def print_row(r) -> None:
  """One RUN line: the row (a dataclass) as JSON, for the parent process."""
  print("RUN " + json.dumps(dataclasses.asdict(r)), flush=True)


def _rates() -> dict:
  """Same-run rates: DMA host->device (the extension's probe) and a 1 GiB device copy."""
  dbg = ffi.debug_extension()  # the probes (measure_*, bench_cpu_gemv)
  x = jnp.ones((1 << 28,), jnp.float32)
  f = jax.jit(lambda x: x + 1)
  f(x).block_until_ready()
  t = time.perf_counter()
  for _ in range(10):
    y = f(x)
  y.block_until_ready()
  hbm = 10 * 2 * x.nbytes / (time.perf_counter() - t) / 1e9
  dma = dbg.measure_dma_h2d(1 << 30, 5) if jax.devices()[0].platform != "cpu" else 0.0
  return dict(dma=dma, hbm=hbm)


def safe_points(facts: dict) -> list[tuple]:
  """plan_points without the forced (unsafe) budgets, in the same order."""
  return [p for p in plan_points(facts["safe"], facts["top"], auto=facts["auto"]) if not p[2]]


def too_late(took: list[float], deadline: float) -> bool:
  """Whether a point as long as the median of the last three (`took`, seconds), and a tenth
  more, would end past `deadline`."""
  est = 1.1 * sorted(took[-3:])[len(took[-3:]) // 2] if took else 0.0
  return time.time() + est > deadline


def child(args) -> None:
  """One arm in this process; prints one JSON line per run (RUN), and META / RATES lines."""
  deadline = args.deadline or time.time() + args.time_limit
  if args.child == "device":
    s = Session(args.model, args.prompt, args.gen, None)
    with gpu_lock():
      print("LOCKED", flush=True)
      print("RATES " + json.dumps(_rates()), flush=True)
      r = s.measure("device", 0.0, short=SHORT_PROMPT)
      r.open_s = s.open_s
      print_row(r)
    return
  s = Session(args.model, args.prompt, args.gen, args.device_gb)  # before the lock: CPU only
  while args.after and not os.path.exists(args.after) and time.time() < deadline:
    time.sleep(0.2)  # the device arm measures first
  with gpu_lock():
    facts = s.facts()
    if args.points:
      points = [tuple(p) for p in json.loads(args.points)]
    else:
      print("META " + json.dumps(facts), flush=True)
      points = safe_points(facts)  # the forced ones run after, in a child of their own
    # the pinned_host pair: every routed expert in the host tier (forced by the pattern, the
    # budget exactly their bytes), the rest on the device, as llama.cpp's -ot exps=CPU
    routed = facts["routed"]
    print(f"SWEEP open {s.open_s:.1f} s; {len(points)} points: {points}", flush=True)
    took: list[float] = []
    for arm, budget, forced in points:
      if too_late(took, deadline):
        print(f"SKIP {arm} {budget}", flush=True)
        continue
      t = time.perf_counter()
      if arm == "jax_pinned":
        r = s.measure(arm, routed, host_kind="jax_pinned", pattern=("exps",), gen=PINNED_GEN)
      elif arm == "jaxvt@experts":
        r = s.measure(arm, routed, pattern=("exps",))
      else:
        r = s.measure(arm, budget, forced=forced)
      r.point = f"{arm}:{budget}"
      took.append(time.perf_counter() - t)
      print(f"POINT {arm} {budget}: load {r.load_s:.1f} s, compile+warm-up {r.compile_s:.1f} s, "
            f"measure {r.measure_s:.1f} s, total {took[-1]:.1f} s", flush=True)
      print_row(r)
    if s.tier is not None:
      s.tier.close()


class Child:
  """A child process whose stdout lines are echoed as they come (stderr goes to `err_path`) and
  whose RUN lines (as `row`), RATES / META (JSON), SKIP and ERROR lines are collected."""

  def __init__(self, cmd: list[str], env_extra: dict, err_path: str, log, row=Run,
               signal: str = ""):
    """`signal`: a file created once the child prints LOCKED (it holds the GPU lock) or ends."""
    self.signal, self.err_path, self.row = signal, err_path, row
    self.runs, self.info, self.log = [], {}, log
    with open(self.err_path, "w") as err:
      self.p = subprocess.Popen(cmd, env=child_env(env_extra), stdout=subprocess.PIPE,
                                stderr=err, text=True)
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self):
    for line in self.p.stdout:
      line = line.rstrip("\n")
      if line == "LOCKED" and self.signal:
        open(self.signal, "w").close()
      if line.startswith("RUN "):
        self.runs.append(self.row(**json.loads(line[4:])))
      elif line.startswith(("RATES ", "META ")):
        self.info[line.split()[0].lower()] = json.loads(line.split(" ", 1)[1])
      elif line.startswith("SKIP "):
        self.info.setdefault("skipped", []).append(line[5:])
      elif line.startswith("ERROR "):
        self.info["error"] = line[6:]
      self.log(line)
    if self.signal:
      open(self.signal, "w").close()

  def wait(self, deadline: float) -> "Child":
    """Waits for the child, killing it at `deadline` (what it printed before counts)."""
    try:
      self.p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      self.p.kill()
      self.p.wait()
      self.log("child killed: time limit")
    self.reader.join(timeout=10)
    if self.p.returncode:
      with open(self.err_path) as f:
        self.log(f"child exited {self.p.returncode}; stderr ends:\n{f.read()[-1500:]}")
    return self


def _offload_child(arm: str, args, env_extra: dict, deadline: float, log, points=None,
                   after: str = "", signal: str = "") -> Child:
  """One arm of this sweep in a child; `after`: a file the child waits for before it takes the
  GPU lock."""
  cmd = [sys.executable, "-m", "benchmarks.offload", "--child", arm, "--model", args.model,
         "--prompt", str(args.prompt), "--gen", str(args.gen), "--deadline", f"{deadline:.1f}",
         "--device-gb", str(args.device_gb), "--after", after]
  if points is not None:
    cmd += ["--points", json.dumps(points)]
  err = os.path.join(os.environ.get("OUT", "/tmp"), f"offload_{arm}.err")
  return Child(cmd, env_extra, err, log, signal=signal)


def ensure_model(path: str, log, routing=None) -> None:
  """Writes the Qwen3.6-35B-A3B-shaped file (jaxvt.synth: Q4_K_M-like formats, MTP block,
  seed 0; `routing`: write_model's, a jaxvt.synth_routing.RoutingStats) at `path` unless it
  exists; under another name first, so a cut-off write never stays behind as the model."""
  if os.path.exists(path):
    return
  t = time.time()
  part = f"{path}.part{os.getpid()}"
  try:
    synth.write_model(part, qwen36_35b_a3b_config(n_nextn=1), "q4_k_m", seed=0,
                      routing=routing)
    os.replace(part, path)
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(part)
  log(f"wrote {path}: {os.path.getsize(path) / GiB:.2f} GiB in {time.time() - t:.0f} s")


def pool_fraction(device_gb: float) -> str:
  """XLA_PYTHON_CLIENT_MEM_FRACTION for a pool of about `device_gb` GiB on each GPU (from the
  first GPU's memory, nvidia-smi; 0.115, 16 GiB of an H200, where nvidia-smi gives none)."""
  try:
    q = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    mib = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout.split()[0]
    return f"{device_gb * GiB / (float(mib) * (1 << 20) * 0.9765):.4f}"
  except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
    return "0.115"


def main(args) -> str:
  t_start = time.time()
  log = lambda s: print(s, flush=True)
  ensure_model(args.model, log)
  llama = offload_llama.find(args.llama_bench)
  notes = []
  if llama and not os.access(llama, os.X_OK):
    notes.append("llama-bench was being built in the background while the jaxvt arms ran")
  end = t_start + args.time_limit - 15
  sweep_end = end - (LLAMA_RESERVE_S if llama else 0)
  if sweep_end - time.time() < 60:  # the jaxvt arms would be killed before their first row
    kept = f" ({LLAMA_RESERVE_S} s kept for llama.cpp)" if llama else ""
    log(f"warning: --time-limit {args.time_limit} leaves {max(0, sweep_end - time.time()):.0f} s "
        f"for the jaxvt arms{kept}; give the sweep more time")
  frac = pool_fraction(args.device_gb)
  cap = {"XLA_PYTHON_CLIENT_MEM_FRACTION": frac}
  # both children start now; the lock serialises their GPU phases (device arm first)
  first = f"/tmp/jaxvt-bench-{os.getpid()}.device"  # the device arm takes the GPU first
  with contextlib.suppress(FileNotFoundError):
    os.remove(first)
  dev = _offload_child("device", args, {}, sweep_end, log, signal=first)
  sweep = _offload_child("sweep", args, cap, sweep_end, log, after=first)
  dev_runs, info = dev.wait(sweep_end).runs, dict(dev.info)
  runs = sweep.wait(sweep_end).runs
  info.update(sweep.info)
  with contextlib.suppress(FileNotFoundError):
    os.remove(first)
  meta = info.get("meta")
  done = {r.point for r in runs}
  left = [p for p in (safe_points(meta) if meta else []) if f"{p[0]}:{p[1]}" not in done]
  if sweep.p.returncode and left and sweep_end - time.time() > 60:  # a crash: go on
    log(f"sweep child died; respawning for {len(left)} points")
    more = _offload_child("sweep", args, cap, sweep_end, log, left).wait(sweep_end)
    runs += more.runs
    info["skipped"] = more.info.get("skipped", [])
  # The forced (unsafe) budgets last, in a process of their own: one that runs out of memory
  # while its weights load leaves the pool full for every later point of its process, so no
  # safe point runs after one.
  forced = [p for p in (plan_points(meta["safe"], meta["top"], auto=meta["auto"]) if meta else [])
            if p[2]]
  if forced and sweep_end - time.time() > 30:
    more = _offload_child("forced", args, cap, sweep_end, log, forced).wait(sweep_end)
    runs += more.runs
    info["skipped"] = info.get("skipped", []) + more.info.get("skipped", [])
  elif forced:
    info["skipped"] = info.get("skipped", []) + [f"{a} {b}" for a, b, _ in forced]
  llama_runs = []
  if llama:
    llama_runs = offload_llama.run_all(llama, args.model, info.get("meta", {}), args.prompt,
                                       args.gen, end, log)
  elif args.llama_bench:
    log(f"llama.cpp arm skipped: no llama-bench at {args.llama_bench}")
  all_runs = dev_runs + runs + llama_runs
  t_total = time.time() - t_start
  body = offload_report.render(all_runs, info.get("rates", {}), frac,
                               os.path.getsize(args.model) / GiB, args, report.machine(),
                               report.stamp(), t_total, info.get("skipped", []),
                               (meta or {}).get("n_layers", 40), notes)
  if offload_report.plot(all_runs, "docs/offload_sweep.png"):
    body += "\n\n![offload sweep](offload_sweep.png)\n"
  report.write_section("offload", body)
  with open(os.environ.get("OUT", "/tmp") + "/offload_runs.json", "w") as f:
    json.dump([dataclasses.asdict(r) for r in all_runs] + [info], f, indent=1)
  return body


def cli(argv: list[str] | None = None) -> int:
  """The parent (the whole sweep), or with --child one arm in this process."""
  return run(main, parser(), argv, child=child)


if __name__ == "__main__":
  sys.exit(cli())
