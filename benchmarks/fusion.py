"""python -m benchmarks.fusion: a fused step on and off, side by side in one process: --field
fused_norm (the residual add, RMSNorm and the shared expert's gate in one custom call) or
fused_swiglu (silu(g) * u formed inside the down products); --products FIELD=VALUE,... sets other
fields of the tuning row in both arms.

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
from benchmarks.profile import products_exec

ARMS = ("off", "on")
ROWS = (1, 8)
PROMPTS = (512,)
# field -> (BENCHMARKS.md section, its title, what the fused step does)
FIELDS = {
    "fused_norm": ("fused-norm", "The residual stream in one call (Products.fused_norm)",
                   "`jaxvt.ffi.norm.add_norm` takes a block boundary's residual add (a MoE's k "
                   "weighted routed outputs and its gated shared expert), RMSNorm and the shared "
                   "expert's gate logit in one custom call."),
    "fused_swiglu": ("fused-swiglu", "swiglu inside the down products (Products.fused_swiglu)",
                     "The down products (routed experts, shared expert, dense FFN) form "
                     "silu(g) * u from the gate and up products as they read their input "
                     "(`ops.qmatmul(..., up=)`), instead of a step of its own."),
}


def parser():
  ap = parser_of("fusion", __doc__)
  ap.add_argument("--steps", type=int, default=8, help="decode steps per timed program")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--model", default=None,
                  help="GGUF file; 'offload': benchmarks.offload's 35B-shaped file (written if "
                       "missing); default: the embedded model")
  ap.add_argument("--field", default="fused_norm", choices=sorted(FIELDS))
  ap.add_argument("--products", default=None,
                  help="FIELD=VALUE,... of the tuning row in both arms (benchmarks.profile's)")
  ap.add_argument("--write", action="store_true", help="write its section of BENCHMARKS.md")
  return ap


def _engines(model: str | None, field: str, products: str | None) -> dict:
  if model == "offload":
    from benchmarks.offload import MODEL, ensure_model
    ensure_model(MODEL, print)
    model = MODEL
  eng = jaxvt.load(model, max_context=2048)
  ex = products_exec(eng.ex, products) if products else eng.ex
  row = lambda on: dataclasses.replace(ex, products=dataclasses.replace(ex.products,
                                                                        **{field: on}))
  return {"off": dataclasses.replace(eng, ex=row(False)),
          "on": dataclasses.replace(eng, ex=row(True))}


def main(args) -> str:
  engines = _engines(args.model, args.field, args.products)
  cases = [("decode", r) for r in ROWS] + [("prefill", n) for n in PROMPTS]
  med, ratios = alternate(engines, ARMS, cases, args.steps, args.repeats)
  eng, dev = engines["on"], jax.devices()[0]
  section, title, what = FIELDS[args.field]
  cmd = (f"python -m benchmarks.fusion --field {args.field} --steps {args.steps} "
         f"--repeats {args.repeats}" + (f" --model {args.model}" if args.model else "")
         + (f" --products {args.products}" if args.products else ""))
  lines = [f"## {title}, on and off\n",
           f"Command: `{cmd}`  ",
           f"Machine: {report.machine()}, {getattr(dev, 'device_kind', dev.platform)}  ",
           f"Date: {report.stamp()}\n",
           f"`{os.path.basename(eng.path)}`, every weight on the device; one set of weights, "
           f"the platform's tuning row{' (' + args.products + ')' if args.products else ''} "
           f"with `{args.field}` off and on, the arms alternating within each repeat. {what} "
           f"Decode: {args.steps} steps of 1 and 8 rows "
           "(the engine's decode_fn); prefill: Engine.prefill of a prompt. Medians of "
           f"{args.repeats} repeats after a compiling one; the ratio is the median of each "
           "repeat's adjacent pair (its range beside it).\n",
           "| case | off tok/s | on tok/s | on / off (range) |", "|---|---|---|---|"]
  lines += _table(ARMS, cases, med, ratios)
  eng.close()  # the other arm shares its weights
  return report.publish(section, lines, write=args.write)


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  raise SystemExit(cli())
