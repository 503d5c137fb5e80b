"""python -m benchmarks.serve: jaxvt.serve against llama-server on one GGUF file, over HTTP.

  python -m benchmarks.serve [--model PATH] [--budgets auto,7,hbm] [--device-gb 16]
                             [--llama-server PATH] [--memory] [--write]

For each budget, `python -m jaxvt.serve` (on the emulated --device-gb card; "hbm": every weight on
the device and the whole GPU) and then llama-server (`-ngl 99 -np 8`, with `--n-cpu-moe N` for N
layers of routed experts on the CPU, about jaxvt's host-tier bytes) serve the same file, and the
same client load measures, over the OpenAI API:
  - the second turn of a conversation: a 2,000-token prompt answered, then the same prompt and
    20 new tokens; its time to the first token against a 2,020-token prompt seen for the first
    time (the reuse ratio);
  - aggregate decode throughput at 1, 2, 4 and 8 concurrent streams (--tokens each, greedy, the
    end-of-generation tokens biased away so every stream makes all its tokens).
`--budgets cpu` (alone or with others) adds the CPU arm (benchmarks.serve_cpu): the embedded
default model on the CPU backend, one and four streams, side by side with the Python API's decode
and llama-server `-np 4 -t 2` in alternating rounds, written as its own section, `serve-cpu`.
`--memory`: two more jaxvt servers at the first offloaded budget, with 1 and 8 sequences and no
prompt reuse, give the peak device memory each added sequence costs, against the planner's
figure. `--write` writes the `serve` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from benchmarks import report, serve_cpu
from benchmarks.cli import child_env, parser_of, run
from benchmarks.offload import MODEL, ensure_model, pool_fraction

GiB = 1 << 30
LLAMA_SERVER = "/tmp/llama-build/bin/llama-server"
STREAMS = (1, 2, 4, 8)
CONVERSATION, NEW_TURN = 2000, 20
CONTEXT = 2560  # tokens per sequence: the conversation, its next turn and an answer


def parser():
  ap = parser_of("serve", __doc__)
  ap.add_argument("--model", default=MODEL, help="GGUF file (default: the 35B-shaped file, "
                  "written if missing)")
  ap.add_argument("--budgets", default="auto,7,hbm")
  ap.add_argument("--device-gb", type=float, default=16.0)
  ap.add_argument("--tokens", type=int, default=128, help="tokens each stream generates")
  ap.add_argument("--llama-server", default=LLAMA_SERVER)
  ap.add_argument("--memory", action="store_true")
  ap.add_argument("--memory-budget", default="7", help="--offload-gb of --memory's servers")
  ap.add_argument("--time-limit", type=float, default=1e9, help="seconds; points past it skipped")
  ap.add_argument("--write", action="store_true")
  return ap


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """A server process on a free localhost port; `log` holds its output."""

  def __init__(self, cmd: list[str], env: dict, log: str, timeout: float = 300):
    self.port = _port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log = log
    cmd = [c.replace("{port}", str(self.port)) for c in cmd]
    self.proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    t = time.time()
    while time.time() - t < timeout:
      if self.proc.poll() is not None:
        raise RuntimeError(f"{cmd[0]} exited {self.proc.returncode}: {self.tail()}")
      try:
        if httpx.get(self.url + "/health", timeout=5).status_code == 200:
          self.start_s = time.time() - t
          return
      except httpx.TransportError:
        pass
      time.sleep(0.5)
    self.stop()
    raise RuntimeError(f"{cmd[0]} did not start in {timeout} s: {self.tail()}")

  def tail(self, n: int = 8) -> str:
    return " | ".join(open(self.log).read().splitlines()[-n:])

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()

  def complete(self, prompt: list[int], max_tokens: int, bias: dict) -> tuple[int, float]:
    """(completion tokens, seconds) of one greedy /v1/completions request."""
    t = time.perf_counter()
    r = httpx.post(self.url + "/v1/completions", timeout=600, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logit_bias": bias})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"], time.perf_counter() - t


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(100, vocab - 100, length).tolist() for _ in range(n)]


def measure(s: Server, vocab: int, eos: dict, tokens: int, seed: int) -> dict:
  """The reuse ratio and the throughput of one server (warmed up first)."""
  out = {"start_s": s.start_s}
  warm, conv, fresh = _prompts(vocab, 3, CONVERSATION + NEW_TURN, seed)
  # warm-up: each program the measurements run (the long prompt, its short next turn, and the
  # decode programs of 1 to 8 streams: their rows and step counts)
  s.complete(warm[:CONVERSATION], 1, eos)
  s.complete(warm, 1, eos)
  for c in STREAMS:
    with concurrent.futures.ThreadPoolExecutor(c) as ex:
      list(ex.map(lambda p: s.complete(p, tokens, eos), _prompts(vocab, c, 32, seed + 100 + c)))
  s.complete(conv[:CONVERSATION], 1, eos)  # the first turn
  out["turn2_s"] = s.complete(conv, 1, eos)[1]  # the same conversation and 20 new tokens
  out["fresh_s"] = s.complete(fresh, 1, eos)[1]  # a conversation never seen
  out["reuse_ratio"] = out["turn2_s"] / out["fresh_s"]
  for c in STREAMS:
    ps = _prompts(vocab, c, 32, seed + c)
    with concurrent.futures.ThreadPoolExecutor(c) as ex:
      t = time.perf_counter()
      done = list(ex.map(lambda p: s.complete(p, tokens, eos), ps))
      wall = time.perf_counter() - t
    out[f"tok_s_{c}"] = sum(n for n, _ in done) / wall
    print(f"  {c} streams: {out[f'tok_s_{c}']:.1f} tok/s", flush=True)
  print(f"  second turn {out['turn2_s']:.3f} s, fresh {out['fresh_s']:.3f} s: "
        f"{out['reuse_ratio']:.3f}x", flush=True)
  return out


def _file_facts(path: str) -> tuple[int, float, int, list[int]]:
  """(vocabulary, bytes of one layer's routed experts, layers, end-of-generation token ids)."""
  from gguf import GGUFReader
  r = GGUFReader(path)
  exps = [t for t in r.tensors if re.fullmatch(r"blk\.0\.ffn_(gate|up|down)_exps\.weight", t.name)]
  vocab = next(int(t.shape[-1]) for t in r.tensors if t.name == "token_embd.weight")
  arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
  layers = int(r.fields[f"{arch}.block_count"].parts[-1][0])
  eos = [int(r.fields[k].parts[-1][0]) for k in ("tokenizer.ggml.eos_token_id",
                                                  "tokenizer.ggml.eot_token_id") if k in r.fields]
  return vocab, float(sum(int(t.n_bytes) for t in exps)), layers, eos


def _host_gib(log: str) -> float:
  m = re.search(r"host tier: ([0-9.]+) GiB", open(log).read())
  return float(m.group(1)) if m else 0.0


def _jaxvt(args, budget: str, log: str, extra=()) -> Server:
  hbm = budget == "hbm"
  env = child_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75" if hbm else
                   pool_fraction(args.device_gb)})
  cmd = [sys.executable, "-m", "jaxvt.serve", "--model", args.model, "--port", "{port}",
         f"--max-context={CONTEXT}"]
  if budget != "auto":  # auto gives the weights what the batch would take: the planner's batch
    cmd.append("--max-batch=8")
  if not hbm:
    cmd += ["--offload-gb", budget, "--device-gb", str(args.device_gb)]
  return Server(cmd + list(extra), env, log, timeout=600)


