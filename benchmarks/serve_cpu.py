"""The `cpu` arm of benchmarks.serve (`--budgets cpu`): jaxvt.serve on the embedded default model
on the CPU backend, where a new user starts, side by side with the Python API's decode of the same
model and with llama-server (`-np 4 -t 2`) on the same file where its binary exists.

Every arm stays up for the whole run (a server waiting for requests takes no CPU time; the API
runs in a child process that waits for a line on its stdin) and each round measures them one
after the other, so that the ratios compare arms under the same load of a shared machine; each
ratio is the median of the rounds' ratios. The arms, all greedy, 64 tokens after a 16-token
prompt of its own (end-of-generation biased away in the servers; the API's tokens stop only at
one, which random prompts do not reach in 64 tokens):
  - the API: `jaxvt.load(max_context=256).generate(...)`, its decode rate
    (GenerationStats.decode_tok_s: the tokens after the first over the decode seconds, compile
    excluded) and its whole call's rate (prefill and first token included);
  - one stream, streamed (server-sent events): its decode rate as the client sees it (the
    tokens after the first over the time from the first event with text to the end), against
    the API's decode rate, and its whole request's rate, against the API's whole call;
  - one and four concurrent streams, not streamed: the aggregate tokens/s of the client load
    (its requests' tokens over the wall time from the first sent to the last answered), against
    llama-server under the same load."""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np

from benchmarks import report
from benchmarks.cli import child_env

STREAMS = (1, 4)
TOKENS = 64
PROMPT = 16
CONTEXT = 256
ROUNDS = 7
DECODE_GOAL = 0.90  # one stream's decode rate over the API's
LLAMA_GOAL = 1.0  # four streams over llama-server's

# The API in a child process: loads the default model, then for each line on stdin (a JSON list
# of token ids) runs one generate of that prompt and prints its rates as a JSON line.
_API = """
import json, sys, jaxvt
from jaxvt import SamplingParams
eng = jaxvt.load(max_context={ctx})
print("READY", flush=True)
for line in sys.stdin:
  g = eng.generate(json.loads(line), max_tokens={n}, sampling=SamplingParams(temperature=0.0))
  st = g.stats
  print(json.dumps({{"decode": st.decode_tok_s, "whole": st.generated_tokens /
                    (st.prefill_seconds + st.decode_seconds), "tokens": st.generated_tokens}}),
        flush=True)
"""


class Api:
  """The API's child process."""

  def __init__(self):
    self.proc = subprocess.Popen(
        [sys.executable, "-c", _API.format(ctx=CONTEXT, n=TOKENS)],
        env=child_env({"JAX_PLATFORMS": "cpu"}), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    self._read("READY")

  def _read(self, want: str | None = None) -> str:
    while True:
      line = self.proc.stdout.readline()
      if not line:
        raise RuntimeError(f"the API's process exited {self.proc.wait()}")
      if want is None and line.startswith("{") or want and line.startswith(want):
        return line

  def run(self, prompt: list[int]) -> dict:
    self.proc.stdin.write(json.dumps(prompt) + "\n")
    self.proc.stdin.flush()
    return json.loads(self._read())

  def stop(self) -> None:
    self.proc.stdin.close()
    self.proc.wait(60)


def _prompt(*key: int) -> list[int]:
  """The PROMPT random token ids of `key` (round, arm, stream): no prompt repeats another, so
  neither server's prompt cache shortens a prefill (the two servers get the same prompts)."""
  return np.random.default_rng(list(key)).integers(100, 5100, PROMPT).tolist()


def streamed(s, prompt: list[int], bias: dict) -> dict:
  """One streamed request: {"decode": tok/s from its first text event to its end, "whole":
  tok/s of the whole request, "tokens"}."""
  body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "logit_bias": bias,
          "stream": True, "stream_options": {"include_usage": True}}
  first, n = None, 0
  t = time.perf_counter()
  with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=600) as r:
    r.raise_for_status()
    for line in r.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if first is None and any(c.get("text") for c in event.get("choices", [])):
        first = time.perf_counter()
      if event.get("usage"):
        n = event["usage"]["completion_tokens"]
  end = time.perf_counter()
  return {"decode": (n - 1) / (end - first), "whole": n / (end - t), "tokens": n}


