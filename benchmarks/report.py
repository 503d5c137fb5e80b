"""docs/BENCHMARKS.md: each benchmark owns one marked section and rewrites only that one."""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys

import jax

HEADER = ("# jaxvt benchmarks\n\nEach section is written by `python -m benchmarks.<name>` and "
          "names its command, machine and date (a section assembled by hand from several runs "
          "says so). Ratios are measured side by side in one run. Earlier measurements are in "
          "git's history of this file.\n")


def machine() -> str:
  d = jax.devices()[0]
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      m = re.search(r"model name\s*:\s*(.*)", f.read())
      cpu = m.group(1).strip() if m else cpu
  except OSError:
    pass
  return (f"{d.platform}:{d.device_kind}; host {cpu}, {os.cpu_count()} cores; "
          f"jax {jax.__version__}; python {sys.version.split()[0]}")


def stamp() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def write_section(name: str, body: str, path: str = "docs/BENCHMARKS.md") -> str:
  """Replaces (or appends) the section `name` of `path`; returns the file's new text."""
  start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
  block = f"{start}\n{body.rstrip()}\n{end}\n"
  text = open(path).read() if os.path.exists(path) else HEADER
  if start in text and end in text:
    i, j = text.index(start), text.index(end) + len(end)
    text = text[:i] + block.rstrip("\n") + text[j:]
  else:
    text = text.rstrip("\n") + "\n\n" + block
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  return text


def publish(name: str, lines: list[str], write: bool = True) -> str:
  """The section body `lines` make (one a line); with `write`, written as the section `name` of
  docs/BENCHMARKS.md."""
  body = "\n".join(lines)
  if write:
    write_section(name, body)
  return body
