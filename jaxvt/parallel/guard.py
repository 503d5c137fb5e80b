"""The guard of one process of a run over several processes: a small parent (no JAX) that runs
the real process as its child and keeps JAX's runtime aborts to one line.

JAX's distributed runtime ends a process with an abort (a fatal log line and a C++ stack trace,
status 134) when the coordinator cannot be reached in time, when another process dies or stops
answering its heartbeats, or when the coordinator itself is gone; its failure callback cannot be
replaced from Python. So with --coordinator the command re-runs itself as its child
(GUARD_ENV set) with the same arguments: stdout is the child's own, stderr passes through this
parent line by line until the runtime's fatal output starts, which is swallowed and replaced by
one jaxvt line. The parent's status: the child's; 2 where the child could not join the run (a
user's mistake: the wrong coordinator, a mismatched --num-processes); 1 where another process
failed. SIGTERM and SIGINT reach the child (which stops; the other processes then stop too).

Imports nothing heavy: it runs before JAX starts.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys

GUARD_ENV = "JAXVT_GUARDED_PROCESS"
# The first line of the runtime's fatal output: a glog FATAL line, a failed C++ check, an
# uncaught C++ exception.
FATAL = re.compile(r"^(F\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]*\] |\*\*\* Check failure|"
                   r"terminate called )")
PR_SET_PDEATHSIG = 1
JOINED = "jaxvt: joined the run\n"  # the child's marker on stderr once it has joined (not shown)


def guarded() -> bool:
  """Whether this process is the guard's child (it runs the model)."""
  return os.environ.get(GUARD_ENV) == "1"


def mark_joined() -> None:
  """In the guarded child, once it has joined the run: tells the guard (straight to fd 2, past
  any filtering of sys.stderr)."""
  if guarded():
    os.write(2, JOINED.encode())


def _line(process_id: int, coordinator: str, timeout: int, fatal: str,
          joined: bool) -> tuple[str, int]:
  """The one line (and the status) for the runtime's fatal output `fatal`."""
  reason = re.sub(r"\s+", " ", fatal.split("] ", 1)[-1]).strip().split(". ")[0][:240]
  if not joined:
    return (f"jaxvt: error: process {process_id} could not join the run at {coordinator} within "
            f"{timeout} s: process 0 not reachable there, or not every process started with the "
            f"same --coordinator and --num-processes ({reason})", 2)
  return (f"jaxvt: error: process {process_id} stops: another process of the run failed or "
          f"stopped answering ({reason})", 1)


def _die_with_parent() -> None:
  """In the child before it starts (Linux): SIGKILL when the guard dies, so a guard killed
  outright takes its process with it (and the run's other processes then stop)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):  # not Linux: the child outlives a killed guard
    pass


def supervise(module: str, argv: list[str], process_id: int, coordinator: str,
              timeout: int) -> int:
  """Runs `python -m module argv[1:]` as the guarded child and returns the status to exit
  with (module docstring)."""
  env = dict(os.environ, **{GUARD_ENV: "1"})
  child = subprocess.Popen([sys.executable, "-m", module, *argv[1:]], stderr=subprocess.PIPE,
                           env=env, preexec_fn=_die_with_parent)
  forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731
  old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  fatal, joined = None, False
  err = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
  try:
    for raw in child.stderr:
      line = raw.decode("utf-8", "replace")
      if fatal is None and FATAL.match(line):
        fatal = line
      if fatal is not None:
        if len(fatal) < 4000 and line is not fatal:
          fatal += line
        continue
      if line == JOINED:
        joined = True
        continue
      if err is not None:
        err.write(raw)
        err.flush()
      else:
        sys.stderr.write(line)
    status = child.wait()
  finally:
    for s, h in old.items():
      signal.signal(s, h)
  if fatal is not None:
    text, code = _line(process_id, coordinator, timeout, fatal, joined)
    print(text, file=sys.stderr)
    return code
  if status < 0:  # killed by a signal: the shell's convention
    return 128 - status
  return status
