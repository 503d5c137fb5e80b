"""python -m benchmarks.fusion: a fused step on and off (Products.fused_norm, the residual add,
RMSNorm and the shared expert's gate in one custom call), side by side in one process.

One set of weights, two tuning rows: the platform's row with the field off ("off") and as it is
("on"). Decode: steps of 1 and 8 rows through the engine's decode program; prefill: a 512-token
prompt (Engine.prefill). The arms alternate within every repeat, so a machine shared with other
work disturbs both alike; medians and the median of the adjacent pairs' ratios are reported.
--model: a GGUF file (default: the embedded model; on a GPU, `offload` writes the
Qwen3.6-35B-A3B-shaped file of benchmarks.offload once and takes it). It writes its section of
docs/BENCHMARKS.md only with --write.
"""

from __future__ import annotations

import dataclasses
import os

import jax

import jaxvt
from benchmarks import report
from benchmarks.cli import parser_of, run
from benchmarks.invariance import _table, alternate

ARMS = ("off", "on")
ROWS = (1, 8)
PROMPTS = (512,)
FIELD = "fused_norm"


def parser():
  ap = parser_of("fusion", __doc__)
  ap.add_argument("--steps", type=int, default=8, help="decode steps per timed program")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--model", default=None,
                  help="GGUF file; 'offload': benchmarks.offload's 35B-shaped file (written if "
                       "missing); default: the embedded model")
  ap.add_argument("--write", action="store_true", help="write its section of BENCHMARKS.md")
  return ap


def _engines(model: str | None) -> dict:
  if model == "offload":
    from benchmarks.offload import MODEL, ensure_model
    ensure_model(MODEL, print)
    model = MODEL
  eng = jaxvt.load(model, max_context=2048)
  ex = eng.ex
  row = lambda on: dataclasses.replace(ex, products=dataclasses.replace(ex.products,
                                                                        **{FIELD: on}))
  return {"off": dataclasses.replace(eng, ex=row(False)),
          "on": dataclasses.replace(eng, ex=row(True))}


def main(args) -> str:
  engines = _engines(args.model)
  cases = [("decode", r) for r in ROWS] + [("prefill", n) for n in PROMPTS]
  med, ratios = alternate(engines, ARMS, cases, args.steps, args.repeats)
  eng, dev = engines["on"], jax.devices()[0]
  cmd = (f"python -m benchmarks.fusion --steps {args.steps} --repeats {args.repeats}"
         + (f" --model {args.model}" if args.model else ""))
  lines = ["## The residual stream in one call (Products.fused_norm), on and off\n",
           f"Command: `{cmd}`  ",
           f"Machine: {report.machine()}, {getattr(dev, 'device_kind', dev.platform)}  ",
           f"Date: {report.stamp()}\n",
           f"`{os.path.basename(eng.path)}`, every weight on the device; one set of weights, "
           f"the platform's tuning row with `{FIELD}` off and on, the arms alternating within "
           "each repeat. `jaxvt.ffi.norm.add_norm` takes a block boundary's residual add (a "
           "MoE's k weighted routed outputs and its gated shared expert), RMSNorm and the shared "
           f"expert's gate logit in one custom call. Decode: {args.steps} steps of 1 and 8 rows "
           "(the engine's decode_fn); prefill: Engine.prefill of a prompt. Medians of "
           f"{args.repeats} repeats after a compiling one; the ratio is the median of each "
           "repeat's adjacent pair (its range beside it).\n",
           "| case | off tok/s | on tok/s | on / off (range) |", "|---|---|---|---|"]
  lines += _table(ARMS, cases, med, ratios)
  eng.close()  # the other arm shares its weights
  return report.publish("fused-norm", lines, write=args.write)


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  raise SystemExit(cli())
