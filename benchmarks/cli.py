"""What every `python -m benchmarks.<name>` entry shares: running a benchmark's `main(args)` with
the product's error convention, and the environment of the child processes a benchmark starts.

Nothing here imports JAX, so `python -m benchmarks` lists the benchmarks without starting it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from jaxvt.errors import JaxvtError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (benchmarks/..)


def run(main: Callable[[argparse.Namespace], str | None], parser: argparse.ArgumentParser,
        argv: list[str] | None = None) -> int:
  """Parses `argv`, runs `main(args)` and prints what it returns. A JaxvtError (something the
  user can fix: a bad file, a mesh larger than the devices) is one line on stderr and its exit
  status, as `python -m jaxvt.run` reports it."""
  args = parser.parse_args(argv)
  try:
    out = main(args)
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
