"""Bazel py_test guard: `jaxvt` comes from the test's runfiles tree, in the test and in its children.

//tools/bazel:jaxvt_tree_guard puts this directory on PYTHONPATH, so Python imports this module at
start-up, after the site-packages .pth files ran. Those may point `jaxvt` somewhere else: an
editable pip install (scikit-build-core's `_editable_skbc_jaxvt` meta-path finder maps `jaxvt` to
the source checkout and its own build of the extension) or a .pth line that adds a checkout to
sys.path. Both would win over the runfiles tree; they are dropped from this interpreter, and
nothing else is changed. Subprocesses (e.g. tests/test_errors.py running `python -m jaxvt.run`)
inherit PYTHONPATH and so get the same guard. A sitecustomize module further down sys.path, if
any, still runs.
"""

import importlib.util
import os
import sys


def _finder_module(finder) -> str:
  cls = finder if isinstance(finder, type) else type(finder)
  return getattr(cls, "__module__", "") or ""


def _foreign_jaxvt_finder(finder) -> bool:
  mod = _finder_module(finder)
  return "jaxvt" in mod and "editable" in mod  # _editable_skbc_jaxvt, __editable___jaxvt_*_finder


def _guard() -> None:
  here = os.path.dirname(os.path.abspath(__file__))  # <runfiles>/<workspace>/tools/bazel
  root = os.path.dirname(os.path.dirname(here))  # <runfiles>/<workspace>
  if not os.path.isfile(os.path.join(root, "jaxvt", "__init__.py")):
    return  # not in a runfiles tree holding jaxvt: leave the interpreter alone
  sys.meta_path[:] = [f for f in sys.meta_path if not _foreign_jaxvt_finder(f)]
  sys.path[:] = [p for p in sys.path
                 if os.path.abspath(p or os.curdir) == root
                 or not os.path.isfile(os.path.join(p or os.curdir, "jaxvt", "__init__.py"))]
  for name in [n for n in sys.modules if n == "jaxvt" or n.startswith("jaxvt.")]:
    del sys.modules[name]  # imported by a .pth from elsewhere: forget it


def _chain() -> None:
  me = os.path.realpath(__file__)
  for p in sys.path:
    other = os.path.join(p or os.curdir, "sitecustomize.py")
    if os.path.isfile(other) and os.path.realpath(other) != me:
      spec = importlib.util.spec_from_file_location("_sitecustomize_next", other)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      return


_guard()
_chain()
