"""Session setup: jaxvt's caches live in directories of this test session (shared by the tests
and the CLI processes they start, removed at the end), not in the user's ~/.cache/jaxvt, so that
every run of the suite starts from nothing, as on a fresh machine: JAX's persistent compilation
cache (a JAXVT_COMPILE_CACHE set by the caller is left as it is) and, through XDG_CACHE_HOME,
the host-link rates `python -m jaxvt.offload.probe` caches, which `--plan` would otherwise
print from the user's last probe."""

import os
import shutil
import tempfile


def pytest_configure(config):
  if "JAXVT_COMPILE_CACHE" not in os.environ:
    path = tempfile.mkdtemp(prefix="jaxvt-test-cache-")
    os.environ["JAXVT_COMPILE_CACHE"] = path
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
  xdg = tempfile.mkdtemp(prefix="jaxvt-test-xdg-cache-")
  os.environ["XDG_CACHE_HOME"] = xdg
  config.add_cleanup(lambda: shutil.rmtree(xdg, ignore_errors=True))
