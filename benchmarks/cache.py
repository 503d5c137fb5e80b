"""python -m benchmarks.cache: a device-side expert cache, 35B MoE model, emulated 16 GiB GPU.

  python -m benchmarks.cache [--models realistic,high-locality,uniform]
      [--budgets auto,7,12,experts]
      [--arms cache,predict,llama] [--gen 256] [--repeats 2] [--time-limit 540] [--merge]
      [--write]

Three Qwen3.6-35B-A3B-shaped files written by jaxvt.synth with the same weights but the
embedding, the output head and the routers: `realistic` (jaxvt.synth_routing.PRESETS["realistic"]:
a decode's experts reuse and drift so that an LRU cache hits as on real routing traces),
`high-locality` (PRESETS["high-locality"]: real reuse, but a few topics whose experts take most
selections, so the working set fits a cache: an upper bound) and `uniform` (benchmarks.offload's
file: uniform, memoryless routing, where a cache can only cost). Each budget (GiB in the host tier; `experts`: every routed
expert there, as llama.cpp's `-ot exps=CPU`) is placed, from the file opened once, in these arms
(benchmarks.cache_report.ARMS):

  off         no cache (expert_cache_gb=0), the product's default prediction
  lru, lfru   the cache in the device memory the plan leaves free, that eviction policy
  off-nopred  no cache and no predicted-experts ring (7 GiB only)
  lru-flip    the LRU cache with the prediction flipped from its default (7 GiB only)
  llama.cpp   llama-bench with the same bytes of routed experts on the CPU (`--n-cpu-moe N`)

on the realistic file, and `off` and `lru` at 7 GiB on the high-locality and uniform files. An arm is a warm-up
decode after another prompt (compiles the programs, fills the cache), then --repeats timed
decodes, each after its own prompt (the same prompts in every arm); the cache's counters
(engine.expert_cache_stats) around each give the hit rate and the bytes the misses read. The
jaxvt arms run in a child process under the emulated card (XLA_PYTHON_CLIENT_MEM_FRACTION,
--device-gb 16), most telling first (cache_report.plan_points); what would pass `--time-limit`
is skipped and listed, and a child that dies fails its arm and a new one runs the rest. Rows
are saved to --rows; `--merge` adds an earlier call's rows for points this call did not run, so
the work can be split over two calls by file (llama.cpp's arm runs on the realistic file
whatever --models says). `--write` writes the `cache` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import sys
import time

import jax
import numpy as np

from benchmarks import cache_report, offload, offload_llama, report
from benchmarks.cache_report import ARMS, GiB, LLAMA, Row
from benchmarks.cli import parser_of, run
from jaxvt import JaxvtError, SamplingParams, engine, ffi
from jaxvt.synth_routing import PRESETS

REALISTIC = "/tmp/jaxvt-qwen36-35b-a3b-realistic-drift.gguf"
HIGH_LOCALITY = "/tmp/jaxvt-qwen36-35b-a3b-high-locality.gguf"
ROWS = "/tmp/jaxvt-bench-cache-rows.json"
# where the kernel rule predicts no experts at all, a flipped arm predicts this many after a
# host-tier and after a device layer (the CUDA tuning row's counts)
PREDICT_ON = (2, 2)
LLAMA_CALL_S = 20  # one llama-bench call (load + tg), for the time kept for the llama.cpp arm


def parser() -> argparse.ArgumentParser:
  ap = parser_of("cache", __doc__, child=str)
  ap.add_argument("--realistic", default=REALISTIC,
                  help="the realistic-routing file (written when missing at the default path)")
  ap.add_argument("--high-locality", default=HIGH_LOCALITY,
                  help="the high-locality file (written when missing at the default path)")
  ap.add_argument("--uniform", default=offload.MODEL,
                  help="the uniform-routing file (benchmarks.offload's, written when missing)")
  ap.add_argument("--models", default="realistic,high-locality,uniform",
                  help="the files of the jaxvt arms (llama.cpp's arm runs on the realistic one)")
  ap.add_argument("--budgets", default="auto,7,12,experts",
                  help="GiB in the host tier, auto, or experts (every routed expert)")
  ap.add_argument("--arms", default="cache,predict,llama",
                  help="arms or groups: cache (off,lru,lfru), predict (off-nopred,lru-flip), "
                       "llama, jaxvt (every jaxvt arm)")
  ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before each decode")
  ap.add_argument("--gen", type=int, default=256, help="tokens of each timed decode")
  ap.add_argument("--repeats", type=int, default=2,
                  help="timed decodes an arm, each after its own prompt")
  ap.add_argument("--llama-gen", type=int, default=128, help="llama-bench's tg tokens")
  ap.add_argument("--temperature", type=float, default=1.0,
                  help="sampling temperature (routing statistics are of temperature 1)")
  ap.add_argument("--time-limit", type=int, default=540)
  ap.add_argument("--device-gb", type=float, default=16.0, help="the emulated card's GiB")
  ap.add_argument("--llama-bench", default=None,
                  help=f"llama-bench binary (default: {offload.LLAMA_BENCH} if built)")
  ap.add_argument("--rows", default=ROWS, help="JSON file the rows are saved to (--merge reads)")
  ap.add_argument("--merge", action="store_true",
                  help="add an earlier call's rows (--rows) for points this call does not run")
  ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
  ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
  ap.add_argument("--points", default="[]", help=argparse.SUPPRESS)
  ap.add_argument("--facts", default="", help=argparse.SUPPRESS)
  return ap


class Session(offload.Session):
  """One opened file (offload.Session: one kept host tier for every placement); `measure` runs
  one arm at one budget."""

  def __init__(self, path: str, prompt: int, gen: int, device_gb: float | None,
               temperature: float = 1.0, repeats: int = 1):
    super().__init__(path, prompt, gen, device_gb)
    ids = lambda seed: np.random.default_rng(seed).integers(10, self.cfg.vocab_size - 10,
                                                            prompt).tolist()
    self.warm_ids = ids(1)  # the warm-up's prompt: none of the timed ones
    self.timed_ids = [ids(100 + i) for i in range(repeats)]
    self.params = SamplingParams(temperature=temperature)
    self.routed = {d.name for d in self.model.decls if d.role == "routed_experts"}
    self.plans: dict[tuple, object] = {}

  def plan(self, budget, pattern=(), cache_gb=0.0, policy: str = "lru"):
    """engine.plan at `budget` with `cache_gb` of expert cache ("auto": what the plan leaves free;
    0: none); `auto` as jaxvt.load picks it, from XLA's analysis of the prefill (offload). The
    cache is sized after the placement (Placed.with_expert_cache), so the arms of a budget share
    one placement, planned once."""
    key = (budget, tuple(pattern), cache_gb, policy)
    if key not in self.plans and cache_gb != 0.0:
      self.plans[key] = copy.copy(self.plan(budget, pattern)).with_expert_cache(
          cache_gb, policy, force=True)
    if key not in self.plans:
      wo = None
      if budget == "auto" and self.par.size == 1:
        wo = engine.xla_workspace_of(self.model, self.exec()[0], self.max_context)
      self.plans[key] = engine.plan(
          self.model, offload_gb=budget, device_gb=self.device_gb, force=True,
          max_context=self.max_context, offload_pattern=pattern, mesh=self.par, workspace_of=wo,
          expert_cache_gb=cache_gb, expert_cache_policy=policy)
    return self.plans[key]

  def exec(self, predict: str = "default", cached: bool = False):
    """(The Exec of this device, the prediction it runs: cache_report.predict_plan); `predict`
    "off": no predicted-experts ring, "flip": the opposite of the default's, with a cache where
    `cached`."""
    dev = self.par.devices[0]
    ex = engine.exec_for(dev.platform, ffi.available(dev.platform), self.par)
    pr = ex.products
    changes, label = cache_report.predict_plan(
        pr.predict_after_host, pr.predict_after_device, getattr(pr, "predict_with_cache", None),
        cached, predict, PREDICT_ON)
    return dataclasses.replace(ex, products=dataclasses.replace(pr, **changes)), label

  def point(self, budget: str) -> tuple:
    """plan's (budget, pattern) of a budget label."""
    if budget == "experts":  # every routed expert in the host tier, the rest on the device
      return sum(u.nbytes for u in self.model.units if u.name in self.routed) / GiB, ("exps",)
    return (budget if budget == "auto" else float(budget)), ()

  def expert_bytes(self, placed) -> int:
    """Bytes of routed experts `placed` puts in the host tier."""
    return sum(u.nbytes for u in self.model.units
               if u.name in self.routed and placed.placement(u.name, u.layer) == "host")

  def uncached_read_bytes(self, placed, layers) -> int:
    """The plan's host-tier reads per token, less the routed experts of the cached `layers`."""
    p = placed.plan
    return sum(u.read_bytes for u, k in zip(p.units, p.kinds) if k == "host"
               and not (u.role == "routed_experts" and u.layer in layers))

  def budgets(self, labels: list[str]) -> dict:
    """{label: host GiB and routed-expert GiB in the host tier, cache off} (llama.cpp's pairs)."""
    out = {}
    for b in labels:
      placed = self.plan(*self.point(b))
      out[b] = dict(host_gib=placed.plan.host_bytes / GiB,
                    expert_gib=self.expert_bytes(placed) / GiB)
    return out

  def measure(self, model: str, budget: str, arm: str) -> Row:
    """One arm at one budget: placed, warmed up (another prompt), timed."""
    policy, predict = ARMS[arm]
    r = Row(model, budget, arm, gen_tokens=self.gen)
    t0 = time.perf_counter()
    eng = weights = None
    try:
      b, pattern = self.point(budget)
      placed = self.plan(b, pattern, "auto" if policy else 0.0, policy or "lru")
      ec = placed.expert_cache
      r.host_gib, r.expert_gib = placed.plan.host_bytes / GiB, self.expert_bytes(placed) / GiB
      if policy and ec is None:
        r.ok, r.note = True, "no cache: the plan leaves no device memory for one (= off)"
        return r
      weights = self.weights(placed)
      jax.block_until_ready(weights)
      ex, r.predict = self.exec(predict, cached=ec is not None)
      eng = engine.Engine(cfg=self.cfg, ex=ex, weights=weights, tokenizer=self.tokenizer,
                          max_context=self.max_context, path=self.path, plan=placed)
      r.load_s = time.perf_counter() - t0
      if ec is not None:
        r.policy, r.cache_gib = ec.policy, ec.nbytes / GiB
        r.slots, r.cached_layers = ec.slots, len(ec.layers)
      t1 = time.perf_counter()
      decode(eng, self.warm_ids, self.gen, self.params, seed=1)  # compiles, fills the cache
      t2 = time.perf_counter()
      toks, seconds, counts = [], 0.0, dict(hits=0, misses=0, hit_bytes=0, host_bytes=0)
      for i, ids in enumerate(self.timed_ids):  # the cache carries over from one to the next
        t, sec, before, after = decode(eng, ids, self.gen, self.params, seed=i)
        toks, seconds = toks + t, seconds + sec
        r.decode_samples.append((len(t) - 1) / sec)  # the first token comes from prefill
        if ec is not None and before is None:
          raise ValueError("the plan has a cache but the placed weights carry none")
        for k in counts if ec is not None else ():
          counts[k] += getattr(after, k) - getattr(before, k)
      r.compile_s, r.measure_s = t2 - t1, time.perf_counter() - t2
      steps = len(toks) - len(self.timed_ids)
      r.decode_tok_s, r.tokens = steps / seconds, cache_report.tokens_crc(toks)
      if ec is None:
        r.host_mb_per_token = placed.plan.host_read_bytes / 1e6
      else:
        r.hits, r.misses, r.hit_bytes = counts["hits"], counts["misses"], counts["hit_bytes"]
        r.miss_bytes = counts["host_bytes"]
        r.host_mb_per_token = (self.uncached_read_bytes(placed, set(ec.layers))
                               + r.miss_bytes / steps) / 1e6
      r.ok = True
    except (JaxvtError, RuntimeError, MemoryError, ValueError) as e:
      r.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      r.load_s = r.load_s or time.perf_counter() - t0
    finally:  # closed, not left to the collector (offload.Session.measure says why)
      if eng is not None:
        eng.close()
      del eng, weights  # the cache's device memory goes with the last reference to the weights
      gc.collect()
    return r


