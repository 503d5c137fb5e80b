"""The `cpu` arm of benchmarks.serve (`--budgets cpu`): jaxvt.serve on the embedded default model
on the CPU backend, where a new user starts: one and four concurrent streams of 64 greedy tokens
(end-of-generation biased away; --max-batch 4), beside the Python API's own decode rate of the
same model measured in the same run (jaxvt.Engine.generate, a child process, greedy, after a
warm-up), and llama-server (`-np 4 -t 2`) on the same file where its binary exists."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time

from benchmarks import report
from benchmarks.cli import child_env

STREAMS = (1, 4)
TOKENS = 64
CONTEXT = 256

# the API's decode rate: jaxvt.load's default model, greedy, a warm-up, then the best of three
_API = """
import json, jaxvt
from jaxvt import SamplingParams
eng = jaxvt.load(max_context={ctx})
rates = []
for i in range(4):
  g = eng.generate(list(range(1000 + 7 * i, 1012 + 7 * i)), max_tokens={n},
                   sampling=SamplingParams(temperature=0.0))
  st = g.stats
  if i and st.generated_tokens > 8:
    rates.append((st.generated_tokens - 1) / st.decode_seconds)
print("RATES " + json.dumps(rates))
"""


def api_rate() -> float:
  """The API's decode tok/s (the best of its timed runs), in a child process on the CPU."""
  out = subprocess.run([sys.executable, "-c", _API.format(ctx=CONTEXT, n=TOKENS)],
                       env=child_env({"JAX_PLATFORMS": "cpu"}), capture_output=True, text=True,
                       timeout=600, check=True).stdout
  rates = json.loads(next(l for l in out.splitlines() if l.startswith("RATES "))[6:])
  return max(rates) if rates else 0.0


def streams(s, prompts: list[list[int]], eos: dict) -> float:
  """Aggregate tok/s of len(prompts) concurrent greedy requests of TOKENS tokens."""
  with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
    t = time.perf_counter()
    done = list(ex.map(lambda p: s.complete(p, TOKENS, eos), prompts))
    wall = time.perf_counter() - t
  return sum(n for n, _ in done) / wall


def measure(s, eos: dict) -> dict:
  """The best tok/s of three runs at each of STREAMS (after a warm-up of each: its programs
  compile), as the API's rate is its best of three."""
  ps = lambda c, seed: [[100 + (seed * 31 + 7 * i + j) % 5000 for j in range(16)]
                        for i in range(c)]
  for c in STREAMS:
    streams(s, ps(c, 1), eos)
  return {c: max(streams(s, ps(c, 2 + i), eos) for i in range(3)) for c in STREAMS}


def run(args, logs: str, server_cls, file_facts) -> dict:
  """{"path", "api", "jaxvt": {streams: tok/s}, "llama": {...} or None}."""
  from jaxvt.gguf.default_model import default_model_path
  path = default_model_path()
  eos = {str(t): -100 for t in file_facts(path)[3]}
  before = api_rate()
  print(f"  the API: {before:.1f} tok/s", flush=True)
  out = {"path": path, "llama": None}
  s = server_cls([sys.executable, "-m", "jaxvt.serve", "--port", "{port}",
                  f"--max-context={CONTEXT}", f"--max-batch={max(STREAMS)}"],
                 child_env({"JAX_PLATFORMS": "cpu"}), f"{logs}/serve_jaxvt_cpu.log")
  try:
    out["jaxvt"] = measure(s, eos)
  finally:
    s.stop()
  print(f"  jaxvt.serve: {out['jaxvt']}", flush=True)
  after = api_rate()  # before and after the server: the machine's load drifts
  out["api"], out["api_range"] = (before + after) / 2, (before, after)
  print(f"  the API again: {after:.1f} tok/s", flush=True)
  if os.path.exists(args.llama_server):
    ls = server_cls([args.llama_server, "-m", path, "--port", "{port}", "--host", "127.0.0.1",
                     "-np", str(max(STREAMS)), "-t", "2", "-c", str(max(STREAMS) * CONTEXT),
                     "--no-webui"], dict(os.environ), f"{logs}/serve_llama_cpu.log")
    try:
      out["llama"] = measure(ls, eos)
    finally:
      ls.stop()
  return out


def section(r: dict, argv: list[str]) -> list[str]:
  """The `serve-cpu` section of docs/BENCHMARKS.md."""
  cmd = "python -m benchmarks.serve " + " ".join(a for a in argv if a != "--write") + " --write"
  j, l, api = r["jaxvt"], r["llama"], r["api"]
  out = ["## Serving on the CPU: the default model\n", f"Command: `{cmd.strip()}`  ",
         f"Machine: {report.machine()}  ", f"Date: {report.stamp()}\n",
         f"jaxvt.serve on the embedded default model ({os.path.basename(r['path'])}) "
         f"on the CPU backend, --max-batch {max(STREAMS)}, {TOKENS} greedy tokens a stream; the "
         f"Python API's decode rate of the same model in the same run: {api:.1f} tok/s (the "
         f"mean of its best of three before the server, {r['api_range'][0]:.1f}, and after, "
         f"{r['api_range'][1]:.1f}); jaxvt.serve: the best of three runs. "
         + ("llama-server: not built on this machine." if l is None else
            f"llama-server -np {max(STREAMS)} -t 2 on the same file."), "",
         "| streams | jaxvt.serve tok/s | x the API's decode | llama-server tok/s | x llama |",
         "|---|---|---|---|---|"]
  for c in STREAMS:
    lt = "-" if l is None else f"{l[c]:.1f}"
    lx = "-" if l is None or not l[c] else f"{j[c] / l[c]:.2f}"
    out.append(f"| {c} | {j[c]:.1f} | {j[c] / api:.2f} | {lt} | {lx} |" if api else
               f"| {c} | {j[c]:.1f} | - | {lt} | {lx} |")
  return out
