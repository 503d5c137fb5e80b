"""python -m benchmarks.first_token: seconds from starting `python -m jaxvt.run` to its first
token, cold and from the caches.

  python -m benchmarks.first_token [--runs 3] [--cache DIR] [--write] -- [jaxvt.run flags ...]

Runs the CLI `--runs` times in a row with JAXVT_COMPILE_CACHE=DIR (default: a fresh temporary
directory, so the first run compiles everything and the later ones load from the cache), and
reports, per run, the time to the first byte on stdout (the first token), the total time, and
the CLI's own load / compile lines. `--no-cache` runs with the cache off (JAXVT_COMPILE_CACHE=0);
`--no-store` with XLA's cache but without jaxvt's export store (JAXVT_EXPORT_STORE=0,
jaxvt.exports). `--write` writes the `first-token-<platform>` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import jax

from benchmarks import report
from benchmarks.cli import parser_of, run


def parser() -> argparse.ArgumentParser:
  ap = parser_of("first_token", __doc__)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--cache", default=None, help="cache directory (default: a fresh temporary one)")
  ap.add_argument("--no-cache", action="store_true")
  ap.add_argument("--no-store", action="store_true")
  ap.add_argument("--stderr-dir", default=None,
                  help="write each run's stderr to DIR/run-N.txt (with JAX_LOG_COMPILES=1: what "
                       "each program cost)")
  ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
  return ap


def run_once(args: list[str], env: dict) -> tuple[float, float, str]:
  """(seconds to the first stdout byte, total seconds, stderr) of one CLI run."""
  t0 = time.perf_counter()
  p = subprocess.Popen([sys.executable, "-m", "jaxvt.run", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=env)
  first = p.stdout.read(1)
  t_first = time.perf_counter() - t0
  _, err = p.communicate()
  if p.returncode != 0 or not first:
    raise SystemExit(f"jaxvt.run exited {p.returncode}:\n{err.decode()}")
  return t_first, time.perf_counter() - t0, err.decode()


def main(args) -> str:
  rows = []
  with tempfile.TemporaryDirectory(prefix="jaxvt-cache-") as tmp:
    env = dict(os.environ, JAXVT_COMPILE_CACHE="0" if args.no_cache else args.cache or tmp,
               JAXVT_EXPORT_STORE="0" if args.no_store else "1")
    first = None
    for i in range(args.runs):
      t, total, err = run_once(args.cli, env)
      first = first or t
      if args.stderr_dir:
        os.makedirs(args.stderr_dir, exist_ok=True)
        with open(os.path.join(args.stderr_dir, f"run-{i + 1}.txt"), "w") as f:
          f.write(err)
      lines = [" ".join(l.split()) for l in err.splitlines() if l.startswith(("load ", "compile "))]
      rows.append((i + 1, t, total, " / ".join(lines)))
      print(f"run {i + 1}: first token {t:.2f} s ({100 * t / first:.0f}% of run 1), "
            f"total {total:.2f} s | " + " | ".join(lines), flush=True)
  if not args.write:
    return ""
  # the platform and machine lines start a backend in this process: only after the runs
  cache = "off" if args.no_cache else "on" + ("" if not args.no_store else ", export store off")
  cmd = f"python -m benchmarks.first_token --runs {args.runs} --write -- {' '.join(args.cli)}"
  out = [f"## First token, cold and from the caches ({jax.devices()[0].platform})\n",
         f"Command: `{cmd.strip()}`  ", f"Machine: {report.machine()}  ",
         f"Date: {report.stamp()}\n",
         f"Each run a fresh `python -m jaxvt.run` process; run 1 against an empty compilation "
         f"cache, later runs load from it (cache {cache}).\n",
         "| run | first token s | % of run 1 | whole run s | the CLI's load / compile lines |",
         "|---|---|---|---|---|"]
  out += [f"| {n} | {t:.2f} | {100 * t / rows[0][1]:.0f}% | {total:.2f} | {lines} |"
          for n, t, total, lines in rows]
  return report.publish(f"first-token-{jax.devices()[0].platform}", out)


def cli(argv: list[str] | None = None) -> int:
  """Options before `--` are this benchmark's; after it, `python -m jaxvt.run`'s."""
  argv = sys.argv[1:] if argv is None else list(argv)
  rest = []
  if "--" in argv:
    i = argv.index("--")
    argv, rest = argv[:i], argv[i + 1:]
  p = parser()
  p.set_defaults(cli=rest)
  return run(main, p, argv)


if __name__ == "__main__":
  sys.exit(cli())