def _llama(args, n_cpu_moe: int, log: str) -> Server:
  cmd = [args.llama_server, "-m", args.model, "--port", "{port}", "--host", "127.0.0.1",
         "-ngl", "99", "-np", "8", "-c", str(8 * CONTEXT), "--no-webui"]
  if n_cpu_moe:
    cmd += ["--n-cpu-moe", str(n_cpu_moe)]
  return Server(cmd, dict(os.environ), log, timeout=600)


def _health(s: Server) -> dict:
  return httpx.get(s.url + "/health", timeout=10).json()


def main(args) -> str:
  deadline = time.time() + args.time_limit
  budgets = [x for x in args.budgets.split(",") if x]
  logs = os.environ.get("OUT", "/tmp")
  os.makedirs(logs, exist_ok=True)
  rows, mem, cpu = [], None, None
  if "cpu" in budgets:
    print("jaxvt.serve on the CPU, the default model", flush=True)
    cpu = serve_cpu.run(args, logs, Server, _file_facts)
    budgets.remove("cpu")
  if budgets or args.memory:
    if args.model == MODEL:
      ensure_model(MODEL, print)
    vocab, per_layer, n_layers, eos_ids = _file_facts(args.model)
    eos = {str(t): -100 for t in eos_ids}
  for b in budgets:
    if time.time() > deadline:
      print(f"{b}: skipped (time limit)")
      continue
    print(f"jaxvt.serve at {b}", flush=True)
    s = _jaxvt(args, b, f"{logs}/serve_jaxvt_{b}.log")
    try:
      j = measure(s, vocab, eos, args.tokens, seed=1)
      j["serve"] = _health(s).get("serve", {})
    finally:
      s.stop()
    host = _host_gib(s.log)
    n = 0 if b == "hbm" else min(n_layers, round(host * GiB / per_layer))
    l = None
    if os.path.exists(args.llama_server) and time.time() < deadline:
      print(f"llama-server -np 8 --n-cpu-moe {n}", flush=True)
      try:
        ls = _llama(args, n, f"{logs}/serve_llama_{b}.log")
        try:
          l = measure(ls, vocab, eos, args.tokens, seed=1)
        finally:
          ls.stop()
      except RuntimeError as e:
        print(f"  llama-server failed: {e}")
    rows.append((b, host, n, j, l))
  if args.memory and time.time() < deadline:
    b = args.memory_budget
    peaks = {}
    for batch in (1, 8):
      s = _jaxvt(args, b, f"{logs}/serve_mem_{batch}.log",
                 ["--prefix-cache-gb=0", f"--max-batch={batch}"])  # the last one given wins
      try:
        ps = _prompts(vocab, batch, 32, 9)
        with concurrent.futures.ThreadPoolExecutor(batch) as ex:
          list(ex.map(lambda p: s.complete(p, args.tokens, eos), ps))
        h = _health(s)
        # what stays allocated once the streams are done (the load's transient staging makes
        # the peak the same for every batch)
        peaks[batch] = (h["memory"].get("bytes_in_use"), h["serve"]["sequence_bytes"])
      finally:
        s.stop()
    if None in (peaks[1][0], peaks[8][0]):
      print("memory: the device reports no peak (XLA:CPU keeps no memory statistics)")
    else:
      per = (peaks[8][0] - peaks[1][0]) / 7
      mem = (b, per, peaks[8][1])
      print(f"memory at {b}: {per / GiB:.3f} GiB per added sequence, planner "
            f"{mem[2] / GiB:.3f} GiB", flush=True)
  out = []
  if cpu is not None:  # its own section: a CPU run leaves the GPU runs' section as it is
    out.append(report.publish("serve-cpu", serve_cpu.section(cpu, sys.argv[1:]), args.write))
  if rows or mem is not None:
    out.append(report.publish("serve", _section(args, rows, mem), args.write))
  return "\n\n".join(out)


