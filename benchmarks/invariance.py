"""python -m benchmarks.invariance: the cost of scheduling-invariant arithmetic (CPU; --gpu).

Two engines of the default model in one process, side by side: the default "ggml" numerics
(every attention query row takes one recipe, so a request's tokens do not depend on how it was
scheduled) and "llamacpp" (llama.cpp's choice of recipe by the number of query tokens in a call:
jaxvt's arithmetic before the invariant default). Decode: steps of 1 and of 8 rows through the
engine's decode program (jaxvt.engine.decode_fn on a cache of that many rows); prefill: prompts of 151 and 512 tokens
(Engine.prefill). The arms alternate within every repeat, so a machine shared with other work
disturbs both alike; medians and their ratio are reported.

`--hybrid`: the same cases on a synthetic Qwen3.5-MoE-shaped file (jaxvt.synth, Q8_0, 8 layers of
d_model 1024, DeltaNet layers of 16 value heads of 128 x 128, written once to --hybrid-file)
with the DeltaNet mixer as jnp ("jnp": the recurrence, XLA's code for the conv, norms and
gates) and as the fused step token by token ("fused": the CPU's default, bitwise invariant).

`--gpu`: on a GPU, the default tuning row against --batch-invariant's
(jaxvt.ffi.tuning.GPU_INVARIANT_PRODUCTS) on one set of weights (--model, default the
Qwen3.6-35B-A3B-shaped file of benchmarks.offload, written once): decode steps of 1 and 8 rows
and a 512-token prefill. It writes its section of docs/BENCHMARKS.md only with --write.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import numpy as np

import jaxvt
from benchmarks import report
from benchmarks.cli import parser_of, run
from benchmarks.cpu import LONG
from jaxvt import JaxvtError, engine, synth

ARMS = ("llamacpp", "ggml")  # before (llama.cpp's recipe choice), after (the invariant default)
PROMPTS = (151, 512)
ROWS = (1, 8)


HYBRID = dict(n_layers=8, d_model=1024, vocab_size=4096, n_heads=8, n_kv_heads=2, head_dim=128,
              rope_dim=32, n_experts=32, n_experts_used=4, expert_ffn_dim=256,
              shared_ffn_dim=256, ssm_k_heads=8, ssm_v_heads=16, ssm_k_dim=128, ssm_v_dim=128,
              context_length=4096)


def parser():
  ap = parser_of("invariance", __doc__)
  ap.add_argument("--steps", type=int, default=8, help="decode steps per timed program")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--hybrid", action="store_true",
                  help="the DeltaNet mixer's arms on a synthetic hybrid file instead")
  ap.add_argument("--hybrid-file", default="/tmp/jaxvt-bench-invariance-q35.gguf")
  ap.add_argument("--no-write", action="store_true", help="print, do not write BENCHMARKS.md")
  ap.add_argument("--gpu", action="store_true",
                  help="on a GPU: the default tuning row against --batch-invariant's")
  ap.add_argument("--model", default=None,
                  help="--gpu's file (default: benchmarks.offload.MODEL, written if missing)")
  ap.add_argument("--write", action="store_true",
                  help="--gpu: write its section of BENCHMARKS.md (else print only)")
  return ap


def _prompt(eng, n: int) -> list[int]:
  ids = eng.tokenizer.encode(LONG)
  while len(ids) < n:
    ids = ids + ids
  return ids[:n]


def _decode_rate(eng, cache: dict, steps: int) -> tuple[float, dict]:
  """Tokens a second of `steps` decode steps of every row of `cache` (positions 151 on), and the
  cache they return."""
  rows = cache["k"].shape[1]
  tok = jax.device_put(np.ones((rows, 1), np.int32))
  t = time.perf_counter()
  for i in range(steps):
    pos = jax.device_put(np.full((rows, 1), 151 + i, np.int32))
    logits, cache = engine.decode_fn(eng.weights, cache, tok, pos, cfg=eng.cfg, ex=eng.ex,
                                     kv_len=eng.kv_len(151 + steps))
  logits.block_until_ready()
  return rows * steps / (time.perf_counter() - t), cache


def _prefill_rate(eng, ids: list[int]) -> float:
  t = time.perf_counter()
  logits, _ = eng.prefill(ids)
  logits.block_until_ready()
  return len(ids) / (time.perf_counter() - t)


def _hybrid_engines(path: str) -> dict:
  """The hybrid file's two arms: the DeltaNet mixer in jnp, and fused (the CPU's default)."""
  if not os.path.exists(path):
    synth.write_model(path, synth.tiny_config("qwen35moe", **HYBRID), "q8_0", seed=1)
  engines = {arm: jaxvt.load(path, max_context=1024) for arm in HYBRID_ARMS}
  ex = engines["jnp"].ex
  engines["jnp"].ex = dataclasses.replace(
      ex, products=dataclasses.replace(ex.products, gdn_fused=False))
  return engines


HYBRID_ARMS = ("jnp", "fused")


GPU_ARMS = ("default", "invariant")
GPU_PROMPTS = (512,)


def _gpu_engines(model: str | None) -> dict:
  """The GPU's two arms on one set of weights: the engine jaxvt.load gives, and the same
  weights computed as jaxvt.load(batch_invariant=True) computes (engine.exec_for's row)."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    raise JaxvtError("--gpu measures the GPU's tuning rows, and JAX sees no GPU here (the CPU's "
                     "default arithmetic is already batch-invariant: run without --gpu)")
  if model is None:
    from benchmarks.offload import MODEL, ensure_model
    ensure_model(MODEL, print)
    model = MODEL
  eng = jaxvt.load(model, max_context=2048)
  ex = eng.ex
  inv = engine.exec_for(dev.platform, ex.kernels, ex.par, ex.deterministic, ex.numerics,
                        batch_invariant=True)
  return {"default": eng, "invariant": dataclasses.replace(eng, ex=inv)}


def main(args) -> str:
  if args.gpu:
    arms, engines, prompt_lengths = GPU_ARMS, _gpu_engines(args.model), GPU_PROMPTS
  else:
    arms, prompt_lengths = (HYBRID_ARMS if args.hybrid else ARMS), PROMPTS
    engines = (_hybrid_engines(args.hybrid_file) if args.hybrid else
               {arm: jaxvt.load(max_context=1024, numerics=arm) for arm in ARMS})
  cases = [("decode", r) for r in ROWS] + [("prefill", n) for n in prompt_lengths]
  med, ratios = alternate(engines, arms, cases, args.steps, args.repeats)
  cmd = f"python -m benchmarks.invariance --steps {args.steps} --repeats {args.repeats}"
  if args.gpu:
    lines = _gpu_lines(args, cmd + " --gpu" + (f" --model {args.model}" if args.model else ""),
                       engines["default"], cases, med, ratios)
    engines["default"].close()  # the other arm shares its weights
    return report.publish("invariance-gpu", lines, write=args.write)
  if args.hybrid:
    lines = _hybrid_lines(args, cmd + " --hybrid", cases, med, ratios)
    for e in engines.values():
      e.close()
    return report.publish("invariance-hybrid", lines, write=not args.no_write)
  lines = ["## Cost of scheduling-invariant arithmetic (CPU, default model)\n",
           f"Command: `{cmd}`  ", f"Machine: {report.machine()}  ",
           f"Date: {report.stamp()}\n",
           "Two engines in one process, the arms alternating within each repeat (the machine is "
           "shared: compare the ratio, not the rates). \"llamacpp\": llama.cpp's attention recipe "
           "by the number of query tokens in a call (jaxvt's arithmetic before the invariant "
           "default); \"ggml\": the default, one recipe for every query row. Decode: "
           f"{args.steps} steps of 1 and 8 rows (Engine's decode_fn); prefill: "
           f"Engine.prefill of a prompt. Medians of {args.repeats} repeats after a compiling "
           "one; the ratio is the median of each repeat's adjacent pair (its range beside it). "
           "A prefill of >= 2 tokens takes the same kernels in both arms (llama.cpp's prompt "
           "recipe), so its ratio shows the machine's noise.\n",
           "| case | llamacpp tok/s | ggml (default) tok/s | ggml / llamacpp (range) |",
           "|---|---|---|---|"] + _table(ARMS, cases, med, ratios)
  for e in engines.values():
    e.close()
  return report.publish("invariance", lines, write=not args.no_write)


def alternate(engines: dict, arms, cases, steps: int, repeats: int):
  """Each arm's rate on each case ("decode", rows) / ("prefill", tokens), the arms alternating
  within every repeat (the first round compiles: not counted). Returns (median tok/s by (arm,
  case), the arms[1] / arms[0] ratios of each repeat by case: drift of the load cancels)."""
  caches = {(arm, n): engines[arm].new_cache(n) for arm in arms for kind, n in cases
            if kind == "decode"}
  prompts = {n: _prompt(engines[arms[0]], n) for kind, n in cases if kind == "prefill"}
  rates = {(arm, c): [] for arm in arms for c in cases}
  ratios = {c: [] for c in cases}
  for rep in range(repeats + 1):
    for c in cases:
      got = {}
      for arm in (arms if rep % 2 else arms[::-1]):
        kind, n = c
        if kind == "decode":
          got[arm], caches[(arm, n)] = _decode_rate(engines[arm], caches[(arm, n)], steps)
        else:
          got[arm] = _prefill_rate(engines[arm], prompts[n])
        if rep:
          rates[(arm, c)].append(got[arm])
      if rep:
        ratios[c].append(got[arms[1]] / got[arms[0]])
  return {k: statistics.median(v) for k, v in rates.items()}, ratios


def _hybrid_lines(args, cmd: str, cases, med, ratios) -> list[str]:
  lines = ["## Cost of the bitwise-invariant DeltaNet mixer (CPU, a hybrid file)\n",
           f"Command: `{cmd}`  ", f"Machine: {report.machine()}  ",
           f"Date: {report.stamp()}\n",
           "A synthetic Qwen3.5-MoE-shaped file (Q8_0; 8 layers of d_model 1024, 6 DeltaNet "
           "layers of 16 value heads of 128 x 128; benchmarks.invariance.HYBRID), two engines in "
           "one process, the arms alternating within each repeat (the machine is shared: "
           "compare the ratio, not the rates). \"jnp\": the DeltaNet mixer in jnp (the "
           "recurrence; XLA's conv, norms and gates, whose bits depend on the shapes); "
           "\"fused\": the CPU's default, the fused step kernel token by token, the same bits "
           f"however the tokens are scheduled. Decode: {args.steps} steps of 1 and 8 rows; "
           f"prefill: Engine.prefill. Medians of {args.repeats} repeats after a compiling one; "
           "the ratio is the median of each repeat's adjacent pair (its range beside it).\n",
           "| case | jnp tok/s | fused (default) tok/s | fused / jnp (range) |",
           "|---|---|---|---|"]
  return lines + _table(HYBRID_ARMS, cases, med, ratios)


def _gpu_lines(args, cmd: str, eng, cases, med, ratios) -> list[str]:
  dev = jax.devices()[0]
  lines = ["## Cost of --batch-invariant on a GPU\n",
           f"Command: `{cmd} --write`  ", f"Machine: {report.machine()}, "
           f"{getattr(dev, 'device_kind', dev.platform)}  ", f"Date: {report.stamp()}\n",
           f"`{os.path.basename(eng.path)}`, every weight on the device; one set of weights, "
           "two tuning rows in one process, the arms alternating within each repeat. "
           "\"default\": the GPU's row (prefill products staged in bf16 from 16 rows, grouped "
           "experts from 256 slots, the chunked DeltaNet form and XLA's attention for a "
           "prompt); \"invariant\": --batch-invariant's (the decode kernels at every length: "
           "matvec and per-slot experts, the fused DeltaNet and attention steps token by "
           "token, the attention's splits fixed). Decode: "
           f"{args.steps} steps of 1 and 8 rows (Engine's decode_fn); prefill: Engine.prefill "
           f"of a prompt. Medians of {args.repeats} repeats after a compiling one; the ratio is "
           "the median of each repeat's adjacent pair (its range beside it).\n",
           "| case | default tok/s | invariant tok/s | invariant / default (range) |",
           "|---|---|---|---|"]
  return lines + _table(GPU_ARMS, cases, med, ratios)


def _table(arms, cases, med, ratios) -> list[str]:
  """A row per case: both arms' median rates, and the median of the after / before ratios."""
  rows = []
  for kind, n in cases:
    a, b = med[(arms[0], (kind, n))], med[(arms[1], (kind, n))]
    r = ratios[(kind, n)]
    what = f"decode, {n} row{'s' if n > 1 else ''}" if kind == "decode" else f"prefill, {n} tokens"
    rows.append(f"| {what} | {a:.1f} | {b:.1f} | {statistics.median(r):.3f} "
                f"({min(r):.2f}-{max(r):.2f}) |")
  return rows


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  raise SystemExit(cli())