def decode(eng, ids: list[int], gen: int, params: SamplingParams, seed: int):
  """A prefill of `ids` and `gen` tokens decoded by the programs generate runs (decode_calls),
  dispatched back to back. Returns (the tokens, seconds of the decode calls, the cache's counters
  before and after them: None without a cache)."""
  logits, cache = eng.prefill(ids)
  first, key = engine.first_token_fn(logits, engine.row_key(seed, params), params=params)
  first = int(first)
  token = jax.device_put(np.asarray([first], np.int32))
  before = engine.expert_cache_stats(eng.weights)
  t = time.perf_counter()
  out = []
  for kv, steps, pos in eng.decode_calls(len(ids), gen):
    toks, cache, key, token = engine.decode_loop_fn(
        eng.weights, cache, token, jax.device_put(np.int32(pos)), key, cfg=eng.cfg, ex=eng.ex,
        kv_len=kv, params=params, steps=steps)
    out.append(toks)
  jax.block_until_ready(out)
  seconds = time.perf_counter() - t
  after = engine.expert_cache_stats(eng.weights)
  toks = [first] + np.concatenate([np.asarray(o)[:, 0] for o in out]).tolist()
  return toks, seconds, before, after


def child(args) -> None:
  """The jaxvt arms of --points in this process (one Session a file), a META line of each file
  (offload.Session.facts and the budgets' bytes) and one ROW line an arm."""
  deadline = args.deadline or time.time() + args.time_limit
  points = [tuple(p) for p in json.loads(args.points)]
  labels = cache_report.parse_budgets(args.budgets)
  models = list(dict.fromkeys([m for m, _, _ in points] + [m for m in args.facts.split(",") if m]))
  took: list[float] = []
  for m in models:
    s = Session(model_file(args, m)[0], args.prompt, args.gen,
                args.device_gb, args.temperature, args.repeats)
    mine = [p for p in points if p[0] == m]
    with offload.gpu_lock():
      if m == "realistic":  # llama.cpp's pairs: every budget's expert bytes, one layer's
        meta = dict(s.facts(), model=m, budgets=s.budgets(labels))
      else:
        meta = dict(model=m, budgets=s.budgets(list(dict.fromkeys(b for _, b, _ in mine))))
      print("META " + json.dumps(meta), flush=True)
      for _, budget, arm in mine:
        if offload.too_late(took, deadline):
          print(f"SKIP {m} {budget} {arm}", flush=True)
          continue
        t = time.perf_counter()
        r = s.measure(m, budget, arm)
        took.append(time.perf_counter() - t)
        print(f"POINT {m} {budget} {arm}: {r.decode_tok_s:.2f} tok/s, hit rate "
              f"{r.hit_rate if r.hit_rate is not None else '-'}, {took[-1]:.1f} s {r.note}",
              flush=True)
        print("ROW " + json.dumps(dataclasses.asdict(r)), flush=True)
    if s.tier is not None:
      s.tier.close()


