"""User-facing errors, and the one function that makes untrusted text safe to print.

A `JaxvtError` is something the user can cause and fix (a bad file, a bad flag, a budget that
cannot work). Its message is one line naming the problem and the fix; the CLI prints it without a
traceback and exits with status 2. Everything else is a bug and keeps its traceback.

Text that comes from outside (GGUF metadata, tensor names, template output, paths, flag values)
reaches the screen only through `escape`: control characters (newlines, terminal escape
sequences, bidirectional overrides, ...) become visible `\\x..` / `\\u....` escapes and long
strings are cut. `str(JaxvtError)` is escaped as a whole, so an error can never print more than
one line or move the cursor, whatever a file put into its message.
"""

from __future__ import annotations

import unicodedata

# Longest message str(JaxvtError) returns; a longer one keeps its head and its tail (the fix).
MESSAGE_LIMIT = 2000
# Unicode categories that do not print as themselves: controls (Cc: C0, DEL, C1), format
# characters (Cf: bidi overrides, zero-width joiners), line/paragraph separators, surrogates
# (what surrogateescape makes of undecodable bytes), private use and unassigned code points.
_HIDDEN = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"))


def _hidden(c: str) -> bool:
  return unicodedata.category(c) in _HIDDEN


def escape(text: object, limit: int | None = 200, keep: str = "") -> str:
  """`text` (str() of it) as one printable line: every character that is not printable text
  becomes `\\n`, `\\t`, `\\xHH`, `\\uHHHH` or `\\UHHHHHHHH`; a backslash stays a backslash. Longer
  than `limit` characters (None: no limit), the middle is replaced by '...'. Characters in `keep`
  (e.g. "\\n\\t" for generated text) pass unchanged. Idempotent: escaping escaped text changes
  nothing."""
  s = text if isinstance(text, str) else str(text)
  if any(c not in keep and (c < " " or c >= "\x7f") and _hidden(c) for c in s):
    out = []
    for c in s:
      if c in keep or not ((c < " " or c >= "\x7f") and _hidden(c)):
        out.append(c)
      elif c == "\n":
        out.append("\\n")
      elif c == "\t":
        out.append("\\t")
      elif c == "\r":
        out.append("\\r")
      elif ord(c) < 0x100:
        out.append(f"\\x{ord(c):02x}")
      elif ord(c) < 0x10000:
        out.append(f"\\u{ord(c):04x}")
      else:
        out.append(f"\\U{ord(c):08x}")
    s = "".join(out)
  if limit is not None and len(s) > limit:
    head = max(limit * 2 // 3, 1)
    tail = max(limit - head - 3, 0)
    s = s[:head] + "..." + (s[-tail:] if tail else "")
  return s


class JaxvtError(Exception):
  """An error the user can fix; `str(err)` is a one-line message with nothing that is not
  printable text in it (see `escape`)."""

  exit_code = 2

  def __str__(self) -> str:
    return escape(super().__str__(), MESSAGE_LIMIT)


class JaxvtWarning(UserWarning):
  """Something jaxvt worked around that the user may want to fix (a cache without a home
  directory, ...); one line, like JaxvtError. The CLI prints these as `jaxvt: note: ...`."""


def out_of_memory(e: BaseException) -> JaxvtError | None:
  """An error of JAX's or XLA's saying the device ran out of memory (RESOURCE_EXHAUSTED, while
  compiling or running a program) as the one-line JaxvtError naming the fixes; None for any
  other exception."""
  if type(e).__module__.split(".")[0] not in ("jax", "jaxlib"):
    return None
  text = str(e)
  if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
    return None
  first = next((line.strip() for line in text.splitlines() if line.strip()), "")
  return JaxvtError(f"the model does not fit in the device's memory (XLA: {escape(first, 160)}); "
                    "keep more weights in the host tier (--offload-gb auto, or more GiB) or "
                    "allocate less context (--max-context)")
