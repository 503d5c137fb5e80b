"""Where a one-row bulk-copy matvec launch spends its cycles, phase by phase (NVIDIA sm_90+).

  python -m benchmarks.phases      # needs the extension built with -DJAXVT_MV_PHASES=1

That build's qmatmul kernel records clock64() on thread 0 of each block as it reaches each phase
(matvec.cuh, matvec_bulk.cuh) and prints the stamps of five blocks per launch. This runs a few
launches of each of this model family's shapes (device tier, ggml's arithmetic, a traced layer
index as in the model) in a child process, whose device printf is its standard output, and
reports the median stamps per block, in cycles after the block's first instruction:

  res    the layer's address and format read (the layer index, then the layer tables)
  tma    the block's first two bulk copies requested
  pro    the activation row quantized in shared memory (hold_xq, ending in a block barrier)
  wait0  the first chunk's bytes in shared memory
  comp0  thread 0's warp done with the first chunk
  end    the block's last chunk done
  sync   a block barrier after it
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import subprocess
import sys

from benchmarks.cli import child_env, parser_of, run
from jaxvt import JaxvtError

SHAPES = [("Q6_K", 2048, 4096), ("Q6_K", 2048, 512), ("Q4_K", 512, 2048), ("Q6_K", 12352, 2048),
          ("Q4_K", 8192, 2048)]
LAUNCHES = 24  # per shape
WARMUP = 6  # launches of a shape left out (compiles, cold caches)
LINE = re.compile(r"TR rows (\d+) cols (\d+) blk (\d+)/(\d+) sm \d+ g0 (\d+) gdur (\d+) c: res "
                  r"(-?\d+) tma (-?\d+) pro (-?\d+) wait0 (-?\d+) comp0 (-?\d+) end (-?\d+) "
                  r"sync (-?\d+)")
PHASES = ("res", "tma", "pro", "wait0", "comp0", "end", "sync")


def run_launches() -> None:
  """The child: LAUNCHES jitted one-row products per shape, over 8 layers (a traced index)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.kernels import random_matrix, stack
  from jaxvt.ffi import ops
  from jaxvt.gguf.formats import FORMATS

  by_name = {f.name: code for code, f in FORMATS.items()}
  dev = jax.devices("gpu")[0]
  rng = np.random.default_rng(0)
  for name, rows, cols in SHAPES:
    fmt = by_name[name]
    w = stack(random_matrix(rng, fmt, rows, cols), fmt, rows, cols, 8, None, dev)
    x = jax.device_put(jnp.asarray(rng.standard_normal((1, cols)), jnp.float32), dev)
    f = jax.jit(lambda x, l, w=w: ops.qmatmul(x, w, l, "q8"))
    for i in range(LAUNCHES):
      f(x, jnp.int32(i % 8)).block_until_ready()


def summarize(text: str) -> list[str]:
  """Markdown rows: per shape and printed block, the median of each stamp over the launches."""
  recs = [tuple(int(v) for v in m.groups()) for m in map(LINE.match, text.splitlines()) if m]
  by_shape = collections.defaultdict(list)
  for r in recs:
    by_shape[(r[0], r[1], r[3])].append(r)
  out = ["| matrix | grid | block | kernel ns | " + " | ".join(PHASES) + " |",
         "|---|---|---|---|" + "---|" * len(PHASES)]
  for (rows, cols, grid), rs in by_shape.items():
    rs.sort(key=lambda r: r[4])
    launches, cur = [], [rs[0]]
    for r in rs[1:]:  # a launch's lines start within 40 us of each other
      if r[4] - cur[0][4] < 40_000:
        cur.append(r)
      else:
        launches.append(cur)
        cur = [r]
    launches.append(cur)
    for blk in sorted({r[2] for r in rs}):
      sel = [r for launch in launches[WARMUP:] for r in launch if r[2] == blk]
      if not sel:
        continue
      med = [statistics.median(r[6 + i] for r in sel) for i in range(len(PHASES))]
      out.append(f"| {rows}x{cols} | {grid} | {blk} | {statistics.median(r[5] for r in sel):.0f} | "
                 + " | ".join(f"{m:.0f}" for m in med) + " |")
  return out


def parser() -> argparse.ArgumentParser:
  return parser_of("phases", __doc__, child=str)


def child(args) -> None:
  run_launches()


def main(args) -> str:
  done = subprocess.run([sys.executable, "-m", "benchmarks.phases", "--child", "launches"],
                        capture_output=True, text=True, check=False, env=child_env())
  rows = summarize(done.stdout)
  if done.returncode != 0 or len(rows) <= 2:
    tail = done.stderr.strip().splitlines()
    raise JaxvtError("no phase stamps" + (f" ({tail[-1]})" if tail else "") + ": run it on a GPU "
                     "of compute capability 9.0 or later with the extension built with "
                     "-DJAXVT_MV_PHASES=1")
  return "\n".join(rows)


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv, child=child)


if __name__ == "__main__":
  sys.exit(cli())
