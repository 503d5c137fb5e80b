"""Where the tile kernels (jaxvt.ffi.grouped: qmatmul_tiled, qmatmul_grouped) go wrong, if they do:
python tools/grouped_diag.py [--platform gpu|cpu]

For each format and slot count, runs the kernel on the platform's first device and compares it
with float64 numpy on the bf16-rounded operands (gguf's dequantizer; the bound of
tests/test_grouped.py, widened 4x for tensor cores). For a case outside the bound it prints which
slots and which weight rows are wrong (by their place in the kernel's 32-slot x 64-row tile and
its 16 x 16 tensor-core pieces), how wrong, and whether a wrong output equals the reference of
another slot or row (a layout mix-up rather than bad arithmetic). Exit status 1 if any case is
outside the bound.
"""

from __future__ import annotations

import argparse
import sys

import gguf
import jax
import ml_dtypes
import numpy as np

from jaxvt.bench import kernels as kb
from jaxvt.ffi import grouped as gops
from jaxvt.gguf.formats import F16, Q4_1, Q4_K, Q6_K, Q8_0

NAMES = {F16: "F16", Q8_0: "Q8_0", Q4_1: "Q4_1", Q4_K: "Q4_K", Q6_K: "Q6_K"}
ROWS, COLS, EXPERTS, TOP_K = 128, 512, 8, 2


def random_matrix(rng, fmt: int, rows: int, cols: int) -> np.ndarray:
  if fmt == F16:
    return (rng.standard_normal(rows * cols) * 0.02).astype("<f2").view(np.uint8)
  return kb.random_matrix(rng, fmt, rows, cols)


def bf16(a) -> np.ndarray:
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def ranges(idx) -> str:
  """Sorted ints as 'a-b, c' runs."""
  idx = sorted(set(int(i) for i in idx))
  out, start = [], None
  for i, v in enumerate(idx):
    if start is None:
      start = v
    if i + 1 == len(idx) or idx[i + 1] != v + 1:
      out.append(f"{start}" if start == v else f"{start}-{v}")
      start = None
  return ", ".join(out) if out else "-"


def report(label: str, y: np.ndarray, want: np.ndarray, bound: np.ndarray) -> bool:
  """y, want, bound [slots, rows] (slots in the kernel's sorted order); True when within."""
  ratio = np.abs(y - want) / bound
  bad = ~(ratio <= 1.0)
  if not bad.any():
    print(f"{label}: ok (worst {np.nanmax(ratio):.3g}x of the bound)")
    return True
  slots, rows = np.nonzero(bad)
  print(f"{label}: {bad.sum()} of {bad.size} outside the bound (worst {np.nanmax(ratio):.3g}x); "
        f"NaN {int(np.isnan(y).sum())}, zero where the reference is not "
        f"{int(((y == 0) & (want != 0)).sum())}")
  rel = np.abs(y - want)[bad] / np.maximum(np.abs(want)[bad], 1e-30)
  print(f"  |error| / |reference| at the wrong outputs: median {np.median(rel):.3g}, "
        f"max {rel.max():.3g}")
  whole_slots = np.nonzero(bad.mean(1) > 0.5)[0]  # most of a slot's outputs wrong
  whole_rows = np.nonzero(bad.mean(0) > 0.5)[0]  # most of a weight row's outputs wrong
  if len(whole_slots):
    print(f"  mostly wrong slots: {ranges(whole_slots)} (within the 32-slot tile: "
          f"{ranges(whole_slots % 32)})")
  if len(whole_rows):
    print(f"  mostly wrong rows: {ranges(whole_rows)} (within the 64-row tile: "
          f"{ranges(whole_rows % 64)}; 16-row pieces {ranges((whole_rows % 64) // 16)})")
  rest = bad.copy()
  rest[whole_slots, :] = False
  rest[:, whole_rows] = False
  if rest.any():
    rs, rr = np.nonzero(rest)
    print(f"  scattered: {rest.sum()} outputs; slots {ranges(rs)} (in tile {ranges(rs % 32)}), "
          f"rows {ranges(rr)} (in tile {ranges(rr % 64)})")
  for s in whole_slots[:4]:  # a whole output row that belongs to another slot?
    other = [t for t in range(want.shape[0]) if t != s and np.allclose(
        y[s], want[t], rtol=0, atol=bound[t].max())]
    if other:
      print(f"  slot {s}'s output equals the reference of slot(s) {other[:4]}")
  for r in whole_rows[:4]:
    other = [q for q in range(want.shape[1]) if q != r and np.allclose(
        y[:, r], want[:, q], rtol=0, atol=bound[:, q].max())]
    if other:
      print(f"  row {r}'s outputs equal the reference of row(s) {other[:4]}")
  return False


