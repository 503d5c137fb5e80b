"""The offload sweep's llama.cpp arm: llama-bench on the same GGUF file.

llama.cpp computes offloaded experts on the CPU (`-ot exps=CPU`, `--n-cpu-moe N`) where jaxvt
reads them from pinned host memory with GPU kernels, so its rows are what a user would run
instead. The binary comes from tools/build_llamacpp.sh (source vendored in the
llama-cpp-python sdist). `llama-bench -o json` prints one record per test: pp (prompt, n_gen 0)
and tg (generation, n_prompt 0), each with avg_ts / stddev_ts (tokens per second) over `-r`
repetitions; `parse` turns a configuration's pair into one Run.

The configurations that compute experts on the CPU drift from call to call far more than
within one (on a 16-core host, `--n-cpu-moe 10` has moved by 20% over seven calls within two
minutes, each call's own spread a few tok/s; jaxvt's rates by under 1%), so their decode is
measured in DECODE_CALLS separate calls, taken in turns after
every configuration has run once, and the row's decode rate is their median (the calls'
rates kept in `Run.decode_samples`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

from benchmarks.offload_report import Run

GiB = 1 << 30
DEFAULT = "/tmp/llama-build/bin/llama-bench"
SHORT = 16  # the short prompt (jaxvt's device arm times the same length)
BUILDING = ".building"  # tools/gpu_session.sh leaves this in the build folder while it builds
DECODE_CALLS = 3  # separate llama-bench calls timing decode, for configurations with CPU experts


def find(path: str | None) -> str | None:
  """The llama-bench to run: `path`, else the default build; None if neither exists or is
  being built (a build in progress counts: run_all waits for it)."""
  p = path or DEFAULT
  build = os.path.dirname(os.path.dirname(p))
  if os.access(p, os.X_OK) or os.path.exists(os.path.join(build, BUILDING)):
    return p
  return None


def parse(text: str, label: str, budget_gib: float) -> Run:
  """One Run from llama-bench's JSON (a list of records) for one configuration."""
  start = text.find("[")
  recs = json.loads(text[start:]) if start >= 0 else []
  pps = [r for r in recs if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
  pp = max(pps, key=lambda r: r["n_prompt"], default=None)  # the long prompt
  short = next((r for r in pps if r["n_prompt"] == SHORT), None)
  tg = next((r for r in recs if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0), None)
  if pp is None and tg is None:
    return Run("llama.cpp", budget_gib, False, note=f"{label}: no pp/tg records")
  any_rec = tg or pp
  note = (f"{label}; {any_rec.get('n_threads', '?')} threads, flash_attn "
          f"{any_rec.get('flash_attn', '?')}, {any_rec.get('backends', '?')}")
  r = Run("llama.cpp", budget_gib, True, note=note, host_gib=budget_gib,
          point=f"llama.cpp:{label}")
  if pp:
    r.prefill_tok_s = float(pp["avg_ts"])
  if short and short is not pp:
    r.prefill16_tok_s = float(short["avg_ts"])
  if tg:
    r.decode_tok_s = float(tg["avg_ts"])
    r.gen_tokens = int(tg["n_gen"])
  return r


def configs(meta: dict, has_ncmoe: bool) -> list[tuple[str, list[str], float]]:
  """(label, extra flags, GiB of experts on the CPU): all layers on the GPU, every expert on
  the CPU, and the first N layers' experts on the CPU with N near jaxvt's auto budget."""
  per = meta.get("expert_layer_bytes", 0.0)
  n_layers = int(meta.get("n_layers", 0))
  every = meta.get("routed") or n_layers * per / GiB  # the MTP block's experts too, if known
  out = [("-ngl 99", ["-ngl", "99"], 0.0),
         ("-ngl 99 -ot exps=CPU", ["-ngl", "99", "-ot", "exps=CPU"], every)]
  if has_ncmoe and per and n_layers:
    n = min(n_layers, max(1, round(meta.get("auto", 0.0) * GiB / per)))
    out.append((f"-ngl 99 --n-cpu-moe {n}", ["-ngl", "99", "--n-cpu-moe", str(n)], n * per / GiB))
  return out


def _has_flag(binary: str, flag: str) -> bool:
  try:
    p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired):
    return False
  return flag in p.stdout + p.stderr