class Rows(offload.Child):
  """The child's lines: ROW (a Row), META (one a file), SKIP."""

  def _read(self):
    for line in self.p.stdout:
      line = line.rstrip("\n")
      if line.startswith("ROW "):
        self.runs.append(Row(**json.loads(line[4:])))
      elif line.startswith("META "):
        meta = json.loads(line[5:])
        self.info.setdefault("meta", {})[meta["model"]] = meta
      elif line.startswith("SKIP "):
        self.info.setdefault("skipped", []).append(line[5:])
      self.log(line)


def command_of(args) -> str:
  """The command line of this run, with the options that differ from their defaults."""
  ap, out = parser(), ["python -m benchmarks.cache"]
  for name in ("realistic", "high_locality", "uniform", "models", "budgets", "arms", "prompt",
               "gen", "repeats",
               "temperature", "time_limit"):
    v = getattr(args, name)
    if v != ap.get_default(name) or name == "time_limit":
      out.append(f"--{name.replace('_', '-')} {v}")
  out += ["--merge"] * bool(args.merge) + ["--write"] * bool(args.write)
  return " ".join(out)


def model_file(args, m: str) -> tuple:
  """(path, default path, write_model's routing) of model `m`."""
  default, routing = {"realistic": (REALISTIC, PRESETS["realistic"]),
                      "high-locality": (HIGH_LOCALITY, PRESETS["high-locality"]),
                      "uniform": (offload.MODEL, None)}[m]
  return getattr(args, m.replace("-", "_")), default, routing