def reference(x: np.ndarray, mats: np.ndarray, ulps: float = 4.0):
  """x [S, cols] (one per slot), mats [S, rows, cols] (each slot's matrix) -> y, bound [S, rows]."""
  xb = bf16(x)[:, None, :]
  wb = bf16(mats)
  y = (wb * xb).sum(-1)
  terms = (np.abs(wb) * np.abs(xb)).sum(-1)
  return y, ulps * COLS * 2.0 ** -24 * terms + 1e-30


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="tools/grouped_diag.py")
  ap.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
  a = ap.parse_args(argv)
  try:
    dev = jax.devices(a.platform)[0]
  except RuntimeError as e:
    raise SystemExit(f"no {a.platform} device: {e}")
  rng = np.random.default_rng(0)
  ok = True
  tiled = jax.jit(gops.qmatmul_tiled)
  grouped = jax.jit(gops.qmatmul_grouped)
  for fmt in (F16, Q8_0, Q4_1, Q4_K, Q6_K):
    t = gguf.GGMLQuantizationType(fmt)
    # Dense: one matrix, every slot (row of x) against it.
    raw = random_matrix(rng, fmt, ROWS, COLS)
    mat = np.asarray(gguf.quants.dequantize(raw.reshape(ROWS, -1), t), np.float32)
    w = kb.stack(raw, fmt, ROWS, COLS, 1, None, dev)
    for n in (1, 2, 7, 16, 17, 32, 33, 96):
      x = rng.standard_normal((n, COLS)).astype(np.float32)
      y = np.asarray(tiled(jax.device_put(x, dev), w, 0), np.float64)
      want, bound = reference(x, np.broadcast_to(mat, (n, ROWS, COLS)))
      ok &= report(f"tiled {NAMES[fmt]} x{n}", y, want, bound)
    # Grouped: EXPERTS matrices, TOP_K of them per token; compared slot by slot.
    raw = random_matrix(rng, fmt, EXPERTS * ROWS, COLS)
    mats = np.asarray(gguf.quants.dequantize(raw.reshape(EXPERTS * ROWS, -1), t),
                      np.float32).reshape(EXPERTS, ROWS, COLS)
    w = kb.stack(raw, fmt, ROWS, COLS, 1, None, dev, experts=EXPERTS)
    for n in (1, 5, 40):
      ids = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(n)]).astype(np.int32)
      x = rng.standard_normal((n, COLS)).astype(np.float32)
      y = np.asarray(grouped(jax.device_put(x, dev), w, 0, jax.device_put(ids, dev)), np.float64)
      order = np.argsort(ids.reshape(-1), kind="stable")  # the kernel's sorted slot order
      flat = ids.reshape(-1)
      want, bound = reference(np.repeat(x, TOP_K, 0)[order], mats[flat[order]])
      ok &= report(f"grouped {NAMES[fmt]} {n} tokens x top-{TOP_K} of {EXPERTS} (sorted slots)",
                   y.reshape(n * TOP_K, ROWS)[order], want, bound)
  print("all within the bound" if ok else "some cases outside the bound")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
