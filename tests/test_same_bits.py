"""tools/same_bits.py, which holds a matvec kernel change to the bits of the build before it: its
comparison catches any differing bit (a -0 against a +0 too) and any output one side lacks, and
on the CPU it exits 2 with one line saying it needs a GPU build."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "same_bits.py")
_spec = importlib.util.spec_from_file_location("same_bits", TOOL)
same_bits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(same_bits)


def _outputs(rng):
  return {f"k{i}": rng.standard_normal((3, 7)).astype(np.float32) for i in range(4)}


def test_identical_outputs_do_not_differ():
  a = _outputs(np.random.default_rng(0))
  b = {k: v.copy() for k, v in a.items()}
  nan = np.full((2, 2), np.nan, np.float32)
  a["nan"], b["nan"] = nan, nan.copy()  # the same NaN bits
  assert same_bits.differing(a, b) == []


def test_any_bit_a_sign_of_zero_or_a_missing_output_differs():
  a = _outputs(np.random.default_rng(1))
  flipped = {k: v.copy() for k, v in a.items()}
  flipped["k2"].view(np.uint32)[1, 3] ^= 1  # one ulp
  assert same_bits.differing(flipped, a) == ["k2"]
  zeros = dict(a, k0=np.zeros((3, 7), np.float32))
  negzeros = dict(a, k0=-np.zeros((3, 7), np.float32))
  assert same_bits.differing(zeros, negzeros) == ["k0"]
  fewer = {k: v for k, v in a.items() if k != "k3"}
  assert same_bits.differing(fewer, a) == ["k3"] and same_bits.differing(a, fewer) == ["k3"]
  assert same_bits.differing(dict(a, k1=a["k1"][:2]), a) == ["k1"]


def test_the_recorded_rows_cover_a_partial_last_item():
  # rows whose length is not a multiple of 256: the quantization's last item of 8 elements a lane
  # is cut short
  assert any(cols % 256 for _, _, cols in same_bits.SHAPES)
  x = same_bits.activations(np.random.default_rng(2), 3, 576)
  assert x.flags.c_contiguous and x.dtype == np.float32 and (x[1, :64] == 0).all()


def test_weights_are_whole_blocks_with_finite_scales():
  from jaxvt.gguf.formats import FORMATS

  for name, rows, cols in same_bits.SHAPES[:9]:
    f = next(f for f in FORMATS.values() if f.name == name)
    raw = same_bits.weights(np.random.default_rng(3), name, 4, cols)
    assert raw.shape == (4 * cols // f.block_elems * f.block_bytes,)
    blocks = raw.reshape(-1, f.block_bytes)
    for off in same_bits.SCALE_AT[name]:
      d = blocks[:, off:off + 2].copy().view("<f2").astype(np.float32)
      assert np.isfinite(d).all() and (d >= 0.004).all() and (d <= 0.016).all(), name


def test_without_a_gpu_it_exits_2_with_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, TOOL, "check", os.devnull], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=300)
  assert done.returncode == 2
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("same_bits: ") and "GPU" in lines[0]
  usage = subprocess.run([sys.executable, TOOL], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
  assert usage.returncode == 2 and usage.stderr.startswith("usage:")