def ensure_models(args, models: list[str], log) -> None:
  """The files of `models`, each written once per machine at its default path
  (offload.ensure_model); a file given by path must exist."""
  for m in models:
    path, default, routing = model_file(args, m)
    if path == default:
      offload.ensure_model(path, log, routing=routing)
    elif not os.path.exists(path):
      raise JaxvtError(f"no such file: {path}; pass --{m} PATH of a MoE GGUF file")


def llama_rows(binary: str, args, meta: dict, budgets: list[str], deadline: float,
               log) -> list[Row]:
  """llama.cpp's decode on the realistic file at each budget's expert bytes (one Row a budget)."""
  pairs = {}

  def pick(has_ncmoe: bool):
    confs = cache_report.llama_configs(meta, budgets, offload_llama.configs, has_ncmoe)
    pairs.update({label: bs for label, _, _, bs in confs})
    return [(label, flags, gib) for label, flags, gib, _ in confs]

  runs = offload_llama.run_all(binary, args.realistic, meta, 0, args.llama_gen, deadline, log,
                               pick=pick)
  out = []
  for r in runs:
    label = r.point.split(":", 1)[1] if r.point else r.note.split(":")[0]
    for b in pairs.get(label, [""]):
      out.append(Row("realistic", b, LLAMA, ok=r.ok and r.decode_tok_s > 0, flags=label,
                     note="" if r.ok else r.note, host_gib=r.host_gib, expert_gib=r.host_gib,
                     decode_tok_s=r.decode_tok_s, gen_tokens=r.gen_tokens,
                     measure_s=r.measure_s, decode_samples=list(r.decode_samples)))
  return out