def command(binary: str, model: str, prompt: int, gen: int, extra: list[str]) -> list[str]:
  """llama-bench for one configuration: pp `prompt` and pp 16 (the short prompt), tg
  `gen` (prompt 0: decode alone), 2 repetitions each."""
  pp = f"{prompt},{SHORT}" if prompt and prompt != SHORT else str(prompt)
  return [binary, "-m", model, "-p", pp, "-n", str(gen), "-r", "2", "-o", "json", *extra]


def _call(cmd: list[str], label: str, gib: float, left: float) -> Run:
  """One llama-bench call's Run (failed, with the reason in its note, where it did not run)."""
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, 240))
    if p.returncode != 0:
      return Run("llama.cpp", gib, False, note=f"{label}: exit {p.returncode}: "
                 f"{(p.stderr.strip().splitlines() or [''])[-1][:160]}")
    return parse(p.stdout, label, gib)
  except subprocess.TimeoutExpired:
    return Run("llama.cpp", gib, False, note=f"{label}: time limit")
  except (ValueError, KeyError) as e:
    return Run("llama.cpp", gib, False, note=f"{label}: unreadable output ({e})"[:200])


def run_all(binary: str, model: str, meta: dict, prompt: int, gen: int, deadline: float,
            log, pick=None) -> list[Run]:
  """Every configuration that fits before `deadline`; waits for a build in progress. `pick`:
  has_ncmoe -> the configurations (label, flags, GiB of experts on the CPU) to run, in place of
  `configs(meta, has_ncmoe)`."""
  build = os.path.join(os.path.dirname(os.path.dirname(binary)), BUILDING)
  while not os.access(binary, os.X_OK) and os.path.exists(build) and time.time() < deadline - 60:
    time.sleep(5)
  if not os.access(binary, os.X_OK):
    log(f"llama.cpp arm skipped: {binary} was not built in time")
    return [Run("llama.cpp", 0.0, False, note="llama-bench not built in time")]
  runs = []
  has_ncmoe = _has_flag(binary, "--n-cpu-moe")
  for label, extra, gib in (pick or (lambda has: configs(meta, has)))(has_ncmoe):
    left = deadline - time.time()
    if left < 30:
      log(f"SKIP llama.cpp {label} (time limit)")
      runs.append((Run("llama.cpp", gib, False, note=f"{label}: not run (time limit)"), extra))
      continue
    cmd = command(binary, model, prompt, gen, extra)
    log("LLAMA " + " ".join(cmd))
    t = time.time()
    r = _call(cmd, label, gib, left)
    r.measure_s = time.time() - t
    r.decode_samples = [r.decode_tok_s] if r.ok and r.decode_tok_s else []
    log(f"LLAMA {label}: prefill {r.prefill_tok_s:.1f} tok/s, decode {r.decode_tok_s:.2f} tok/s "
        f"in {r.measure_s:.0f} s {r.note if not r.ok else ''}")
    runs.append((r, extra))
  again = [(r, x) for r, x in runs if r.ok and r.decode_samples and r.host_gib > 0]
  for _ in range(DECODE_CALLS - 1):  # decode again, in turns, where experts run on the CPU
    for r, extra in again:
      left = deadline - time.time()
      if left < 30:
        log(f"SKIP llama.cpp {r.point} decode call {len(r.decode_samples) + 1} (time limit)")
        continue
      t = time.time()
      more = _call(command(binary, model, 0, gen, extra), r.point, r.host_gib, left)
      r.measure_s += time.time() - t
      if more.ok and more.decode_tok_s:
        r.decode_samples.append(more.decode_tok_s)
      log(f"LLAMA {r.point} decode call {len(r.decode_samples)}: {more.decode_tok_s:.2f} tok/s "
          f"{more.note if not more.ok else ''}")
  for r, _ in again:
    r.decode_tok_s = statistics.median(r.decode_samples)
  return [r for r, _ in runs]
