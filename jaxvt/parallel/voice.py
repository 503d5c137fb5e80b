"""One voice over several processes: only process 0 writes to the user.

Every process of a run over several processes runs the same command and the same device
programs; process 0 writes the answer (stdout) and the reports (stderr). The others write nothing
to stdout, and to stderr only jaxvt's error lines unless --verbose. The C++ side's file
descriptor 1 is stderr in process 0 (nowhere in the others unless --verbose), so what XLA's
collectives print there (gloo's "[Gloo] Rank 0 is connected to 1 peer ranks" line) never lands in
front of the answer.

Imports nothing heavy: the CLI sets the voice up before JAX starts.
"""

from __future__ import annotations

import io
import os
import sys

ERROR_PREFIXES = ("jaxvt: error:", "jaxvt: interrupted")


class ErrorsOnly(io.TextIOBase):
  """A text stream that passes on only whole lines that start with ERROR_PREFIXES (a follower's
  stderr: its reports are process 0's, its errors its own)."""

  def __init__(self, target):
    self.target = target
    self._line = ""

  def writable(self) -> bool:
    return True

  def write(self, s: str) -> int:
    self._line += s
    *whole, self._line = self._line.split("\n")
    for line in whole:
      if line.startswith(ERROR_PREFIXES):
        self.target.write(line + "\n")
        self.target.flush()
    return len(s)

  def flush(self) -> None:
    self.target.flush()

  def isatty(self) -> bool:
    return False


def setup(process_id: int, verbose: bool) -> None:
  """The streams of one process of several (call before JAX starts): fd 1 becomes stderr for
  C++ code; Python's sys.stdout keeps the real stdout in process 0 and writes nowhere in the
  others; the others' sys.stderr passes only error lines unless `verbose`."""
  sys.stdout.flush()
  if process_id == 0:
    real = os.dup(1)
    sys.stdout = io.TextIOWrapper(os.fdopen(real, "wb", buffering=0), encoding="utf-8",
                                  errors=sys.stdout.errors or "strict", write_through=True)
    os.dup2(2, 1)  # C++ writes to fd 1 (gloo's connection line) reach stderr
  else:
    sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if verbose:
      os.dup2(2, 1)
    else:
      sys.stderr = ErrorsOnly(sys.stderr)
      null = os.open(os.devnull, os.O_WRONLY)
      os.dup2(null, 1)
      os.close(null)