def _section(args, rows, mem) -> list[str]:
  cmd = "python -m benchmarks.serve " + " ".join(
      a for a in sys.argv[1:] if a != "--write") + " --write"
  out = ["## Serving: jaxvt.serve against llama-server (OpenAI API, greedy)\n",
         f"Command: `{cmd.strip()}`  ", f"Machine: {report.machine()}  ",
         f"Date: {report.stamp()}\n",
         f"The model file {os.path.basename(args.model)}; jaxvt on an emulated "
         f"{args.device_gb:g} GiB card (XLA's pool) except at `hbm`; llama-server `-ngl 99 -np 8 "
         f"-c {8 * CONTEXT}` with `--n-cpu-moe N` putting about jaxvt's host-tier bytes of routed "
         f"experts on the CPU. Second turn: a {CONVERSATION}-token prompt answered, then it and "
         f"{NEW_TURN} new tokens (time to the first token), against a "
         f"{CONVERSATION + NEW_TURN}-token prompt never seen. Streams: each makes {args.tokens} "
         "tokens from its own 32-token prompt, all started together; aggregate tokens/s.\n",
         "| budget | server | host GiB / --n-cpu-moe | 2nd turn s | fresh s | reuse ratio | "
         + " | ".join(f"{c} streams tok/s" for c in STREAMS) + " |",
         "|---|---|---|---|---|---|" + "---|" * len(STREAMS)]
  goals = []
  for b, host, n, j, l in rows:
    for name, r, where in (("jaxvt", j, f"{host:.2f}"), ("llama-server", l, f"{n}")):
      if r is None:
        continue
      out.append(f"| {b} | {name} | {where} | {r['turn2_s']:.3f} | {r['fresh_s']:.3f} | "
                 f"{r['reuse_ratio']:.3f} | "
                 + " | ".join(f"{r[f'tok_s_{c}']:.1f}" for c in STREAMS) + " |")
    goals.append(_goal(f"{b}: second turn with reuse <= 0.25x a fresh prompt",
                       j["reuse_ratio"], 0.25, lower=True))
    scale = j["tok_s_8"] / j["tok_s_1"]
    if b != "hbm" and b != "auto":
      goals.append(_goal(f"{b}: 8 streams >= 4x one stream", scale, 4.0))
    if l is not None:
      want = 1.0 if b == "hbm" else 1.3
      goals.append(_goal(f"{b}: 8 streams >= {want}x llama-server -np 8",
                         j["tok_s_8"] / l["tok_s_8"], want))
  if mem is not None:
    b, per, planned = mem
    goals.append(_goal(f"{b}: device memory in use per added sequence within 10% of the "
                       f"planner's {planned / GiB:.3f} GiB ({per / GiB:.3f} GiB)",
                       abs(per - planned) / planned, 0.10, lower=True))
  return out + ["", "Goals:"] + [f"- {g}" for g in goals]


def _goal(what: str, value: float, want: float, lower: bool = False) -> str:
  met = value <= want if lower else value >= want
  return f"{what}: {value:.2f}, {'met' if met else 'missed'}"


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  sys.exit(cli())
