"""How fast can the loader read a GGUF file from the page cache? (A probe for #16's first token.)

  python tools/read_probe.py FILE [--gib 8] [--threads 1,2,4,8,16]

Reads the first `--gib` GiB of FILE with pread in 64 MiB pieces, spread over T threads, into
pinned host-tier buffers (what the loader's staging path reads into) and into plain numpy memory
touched beforehand; prints GB/s per thread count, twice (the first pass may fetch pages from the
disk), and what the machine says about its page cache and memory limit.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import numpy as np

PIECE = 64 << 20


def read_pass(fd: int, total: int, threads: int, bufs: list[np.ndarray]) -> float:
  """GB/s of pread of [0, total) in PIECE pieces, piece i on thread i % threads into bufs[t]."""
  def work(t: int) -> None:
    view = memoryview(bufs[t]).cast("B")
    for off in range(t * PIECE, total, threads * PIECE):
      n = min(PIECE, total - off)
      got = 0
      while got < n:
        k = os.preadv(fd, [view[got:n]], off + got)
        if k <= 0:
          raise OSError("short read")
        got += k
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(threads) as ex:
    list(ex.map(work, range(threads)))
  return total / (time.perf_counter() - t0) / 1e9


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/read_probe.py")
  ap.add_argument("file")
  ap.add_argument("--gib", type=float, default=8)
  ap.add_argument("--threads", default="1,2,4,8,16")
  a = ap.parse_args(argv)
  total = min(int(a.gib * 2**30), os.path.getsize(a.file))
  counts = [int(t) for t in a.threads.split(",")]
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    if os.path.exists(path):
      print(f"{path}: {open(path).read().strip()}")
  info = dict(l.split(":", 1) for l in open("/proc/meminfo"))
  print("meminfo: " + ", ".join(f"{k} {info[k].strip()}" for k in ("MemTotal", "MemAvailable", "Cached")))
  print(f"cpus {os.cpu_count()}; {total / 2**30:.1f} GiB of {a.file}")
  from jaxvt.offload.host_tier import HostTier  # pylint: disable=import-outside-toplevel
  tier = HostTier()
  pinned = [tier.alloc(PIECE).array for _ in range(max(counts))]
  plain = [np.ones(PIECE, np.uint8) for _ in range(max(counts))]
  fd = os.open(a.file, os.O_RDONLY)
  for rep in (1, 2):
    for t in counts:
      p = read_pass(fd, total, t, pinned)
      q = read_pass(fd, total, t, plain)
      print(f"pass {rep} threads {t:2d}: pinned {p:6.2f} GB/s, plain {q:6.2f} GB/s", flush=True)
  os.close(fd)
  tier.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