def concurrent_load(s, streams: int, seed: int, bias: dict) -> float:
  """Aggregate tok/s of `streams` concurrent greedy requests of TOKENS tokens, not streamed."""
  with concurrent.futures.ThreadPoolExecutor(streams) as ex:
    t = time.perf_counter()
    done = list(ex.map(lambda i: s.complete(_prompt(seed, 2 + streams, i), TOKENS, bias),
                       range(streams)))
    wall = time.perf_counter() - t
  return sum(n for n, _ in done) / wall


def run(args, logs: str, server_cls, file_facts) -> dict:
  """{"path", "rounds": [{arm: value}], "llama": whether llama-server ran}."""
  from jaxvt.gguf.default_model import default_model_path
  path = default_model_path()
  bias = {str(t): -100 for t in file_facts(path)[3]}
  servers, out = {}, {"path": path, "rounds": [], "llama": False}
  api = Api()
  try:
    servers["jaxvt"] = server_cls(
        [sys.executable, "-m", "jaxvt.serve", "--port", "{port}", f"--max-context={CONTEXT}",
         f"--max-batch={max(STREAMS)}"],
        child_env({"JAX_PLATFORMS": "cpu"}), f"{logs}/serve_jaxvt_cpu.log")
    if os.path.exists(args.llama_server):
      servers["llama"] = server_cls(
          [args.llama_server, "-m", path, "--port", "{port}", "--host", "127.0.0.1",
           "-np", str(max(STREAMS)), "-t", "2", "-c", str(max(STREAMS) * CONTEXT), "--no-webui"],
          dict(os.environ), f"{logs}/serve_llama_cpu.log")
      out["llama"] = True
    # warm-up: every program of the measured loads compiles (jaxvt) or pages in (llama.cpp):
    # 1 to 4 streams, as the requests of a load may arrive in the engine loop a few at a time
    api.run(_prompt(0, 0))
    for name, s in servers.items():
      streamed(s, _prompt(0, 1), bias)
      for c in range(1, max(STREAMS) + 1):
        concurrent_load(s, c, 0, bias)
    for i in range(ROUNDS):
      seed = 1 + i
      row = {"api": api.run(_prompt(seed, 0)),
             "stream": streamed(servers["jaxvt"], _prompt(seed, 1), bias)}
      for name, s in servers.items():
        for c in STREAMS:
          row[f"{name}_{c}"] = concurrent_load(s, c, seed, bias)
      row["load"] = os.getloadavg()[0]  # the machine's 1-minute load average after the round
      out["rounds"].append(row)
      print(f"  round {i + 1}: " + ", ".join(
          f"{k} {v['decode']:.1f}/{v['whole']:.1f}" if isinstance(v, dict) else f"{k} {v:.1f}"
          for k, v in row.items()), flush=True)
  finally:
    for s in servers.values():
      s.stop()
    api.stop()
  return out


def _median(rounds: list[dict], f) -> tuple[float, float, float]:
  xs = [f(r) for r in rounds]
  return statistics.median(xs), min(xs), max(xs)


def summary(r: dict) -> dict:
  """Medians (and ranges) over the rounds: each arm's rate and each ratio."""
  R = r["rounds"]
  out = {"api decode": _median(R, lambda x: x["api"]["decode"]),
         "api whole": _median(R, lambda x: x["api"]["whole"]),
         "stream decode": _median(R, lambda x: x["stream"]["decode"]),
         "stream whole": _median(R, lambda x: x["stream"]["whole"]),
         "stream decode / api decode": _median(
             R, lambda x: x["stream"]["decode"] / x["api"]["decode"]),
         "stream whole / api whole": _median(
             R, lambda x: x["stream"]["whole"] / x["api"]["whole"])}
  for c in STREAMS:
    out[f"jaxvt {c}"] = _median(R, lambda x: x[f"jaxvt_{c}"])
    out[f"jaxvt {c} / api decode"] = _median(R, lambda x: x[f"jaxvt_{c}"] / x["api"]["decode"])
    if r["llama"]:
      out[f"llama {c}"] = _median(R, lambda x: x[f"llama_{c}"])
      out[f"jaxvt {c} / llama {c}"] = _median(R, lambda x: x[f"jaxvt_{c}"] / x[f"llama_{c}"])
  return out


