"""Seconds from starting `python -m jaxvt.run ARGS` to its first generated text, cold and warm.

  python tools/first_token.py [--runs 3] [--cache DIR] -- [jaxvt.run flags ...]

Runs the CLI `--runs` times in a row with JAXVT_COMPILE_CACHE=DIR (default: a fresh temporary
directory, so the first run compiles everything and the later ones load from the cache), and
prints, per run, the time to the first byte on stdout (the first token), the total time, and
the CLI's own load / compile lines. `--no-cache` runs with the cache off (JAXVT_COMPILE_CACHE=0);
`--no-store` with XLA's cache but without jaxvt's export store (JAXVT_EXPORT_STORE=0,
jaxvt.exports): every program traced, as before the store existed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def run_once(args: list[str], env: dict) -> tuple[float, float, str]:
  """(seconds to the first stdout byte, total seconds, stderr) of one CLI run."""
  t0 = time.perf_counter()
  p = subprocess.Popen([sys.executable, "-m", "jaxvt.run", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=env)
  first = p.stdout.read(1)
  t_first = time.perf_counter() - t0
  rest, err = p.communicate()
  if p.returncode != 0 or not first:
    raise SystemExit(f"jaxvt.run exited {p.returncode}:\n{err.decode()}")
  return t_first, time.perf_counter() - t0, err.decode()


def main(argv: list[str]) -> int:
  if "--" in argv:
    i = argv.index("--")
    argv, cli = argv[:i], argv[i + 1:]
  else:
    cli = []
  ap = argparse.ArgumentParser(prog="tools/first_token.py")
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--cache", default=None, help="cache directory (default: a fresh temporary one)")
  ap.add_argument("--no-cache", action="store_true")
  ap.add_argument("--no-store", action="store_true")
  ap.add_argument("--stderr-dir", default=None,
                  help="write each run's stderr to DIR/run-N.txt (with JAX_LOG_COMPILES=1: what "
                       "each program cost)")
  a = ap.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="jaxvt-cache-") as tmp:
    env = dict(os.environ, JAXVT_COMPILE_CACHE="0" if a.no_cache else a.cache or tmp,
               JAXVT_EXPORT_STORE="0" if a.no_store else "1")
    first = None
    for i in range(a.runs):
      t, total, err = run_once(cli, env)
      first = first or t
      if a.stderr_dir:
        os.makedirs(a.stderr_dir, exist_ok=True)
        with open(os.path.join(a.stderr_dir, f"run-{i + 1}.txt"), "w") as f:
          f.write(err)
      lines = [l for l in err.splitlines() if l.startswith(("load ", "compile "))]
      print(f"run {i + 1}: first token {t:.2f} s ({100 * t / first:.0f}% of run 1), "
            f"total {total:.2f} s | " + " | ".join(" ".join(l.split()) for l in lines),
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
