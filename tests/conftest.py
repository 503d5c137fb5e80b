"""Session setup: JAX's persistent compilation cache lives in a directory of this test session
(shared by the tests and the CLI processes they start, removed at the end), not in the user's
~/.cache/jaxvt, so that every run of the suite starts from nothing, as on a fresh machine.
A JAXVT_COMPILE_CACHE set by the caller is left as it is."""

import os
import shutil
import tempfile


def pytest_configure(config):
  if "JAXVT_COMPILE_CACHE" not in os.environ:
    path = tempfile.mkdtemp(prefix="jaxvt-test-cache-")
    os.environ["JAXVT_COMPILE_CACHE"] = path
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
