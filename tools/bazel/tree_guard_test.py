"""The Bazel py_tests use the Bazel-built jaxvt: in-process, in subprocesses, with the AVX2 unit."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.getcwd()  # Bazel runs tests at the main repository's root inside the runfiles tree
PKG = os.path.join(ROOT, "jaxvt", "__init__.py")
SO = os.path.join(ROOT, "jaxvt", "ffi", "_jaxvt_ffi.so")


def _cpu_flags() -> set[str]:
  try:
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


def test_in_process():
  import jaxvt
  from jaxvt.ffi import _jaxvt_ffi

  assert os.path.abspath(jaxvt.__file__) == PKG
  assert os.path.abspath(_jaxvt_ffi.__file__) == SO
  assert "/bazel-out/" in os.path.realpath(_jaxvt_ffi.__file__)  # the cc_binary's output


def test_subprocess(tmp_path):
  code = "import jaxvt, jaxvt.ffi._jaxvt_ffi as m; print(jaxvt.__file__); print(m.__file__)"
  p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                     check=True)
  assert [os.path.abspath(l) for l in p.stdout.split()] == [PKG, SO], p.stdout


def test_cpu_handlers_and_isa():
  from jaxvt import ffi
  from jaxvt.ffi import _jaxvt_ffi

  assert ffi.available("cpu")
  assert ffi.targets("cpu") == set(_jaxvt_ffi.registrations()["cpu"]) != set()
  if {"avx2", "fma", "f16c"} <= _cpu_flags():  # x86-64-v3: the AVX2 translation unit is linked in
    assert _jaxvt_ffi.cpu_isa() == "avx2"
