"""Does a matvec kernel change keep every output bit? Run once on the build before the change
(write), once on the build after it (check), on the same GPU:

  python tools/same_bits.py write /tmp/bits.npz   # with the earlier build's extension in place
  python tools/same_bits.py check /tmp/bits.npz   # with the new one: prints the outputs that differ

It records the matvec kernel's outputs under ggml's arithmetic (the debug module's
matvec_outputs) for this model family's shapes and rows whose length is not a multiple of 256
(a partial last item of the activations' quantization), at 1, 3 and 8 activation rows, through
every path a row can take: the bulk-copy stages and the per-warp windows, either tier, the
launch's grid and a grid of three blocks. The kernel's tests hold each output to a tolerance of
ggml's recipe and the paths to each other; this holds a change that should not move the
arithmetic to the bits of the build before it. `bash tools/gpu_session.sh ab` runs it between a
carried earlier build and this one. Exit status 1 when any output differs, 2 on a usage error or
without a GPU build.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (format name, rows, cols)
SHAPES = [("Q4_K", 512, 2048), ("Q6_K", 2048, 512), ("Q4_K", 2048, 512), ("Q6_K", 1001, 2048),
          ("Q8_0", 777, 1024), ("Q4_0", 300, 4096), ("Q4_1", 64, 2048), ("Q5_K", 513, 2048),
          ("Q6_K", 96, 14336), ("Q6_K", 2048, 4096), ("Q4_K", 8192, 2048),
          ("Q8_0", 100, 96), ("Q4_0", 50, 576), ("Q4_1", 300, 576), ("Q4_1", 64, 2080),
          ("Q8_0", 33, 4128)]
BATCHES = (1, 3, 8)
# Where each format's f16 scales sit in its block (ggml's layouts): set to sane finite values.
SCALE_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
            "Q6_K": (208,)}


def weights(rng: np.random.Generator, name: str, rows: int, cols: int) -> np.ndarray:
  """uint8 [rows * row bytes]: random quants, f16 scales in [0.005, 0.015)."""
  from jaxvt.gguf.formats import FORMATS

  f = next(f for f in FORMATS.values() if f.name == name)
  nb = rows * cols // f.block_elems
  raw = rng.integers(0, 256, (nb, f.block_bytes), dtype=np.uint8)
  for off in SCALE_AT[name]:
    raw[:, off:off + 2] = (rng.uniform(0.5, 1.5, nb) * 0.01).astype("<f2").view(np.uint8).reshape(
        nb, 2)
  return np.ascontiguousarray(raw.reshape(-1))


def activations(rng: np.random.Generator, batch: int, cols: int) -> np.ndarray:
  """Random rows, one with a small-valued stretch and one with zero units (d = 0)."""
  x = rng.standard_normal((batch, cols)).astype(np.float32)
  x[0, :cols // 3] *= 1e-3
  if batch > 1:
    x[1, :64] = 0.0
  return np.ascontiguousarray(x)


def outputs(dbg) -> dict[str, np.ndarray]:
  """Every shape, batch and path's output rows, by a key naming them."""
  from jaxvt.gguf.formats import FORMATS

  by_name = {f.name: code for code, f in FORMATS.items()}
  res = {}
  for name, rows, cols in SHAPES:
    fmt = by_name[name]
    raw = weights(np.random.default_rng(rows * 31 + cols), name, rows, cols)
    for batch in BATCHES:
      x = activations(np.random.default_rng(rows + cols * 7 + batch), batch, cols)
      for bulk in (-1, 0):
        for tier in (True, False):
          for cap in (0, 3):
            y = np.full((batch, rows), np.nan, np.float32)
            dbg.matvec_outputs(fmt, rows, cols, batch, raw.ctypes.data, x.ctypes.data,
                               y.ctypes.data, device_tier=tier, bulk=bulk, grid_cap=cap)
            res[f"{name} {rows}x{cols} rows {batch} bulk {bulk} device {tier} grid {cap}"] = y
  return res


def differing(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[str]:
  """Keys whose arrays differ in any bit (a -0 against a +0 included), or are in one dict only."""
  keys = sorted(set(got) | set(want))
  return [k for k in keys if k not in got or k not in want or got[k].shape != want[k].shape
          or not np.array_equal(np.asarray(got[k]).view(np.uint32),
                                np.asarray(want[k]).view(np.uint32))]


def main(argv: list[str]) -> int:
  if len(argv) != 2 or argv[0] not in ("write", "check"):
    print("usage: python tools/same_bits.py write|check FILE.npz", file=sys.stderr)
    return 2
  mode, path = argv
  if mode == "check" and not os.path.exists(path):  # before the kernels run
    print(f"same_bits: {path} not found: write it first with the earlier build", file=sys.stderr)
    return 2
  from jaxvt import ffi

  dbg = ffi.debug_extension()
  gpu = "run it on a GPU host with the CUDA or HIP build"
  if dbg is None:
    print(f"same_bits: jaxvt was installed without its debug module: {gpu}", file=sys.stderr)
    return 2
  try:
    res = outputs(dbg)
  except RuntimeError as e:  # the CPU build's probes: "needs a GPU build and a GPU"
    print(f"same_bits: {e}: {gpu}", file=sys.stderr)
    return 2
  if mode == "write":
    np.savez(path, **res)
    print(f"wrote {len(res)} outputs to {path}")
    return 0
  with np.load(path) as f:
    want = {k: f[k] for k in f.files}
  bad = differing(res, want)
  print(f"{len(bad)} of {len(set(res) | set(want))} outputs differ from {path}")
  for k in bad[:20]:
    print("  " + k)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
