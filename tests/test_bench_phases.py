"""benchmarks.phases reads the phase stamps a -DJAXVT_MV_PHASES=1 build prints: lines grouped by
shape and grid, launches split by their start times, the warm-up ones left out, the median per block."""

from __future__ import annotations

import statistics

from benchmarks.phases import PHASES, WARMUP, summarize


def _line(rows, cols, blk, grid, g0, gdur, stamps):
  return (f"TR rows {rows} cols {cols} blk {blk}/{grid} sm 3 g0 {g0} gdur {gdur} c: "
          + " ".join(f"{n} {v}" for n, v in zip(PHASES, stamps)))


def test_medians_per_block_leave_out_the_warmup_launches():
  lines, want = [], {}
  for launch in range(10):
    g0 = 1_000_000 + launch * 100_000  # launches 100 us apart, a launch's blocks within 1 us
    for blk in (0, 255):
      stamps = [launch * 10 + blk + k for k in range(len(PHASES))]
      lines.append(_line(2048, 512, blk, 256, g0 + blk, 3000 + launch, stamps))
      if launch >= WARMUP:
        want.setdefault(blk, []).append(stamps)
  lines.append("some other output")
  rows = summarize("\n".join(reversed(lines)))  # the order printed does not matter
  assert rows[0].startswith("| matrix | grid | block | kernel ns |") and len(rows) == 4
  for row, blk in zip(rows[2:], (0, 255)):
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["2048x512", "256", str(blk)]
    assert cells[3] == f"{statistics.median(3000 + l for l in range(WARMUP, 10)):.0f}"
    med = [statistics.median(s[k] for s in want[blk]) for k in range(len(PHASES))]
    assert cells[4:] == [f"{m:.0f}" for m in med]


def test_no_stamps_no_rows():
  assert len(summarize("TR garbage\nnothing here")) == 2