def section(r: dict, argv: list[str]) -> list[str]:
  """The `serve-cpu` section of docs/BENCHMARKS.md."""
  cmd = "python -m benchmarks.serve " + " ".join(a for a in argv if a != "--write") + " --write"
  m = summary(r)
  f = lambda k, p=1: f"{m[k][0]:.{p}f} ({m[k][1]:.{p}f}-{m[k][2]:.{p}f})"
  llama = r["llama"]
  out = ["## Serving on the CPU: the default model\n", f"Command: `{cmd.strip()}`  ",
         f"Machine: {report.machine()}, shared with other work while it ran  ",
         f"Date: {report.stamp()}\n",
         f"The embedded default model ({os.path.basename(r['path'])}) on the CPU backend: "
         f"jaxvt.serve (`--max-context {CONTEXT} --max-batch {max(STREAMS)}`), the Python API "
         f"(`jaxvt.load(max_context={CONTEXT}).generate`) and "
         + (f"llama-server (`-np {max(STREAMS)} -t 2 -c {max(STREAMS) * CONTEXT}`, built from "
            "the llama.cpp source of the llama-cpp-python sdist by tools/build_llamacpp.sh)"
            if llama else "no llama-server (not built on this machine)")
         + f", all up at once and measured one after the other in each of {len(r['rounds'])} "
         f"rounds (after a warm-up round), so each ratio compares arms under the same load: "
         f"medians over the rounds, the range in brackets. {TOKENS} greedy tokens after a "
         f"{PROMPT}-token prompt per stream, end-of-generation biased away in the servers. "
         "Decode: tokens after the first over the time after the first (the API's "
         "GenerationStats.decode_tok_s; the server's from its first streamed text to the end); "
         "whole: tokens over the whole call or request, prefill included. Concurrent streams: "
         "not streamed, the aggregate tokens/s. The machine's 1-minute load average after each "
         f"round: {min(x['load'] for x in r['rounds']):.1f}-"
         f"{max(x['load'] for x in r['rounds']):.1f} (on {os.cpu_count()} cores)"
         + (f"; every arm ran at nice {os.nice(0)}" if os.nice(0) else "") + ". llama.cpp's "
         "threads spin while they wait for each other (its --poll), so other processes on the "
         "cores slow llama-server more than the others: a busy round shows in its range.\n",
         "| arm | decode tok/s | whole tok/s |", "|---|---|---|",
         f"| the API | {f('api decode')} | {f('api whole')} |",
         f"| jaxvt.serve, one stream, streamed | {f('stream decode')} | {f('stream whole')} |",
         f"| ratio | {f('stream decode / api decode', 2)} | {f('stream whole / api whole', 2)} |",
         "", "| streams | jaxvt.serve tok/s | x the API's decode | llama-server tok/s | x llama |",
         "|---|---|---|---|---|"]
  for c in STREAMS:
    lt = f(f"llama {c}") if llama else "-"
    lx = f(f"jaxvt {c} / llama {c}", 2) if llama else "-"
    out.append(f"| {c} | {f(f'jaxvt {c}')} | {f(f'jaxvt {c} / api decode', 2)} | {lt} | {lx} |")
  dec = m["stream decode / api decode"][0]
  goals = [f"one stream's decode within 10% of the API's: {dec:.2f}x, "
           f"{'met' if dec >= DECODE_GOAL else 'missed'}"]
  if llama:
    x = m[f"jaxvt {max(STREAMS)} / llama {max(STREAMS)}"][0]
    goals.append(f"{max(STREAMS)} streams >= {LLAMA_GOAL:.1f}x llama-server: {x:.2f}x, "
                 f"{'met' if x >= LLAMA_GOAL else 'missed'}")
  else:
    goals.append(f"{max(STREAMS)} streams >= {LLAMA_GOAL:.1f}x llama-server: not measured "
                 "(no llama-server binary)")
  return out + ["", "Goals:"] + [f"- {g}" for g in goals]
