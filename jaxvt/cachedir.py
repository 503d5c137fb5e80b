"""Where jaxvt keeps files between runs (compiled programs, measured rates): one directory.

$XDG_CACHE_HOME/jaxvt, else ~/.cache/jaxvt. A process with no home directory (HOME unset and
no passwd entry for its uid, as in a container started with --user) gets "~" back from
os.path.expanduser, which would put the cache in ./~/.cache/jaxvt under whatever directory it
runs in; it uses a directory of its own under the system's temporary directory instead, and
says so once (a JaxvtWarning).

A directory under /tmp is shared with every user of the machine, and a cache of compiled
programs is code this process runs, so the per-user directory is used only if this uid owns it
and nobody else can write to it; otherwise a fresh private directory, removed when the process
exits.

This module imports nothing heavy (no JAX).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import stat
import tempfile
import warnings
from typing import Mapping

from jaxvt.errors import JaxvtWarning, escape


def default_root(env: Mapping[str, str] = os.environ) -> str:
  """$XDG_CACHE_HOME/jaxvt (an absolute XDG_CACHE_HOME, as the XDG spec reads it), or
  ~/.cache/jaxvt, or with no home directory a private directory under the temporary one."""
  xdg = env.get("XDG_CACHE_HOME") or ""
  if os.path.isabs(xdg):
    return os.path.join(xdg, "jaxvt")
  home = os.path.expanduser("~")
  if not os.path.isabs(home):  # no HOME and no passwd entry: expanduser gives "~" back
    return _homeless_root()
  return os.path.join(home, ".cache", "jaxvt")


def _private(path: str, uid: int) -> bool:
  """`path` is a directory (not a link) of `uid` that no other user can write to."""
  try:
    st = os.lstat(path)
  except OSError:
    return False
  return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022


@functools.cache
def _homeless_root() -> str:
  """<tmp>/jaxvt-cache-<uid> where it is this uid's own, else a fresh private directory; the
  JaxvtWarning saying which, once per process."""
  uid = os.getuid()
  path = os.path.join(tempfile.gettempdir(), f"jaxvt-cache-{uid}")
  try:
    os.mkdir(path, 0o700)
  except OSError:
    pass
  kept = _private(path, uid)
  if not kept:
    try:
      path = tempfile.mkdtemp(prefix="jaxvt-cache-")
      atexit.register(shutil.rmtree, path, ignore_errors=True)
    except OSError:  # no writable temporary directory: the cache fails to open and is off
      pass
  warnings.warn(JaxvtWarning(
      f"no home directory (HOME is unset and uid {uid} has no passwd entry), so jaxvt's cache "
      f"is in {escape(path)}{'' if kept else ' for this run only'}; set HOME or "
      "XDG_CACHE_HOME to keep it elsewhere"), stacklevel=2)
  return path
