"""What every `python -m benchmarks.<name>` entry shares: its parser (`parser_of`), running its
`main(args)` with the product's error convention (or, in a child process of a benchmark that
runs its points one process each, its `child(args)`), and the environment of the child processes
a benchmark starts.

Nothing here imports JAX, so `python -m benchmarks` lists the benchmarks without starting it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from jaxvt import JaxvtError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (benchmarks/..)


def parser_of(name: str, doc: str, child: type | None = None) -> argparse.ArgumentParser:
  """The parser of `python -m benchmarks.<name>`: that prog, the first line of the module's
  docstring `doc` as its description; with `child` (the type of its value), the hidden `--child`
  option of a benchmark that starts itself once per point (see `run`)."""
  ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}",
                               description=doc.splitlines()[0])
  if child is not None:
    ap.add_argument("--child", type=child, default=None, help=argparse.SUPPRESS)
  return ap


def run(main: Callable[[argparse.Namespace], str | None], parser: argparse.ArgumentParser,
        argv: list[str] | None = None,
        child: Callable[[argparse.Namespace], None] | None = None) -> int:
  """Parses `argv`, runs `main(args)` and prints what it returns; with `child` and a `--child`
  given, `child(args)` instead (one point in this process, which prints its own lines). A
  JaxvtError (something the user can fix: a bad file, a mesh larger than the devices) is one
  line on stderr and its exit status, as `python -m jaxvt.run` reports it."""
  args = parser.parse_args(argv)
  try:
    out = main(args) if child is None or args.child is None else child(args)
  except JaxvtError as e:
    print(f"jaxvt: error: {e}", file=sys.stderr)
    return e.exit_code
  if out:
    print(out)
  return 0


def child_env(extra: dict | None = None) -> dict:
  """os.environ with `extra`, and the repository root first on PYTHONPATH: a child started as
  `python -m benchmarks.<name>` finds the benchmarks from any working directory."""
  env = dict(os.environ, **(extra or {}))
  path = env.get("PYTHONPATH", "")
  env["PYTHONPATH"] = ROOT + (os.pathsep + path if path else "")
  return env
