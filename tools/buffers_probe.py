"""The largest buffers of XLA's buffer assignment in a dump directory (a probe).

  XLA_FLAGS=--xla_dump_to=DIR python -m jaxvt.run ... --plan
  python tools/buffers_probe.py DIR [--match prefill] [--top 15]

For the largest *buffer-assignment.txt whose name contains --match: each allocation of the top
`--top` by size, with the HLO values it holds (names and shapes), so a program's workspace can be
read by what it is made of.
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/buffers_probe.py")
  ap.add_argument("dir")
  ap.add_argument("--match", default="prefill")
  ap.add_argument("--top", type=int, default=15)
  a = ap.parse_args(argv)
  files = [os.path.join(a.dir, f) for f in os.listdir(a.dir)
           if f.endswith("buffer-assignment.txt") and a.match in f]
  if not files:
    print(f"no *buffer-assignment.txt matching {a.match!r} in {a.dir}")
    return 1
  path = max(files, key=os.path.getsize)
  allocs, cur = [], None
  with open(path, encoding="utf-8", errors="replace") as f:
    for line in f:
      m = re.match(r"allocation (\d+): size (\d+)(.*)", line)
      if m:
        cur = [int(m.group(2)), m.group(1), m.group(3).strip()[:80], []]
        allocs.append(cur)
      elif cur is not None and line.strip().startswith("value:"):
        cur[3].append(line.strip()[7:160])
      elif not line.strip():
        cur = None
  allocs.sort(key=lambda x: -x[0])
  total = sum(x[0] for x in allocs)
  print(f"{os.path.basename(path)}: {len(allocs)} allocations, {total / 2**30:.2f} GiB")
  for size, idx, attrs, values in allocs[:a.top]:
    print(f"{size / 2**20:10.1f} MiB  allocation {idx} {attrs}")
    for v in values[:4]:
      print(f"              {v}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
