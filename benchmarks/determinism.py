"""python -m benchmarks.determinism: same tokens in every process and at every budget, and what
fixing XLA's algorithm choices (jaxvt.programs) costs in speed.

  compare  one child process per configuration (`--configs`: offload budgets, optionally with
           --device-gb; the first one runs twice), each with the compilation cache off so that
           every process compiles its own programs: greedy tokens for each prompt, the tokens
           sampled at --temperature with a fixed seed, and SHA-256 digests of the float32
           logits of prefill and of the first decode steps (teacher-forced on the greedy
           tokens, by decode_fn). Every configuration must give the same of each.
  cost     one process, one engine: prefill and decode rates with the deterministic options on
           and off (the same weights, Exec.deterministic flipped), alternating, medians.

A configuration is BUDGET or BUDGET@DEVICE_GB: BUDGET a number of GiB, `auto` or `all` (every
offloadable weight in the host tier). `--child JSON` runs one configuration (internal).
Writes the `determinism` section of docs/BENCHMARKS.md with --write.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import subprocess
import sys
import time

import numpy as np

import jaxvt
from benchmarks import report
from benchmarks.arms import no_stops
from benchmarks.cli import child_env, parser_of, run

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")
LOGIT_STEPS = 8  # decode steps whose logits are digested


def parser() -> argparse.ArgumentParser:
  ap = parser_of("determinism", __doc__)
  ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
  ap.add_argument("--configs", default="0,all,auto",
                  help="comma list of BUDGET[@DEVICE_GB] (GiB, auto or all); the first runs twice")
  ap.add_argument("--tokens", type=int, default=128)
  ap.add_argument("--max-context", type=int, default=2048)
  ap.add_argument("--temperature", type=float, default=0.8)
  ap.add_argument("--seed", type=int, default=7)
  ap.add_argument("--nondeterministic", action="store_true",
                  help="compare with XLA's default (autotuned) algorithm choices")
  ap.add_argument("--prompt", type=int, default=512, help="cost: prompt tokens")
  ap.add_argument("--repeats", type=int, default=3, help="cost: timed generates per setting")
  ap.add_argument("--cost-budget", default="0", help="cost: the offload budget (GiB, auto, all)")
  ap.add_argument("--device-gb", type=float, default=None, help="cost: as jaxvt.run --device-gb")
  ap.add_argument("--compare-only", action="store_true")
  ap.add_argument("--cost-only", action="store_true")
  ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  return ap


def parse_config(text: str) -> dict:
  """'0', 'auto', '2.5@16', 'all@16' -> {offload, device_gb}."""
  budget, _, dev = text.partition("@")
  return dict(offload=budget.strip(), device_gb=float(dev) if dev else None)


def _offload(value: str):
  return "auto" if value == "auto" else 1e4 if value == "all" else float(value)


def _digest(x) -> str:
  return hashlib.sha256(np.asarray(x, np.float32).tobytes()).hexdigest()[:16]


def child(spec: dict) -> dict:
  """One configuration in this process: tokens, sampled tokens and logits digests."""
  eng = no_stops(jaxvt.load(spec["model"], offload_gb=_offload(spec["offload"]),
                            device_gb=spec["device_gb"], max_context=spec["max_context"],
                            deterministic=spec["deterministic"], compile_cache=False))
  with eng:
    out = dict(config=spec["config"], host_gib=eng.plan.plan.host_bytes / (1 << 30),
               tokens=[], logits=[], sampled=None)
    for prompt in PROMPTS:
      g = eng.generate(prompt, max_tokens=spec["tokens"])
      out["tokens"].append(g.tokens)
      ids = eng.encode_prompt(prompt)
      logits, cache = eng.prefill(ids)
      digests = [_digest(logits)]
      for i, tok in enumerate(g.tokens[:LOGIT_STEPS]):
        logits, cache = eng.decode_step(cache, tok, len(ids) + i)
        digests.append(_digest(logits))
      out["logits"].append(digests)
    params = jaxvt.SamplingParams(temperature=spec["temperature"], top_k=40, top_p=0.95)
    out["sampled"] = eng.generate(PROMPTS[0], max_tokens=spec["tokens"], sampling=params,
                                  seed=spec["seed"]).tokens
  return out


def run_child(spec: dict, env: dict | None = None) -> dict:
  """`child(spec)` in a fresh process (its own compiles); raises with its stderr on failure."""
  base = child_env() if env is None else dict(env)
  p = subprocess.run([sys.executable, "-m", "benchmarks.determinism", "--child",
                      json.dumps(spec)], capture_output=True, text=True,
                     env=dict(base, JAXVT_COMPILE_CACHE="0"))
  for line in p.stdout.splitlines():
    if line.startswith("CASE "):
      return json.loads(line[5:])
  raise RuntimeError(f"determinism child {spec['config']} exited {p.returncode}:\n{p.stderr}")


def first_difference(a: dict, b: dict) -> str | None:
  """Where run `b` first differs from run `a` (None: identical)."""
  for key in ("tokens", "logits"):
    for i, (x, y) in enumerate(zip(a[key], b[key])):
      for j, (u, v) in enumerate(zip(x, y)):
        if u != v:
          return f"{key} of prompt {i} differ at step {j}"
  if a["sampled"] != b["sampled"]:
    j = next((j for j, (u, v) in enumerate(zip(a["sampled"], b["sampled"])) if u != v), None)
    return f"sampled tokens differ at step {j}"
  return None


def compare(args) -> tuple[list[dict], list[str]]:
  """Runs every configuration (the first twice) in its own process; (runs, differences)."""
  configs = [c.strip() for c in args.configs.split(",") if c.strip()]
  base = dict(model=args.model, tokens=args.tokens, max_context=args.max_context,
              deterministic=not args.nondeterministic, temperature=args.temperature,
              seed=args.seed)
  runs = []
  repeat = getattr(args, "repeat_first", True)
  for i, c in enumerate([configs[0]] * repeat + configs):
    spec = dict(base, config=c + (" (second process)" if repeat and i == 1 else ""),
                **parse_config(c))
    runs.append(run_child(spec))
    print(f"  {runs[-1]['config']}: host tier {runs[-1]['host_gib']:.2f} GiB", flush=True)
  diffs = [f"{r['config']}: {d}" for r in runs[1:] if (d := first_difference(runs[0], r))]
  return runs, diffs


def cost(args) -> dict:
  """Prefill and decode tok/s with the deterministic options on and off, one engine."""
  eng = no_stops(jaxvt.load(args.model, offload_gb=_offload(args.cost_budget),
                            max_context=args.max_context, device_gb=args.device_gb))
  engines = {True: eng, False: dataclasses.replace(
      eng, ex=dataclasses.replace(eng.ex, deterministic=False), warmed=set())}
  words = eng.tokenizer.encode(" ".join(["the model reads the weights where they live"] * 200))
  ids = words[:args.prompt]
  rates = {d: dict(prefill=[], decode=[], compile=0.0) for d in engines}
  try:
    for d, e in engines.items():
      rates[d]["compile"] = e.warm_up(len(ids), args.tokens)
    for _ in range(args.repeats):
      for d, e in engines.items():
        g = e.generate(ids, max_tokens=args.tokens)
        rates[d]["prefill"].append(g.stats.prefill_tok_s)
        rates[d]["decode"].append(g.stats.decode_tok_s)
  finally:
    eng.close()
  return {("on" if d else "off"): dict(prefill=statistics.median(r["prefill"]),
                                        decode=statistics.median(r["decode"]),
                                        compile=r["compile"]) for d, r in rates.items()}


def _argv() -> list[str]:
  """This process's options (also when run as `python -m benchmarks determinism ...`)."""
  argv = sys.argv[1:]
  return argv[1:] if argv[:1] == ["determinism"] else argv