def load_rows(path: str) -> tuple[list[Row], dict]:
  """(rows, info) an earlier call saved at `path` (none where there is no file)."""
  if not os.path.exists(path):
    return [], {}
  with open(path) as f:
    saved = json.load(f)
  return [Row(**r) for r in saved["rows"]], saved.get("info", {})


def children(args, points: list[tuple], facts: str, deadline: float, frac: str,
             log) -> tuple[list[Row], dict]:
  """The jaxvt arms `points` in a child process under the emulated card (and the META of the
  files in `facts`), until `deadline`. A child that dies (a crash in an arm) fails that arm,
  and a new one runs the arms after it while a minute is left. Returns (rows, {"meta": {file:
  META}, "skipped": [points not run]})."""
  rows, info, todo = [], {"meta": {}, "skipped": []}, list(points)
  err = os.path.join(os.environ.get("OUT", "/tmp"), "cache_child.err")
  while True:
    cmd = [sys.executable, "-m", "benchmarks.cache", "--child", "arms", "--points",
           json.dumps(todo), "--facts", facts, "--deadline", f"{deadline:.1f}"]
    for name in ("realistic", "high_locality", "uniform", "budgets", "prompt", "gen", "repeats",
                 "temperature", "device_gb"):
      cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    ch = Rows(cmd, {"XLA_PYTHON_CLIENT_MEM_FRACTION": frac}, err, log).wait(deadline + 10)
    rows += ch.runs
    info["meta"].update(ch.info.get("meta", {}))
    info["skipped"] += ch.info.get("skipped", [])
    seen = {r.key for r in ch.runs} | {tuple(s.split()) for s in ch.info.get("skipped", [])}
    todo = [p for p in todo if tuple(p) not in seen]
    if not (ch.p.returncode and todo and deadline - time.time() > 60):
      break
    rows.append(Row(*todo[0], note=f"the child process died (exit {ch.p.returncode}) in this arm"))
    todo, facts = todo[1:], "" if "realistic" in info["meta"] else facts
  info["skipped"] += [" ".join(p) for p in todo]  # killed at the time limit
  return rows, info


