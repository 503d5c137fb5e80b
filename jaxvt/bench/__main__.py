"""python -m jaxvt.bench {cpu,tier,offload,profile} [options]: benchmarks that write docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import sys


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
  f = sub.add_parser("profile", help="where a decode step's device time goes (jax.profiler)")
  f.add_argument("--model", default=None)
  f.add_argument("--offload-gb", type=float, default=0.0)
  f.add_argument("--device-gb", type=float, default=None)
  f.add_argument("--prompt", type=int, default=32)
  f.add_argument("--steps", type=int, default=8)
  f.add_argument("--top", type=int, default=25)
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
  elif args.which == "profile":
    from jaxvt.bench import profile
    print(profile.main(args))
  elif args.which == "tier":
    from jaxvt.bench import tier
    print(tier.main(args))
  return 0


if __name__ == "__main__":
  sys.exit(main())
