"""Main of jaxvt's Bazel py_test targets: runs pytest on the test files given as arguments.

Bazel runs a test with its working directory at the main repository's root inside the test's
runfiles tree, so `jaxvt` is imported from the Bazel-built tree (the py_library's sources and the
cc_binary extension `jaxvt/ffi/_jaxvt_ffi.so`), never from the source checkout or a pip install;
this is checked before pytest starts. pytest reads the repository's pyproject.toml ([tool.pytest],
i.e. the markers, `-m 'not gpu'` and the timeout) exactly as `pytest` at the top level does.
Third-party packages (jax, numpy, gguf, pytest, hypothesis ...) come from the interpreter's
site-packages (the @local_python toolchain).
"""

from __future__ import annotations

import importlib.util
import os
import sys


def _fail(msg: str) -> None:
  print(f"pytest_main: {msg}", file=sys.stderr)
  sys.exit(3)


def _check_tree(root: str, when: str) -> None:
  """Fails unless jaxvt and its extension resolve to (or were imported from) the runfiles tree.

  Before pytest runs nothing is imported: jaxvt is only located (importlib.util.find_spec), since
  importing the extension here would change what tests that monkeypatch sys.modules see. After
  pytest, the modules the tests actually used are checked.
  """
  want_pkg = os.path.join(root, "jaxvt", "__init__.py")
  want_so = os.path.join(root, "jaxvt", "ffi", "_jaxvt_ffi.so")
  if when == "before":
    spec = importlib.util.find_spec("jaxvt")
    pkg = os.path.abspath(spec.origin) if spec and spec.origin else None
    if not os.path.isfile(want_so):
      _fail(f"the Bazel-built extension {want_so} is missing")
    others = [f for f in os.listdir(os.path.dirname(want_so)) if f.startswith("_jaxvt_ffi")]
    if others != ["_jaxvt_ffi.so"]:
      _fail(f"unexpected extension files next to the Bazel-built one: {others}")
    so = want_so
  else:
    mod = sys.modules.get("jaxvt")
    pkg = os.path.abspath(mod.__file__) if mod is not None else want_pkg
    ext = sys.modules.get("jaxvt.ffi._jaxvt_ffi")
    so = os.path.abspath(ext.__file__) if getattr(ext, "__file__", None) else None
  if pkg != want_pkg:
    _fail(f"jaxvt resolves to {pkg}, not to the Bazel runfiles tree {root} (sys.path: {sys.path})")
  if so is not None and so != want_so:
    _fail(f"jaxvt.ffi._jaxvt_ffi was imported from {so}, not from {want_so}")
  if so is not None:
    so = f"{so} -> {os.path.realpath(so)}"
  print(f"pytest_main ({when} pytest): jaxvt {pkg}; extension {so or 'not imported'}", flush=True)


def main(argv: list[str]) -> int:
  root = os.getcwd()
  if not os.path.isfile(os.path.join(root, "pyproject.toml")):
    _fail(f"run me from a Bazel test (no pyproject.toml in the working directory {root})")
  tmp = os.environ.get("TEST_TMPDIR")
  if tmp:
    # Hypothesis keeps its example database under the working directory by default; the runfiles
    # tree is not ours to write into.
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tmp, "hypothesis"))
  _check_tree(root, "before")

  import pytest

  args = ["-c", os.path.join(root, "pyproject.toml"), "--rootdir", root, "-rfEs"]
  xml = os.environ.get("XML_OUTPUT_FILE")
  if xml:
    args += ["--junitxml", xml]
  status = pytest.main(args + argv)
  _check_tree(root, "after")
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