def main(args) -> str:
  t_start = time.time()
  log = lambda s: print(s, flush=True)
  models = cache_report.parse_models(args.models)
  budgets = cache_report.parse_budgets(args.budgets)
  arms = cache_report.parse_arms(args.arms)
  points = cache_report.plan_points(models, budgets, arms)
  want_llama = "llama" in arms  # on the realistic file, whichever files the jaxvt arms use
  ensure_models(args, list(dict.fromkeys([m for m, _, _ in points] + ["realistic"] * want_llama)),
                log)
  llama = offload_llama.find(args.llama_bench) if want_llama else None
  notes = []
  if llama and not os.access(llama, os.X_OK):
    notes.append("llama-bench was being built in the background while the jaxvt arms ran")
  end = t_start + args.time_limit - 15
  keep = LLAMA_CALL_S * offload_llama.DECODE_CALLS * len(budgets) if llama else 0
  frac = offload.pool_fraction(args.device_gb)
  rows, info = [], {}
  if points or want_llama:
    rows, info = children(args, points, "realistic" if want_llama else "", end - keep, frac, log)
  metas = info.get("meta", {})
  skipped = list(info.get("skipped", []))
  if want_llama and llama and "realistic" in metas:
    rows += llama_rows(llama, args, metas["realistic"], budgets, end, log)
  elif want_llama:
    why = "no llama-bench" if not llama else "the jaxvt child gave no facts of the file"
    skipped.append(f"llama.cpp ({why})")
  if args.merge:
    before, old = load_rows(args.rows)
    rows = cache_report.merge(rows, before)
    metas = {**old.get("meta", {}), **metas}
    if before:
      notes.append(f"rows marked `earlier call` come from `{old.get('command', '?')}` on the same "
                   f"machine ({old.get('date', '?')}), merged with --merge")
  info = dict(meta=metas, date=report.stamp(), frac=frac, command=command_of(args))
  with open(args.rows, "w") as f:
    json.dump(dict(rows=[dataclasses.asdict(r) for r in rows], info=info), f, indent=1)
  with contextlib.suppress(OSError):
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "cache_rows.json"), "w") as f:
      json.dump(dict(rows=[dataclasses.asdict(r) for r in rows], info=info), f, indent=1)
  meta = dict(metas.get("realistic", {}), frac=frac, llama_gen=args.llama_gen)
  body = cache_report.render(rows, meta, args, info["command"], report.machine(), report.stamp(),
                             time.time() - t_start, skipped, notes)
  if args.write:
    report.write_section("cache", body)
  return body


def cli(argv: list[str] | None = None) -> int:
  """The parent (every arm asked for), or with --child the jaxvt arms in this process."""
  return run(main, parser(), argv, child=child)


if __name__ == "__main__":
  sys.exit(cli())
