"""User-facing errors.

A `JaxvtError` is something the user can cause and fix (a bad file, a bad flag, a budget that
cannot work). Its message is one line naming the problem and the fix; the CLI prints it without a
traceback and exits with status 2. Everything else is a bug and keeps its traceback.
"""


class JaxvtError(Exception):
  """An error the user can fix; `str(err)` is a one-line message."""

  exit_code = 2
