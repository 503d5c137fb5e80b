"""python -m jaxvt.bench {cpu,tier,offload,mesh,profile,determinism} [options]: benchmarks that
write docs/BENCHMARKS.md.

Each subcommand's module is imported once it is chosen, so a bad option is reported before JAX
starts.
"""

from __future__ import annotations

import argparse
import sys

from jaxvt.errors import JaxvtError


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jaxvt.bench")
  sub = ap.add_subparsers(dest="which", required=True)
  c = sub.add_parser("cpu", help="jaxvt vs llama.cpp on the default model (CPU)")
  c.add_argument("--decode-tokens", type=int, default=64)
  c.add_argument("--repeats", type=int, default=3)
  c.add_argument("--threads", type=int, default=2)
  t = sub.add_parser("tier", help="host-tier read rate vs the link (GPU; CPU runs it too)")
  t.add_argument("--total-mib", type=int, default=256)
  t.add_argument("--grid", action="store_true", help="kernel-alone grid-size probe (GPU)")
  t.add_argument("--kinds", action="store_true", help="host memory kinds probe (GPU)")
  t.add_argument("--products", nargs="?", const="all", default=None,
                 choices=("all", "dense", "experts"),
                 help="in place / tiled / staged products by rows (layers.Products' crossovers)")
  o = sub.add_parser("offload", help="Qwen3.6-35B-A3B-shaped sweep in an emulated 16 GiB GPU")
  o.add_argument("--model", default="/tmp/jaxvt-qwen36-35b-a3b-shape.gguf")
  o.add_argument("--prompt", type=int, default=512)
  o.add_argument("--gen", type=int, default=128)
  o.add_argument("--time-limit", type=int, default=540)
  o.add_argument("--device-gb", type=float, default=16.0, help="the emulated card's GiB")
  o.add_argument("--llama-bench", default=None,
                 help="llama-bench binary (default: /tmp/llama-build/bin/llama-bench if built)")
  o.add_argument("--child", default=None, help=argparse.SUPPRESS)
  o.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
  o.add_argument("--points", default=None, help=argparse.SUPPRESS)
  o.add_argument("--after", default="", help=argparse.SUPPRESS)
  m = sub.add_parser("mesh", help="tp=2 vs one device, with and without offload (2 GPUs)")
  m.add_argument("--model", default="/tmp/jaxvt-qwen36-35b-a3b-shape.gguf")
  m.add_argument("--meshes", default="1,tp=2",
                 help="comma list; 1 = one device, no mesh; join two axes with +: tp=2+ep=2")
  m.add_argument("--budgets", default="0,auto,all",
                 help="comma list of per-device offload GiB, auto, all (every offloadable weight)")
  m.add_argument("--device-gb", type=float, default=None,
                 help="emulate a card of this many GiB per device (XLA pool cap + planner)")
  m.add_argument("--prompt", type=int, default=512)
  m.add_argument("--gen", type=int, default=128)
  m.add_argument("--time-limit", type=int, default=480)
  m.add_argument("--out", default="docs/BENCHMARKS.md", help="the file whose mesh section to write")
  m.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  m.add_argument("--known", default="{}", help=argparse.SUPPRESS)
  f = sub.add_parser("profile", help="where a decode step's device time goes (jax.profiler)")
  f.add_argument("--model", default=None)
  f.add_argument("--offload-gb", type=float, default=0.0)
  f.add_argument("--device-gb", type=float, default=None)
  f.add_argument("--prompt", type=int, default=32)
  f.add_argument("--steps", type=int, default=8)
  f.add_argument("--top", type=int, default=25)
  f.add_argument("--mesh", default=None, help="shard over local devices, as jaxvt.run --mesh")
  f.add_argument("--prefill", action="store_true", help="profile one prefill of the prompt")
  f.add_argument("--predict", default=None,
                 help="H:D[:S]: Products.predict_after_host, predict_after_device (predict_sets)")
  d = sub.add_parser("determinism", help="same tokens across processes and budgets; its cost")
  d.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
  d.add_argument("--configs", default="0,all,auto",
                 help="comma list of BUDGET[@DEVICE_GB] (GiB, auto or all); the first runs twice")
  d.add_argument("--tokens", type=int, default=128)
  d.add_argument("--max-context", type=int, default=2048)
  d.add_argument("--temperature", type=float, default=0.8)
  d.add_argument("--seed", type=int, default=7)
  d.add_argument("--nondeterministic", action="store_true",
                 help="compare with XLA's default (autotuned) algorithm choices")
  d.add_argument("--prompt", type=int, default=512, help="cost: prompt tokens")
  d.add_argument("--repeats", type=int, default=3, help="cost: timed generates per setting")
  d.add_argument("--cost-budget", default="0", help="cost: the offload budget (GiB, auto, all)")
  d.add_argument("--device-gb", type=float, default=None, help="cost: as jaxvt.run --device-gb")
  d.add_argument("--compare-only", action="store_true")
  d.add_argument("--cost-only", action="store_true")
  d.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
  d.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.which == "cpu":
    from jaxvt.bench import cpu
    print(cpu.main(args))
  elif args.which == "offload":
    from jaxvt.bench import offload
    if args.child:
      offload.child(args)
    else:
      print(offload.main(args))
  elif args.which == "mesh":
    from jaxvt.bench import mesh
    try:
      if args.child is not None:
        mesh.child(args)
      else:
        print(mesh.main(args))
    except JaxvtError as e:
      print(f"jaxvt: error: {e}", file=sys.stderr)
      return e.exit_code
  elif args.which == "profile":
    from jaxvt.bench import profile
    print(profile.main(args))
  elif args.which == "determinism":
    from jaxvt.bench import determinism
    print(determinism.main(args))
  elif args.which == "tier":
    from jaxvt.bench import tier
    print(tier.main(args))
  return 0


if __name__ == "__main__":
  sys.exit(main())