def main(args) -> str:
  if args.child:
    print("CASE " + json.dumps(child(json.loads(args.child))), flush=True)
    return ""
  t0 = time.perf_counter()
  lines = ["## Determinism: tokens across processes and budgets, and its cost\n",
           f"Command: `python -m benchmarks.determinism {' '.join(_argv())}`  ",
           f"Machine: {report.machine()}  ", f"Date: {report.stamp()}\n"]
  ok = True
  if not args.cost_only:
    runs, diffs = compare(args)
    ok = not diffs
    mode = "off (XLA's defaults)" if args.nondeterministic else "on"
    lines.append(f"Deterministic options {mode}; {args.tokens} greedy tokens for each of "
                 f"{len(PROMPTS)} prompts, {args.tokens} tokens sampled at temperature "
                 f"{args.temperature} (seed {args.seed}), logits digests of prefill and "
                 f"{LOGIT_STEPS} decode steps; one process per configuration, compilation "
                 "cache off.\n")
    lines += ["| configuration | host tier GiB | same as the first |", "|---|---|---|"]
    for r in runs:
      d = first_difference(runs[0], r)
      lines.append(f"| {r['config']} | {r['host_gib']:.2f} | {'yes' if d is None else d} |")
    lines.append("")
  if not args.compare_only:
    c = cost(args)
    lines += [f"Cost (one engine, budget {args.cost_budget}, a {args.prompt}-token prompt, "
              f"{args.tokens} tokens, medians of {args.repeats}):\n",
              "| deterministic | prefill tok/s | decode tok/s | compile s |",
              "|---|---|---|---|"]
    for k, v in c.items():
      lines.append(f"| {k} | {v['prefill']:.1f} | {v['decode']:.1f} | {v['compile']:.1f} |")
    lines.append(f"\non / off: prefill {c['on']['prefill'] / c['off']['prefill']:.3f}x, decode "
                 f"{c['on']['decode'] / c['off']['decode']:.3f}x.")
  lines.append(f"\n({time.perf_counter() - t0:.0f} s)")
  body = report.publish("determinism", lines, args.write)
  if not ok:
    raise SystemExit(body + "\nDIFFERENT: " + "; ".join(diffs))
  return body


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  sys.exit(cli())
