"""Rendering a GGUF file's chat template (jinja2) as the untrusted program it is.

A template comes from the model file, and jinja2's sandbox stops it from reaching Python's
internals but not from looping for hours (nested `range`s), building gigabytes (`s ~ s` in a
loop, `'x' * 10**9`, a huge `join`) or recursing until the interpreter gives up. So `render`
runs it in a child Python process of its own (`python -I -S`, a fraction of a second to start),
which limits itself before it compiles the template:

  time      RENDER_SECONDS of CPU (RLIMIT_CPU); the parent kills it after RENDER_SECONDS +
            START_SECONDS of wall time (a loaded machine can take seconds to start Python)
  memory    RENDER_MEMORY bytes of address space (RLIMIT_AS): an allocation past it fails
  output    the rendered text stops at max_output characters and is refused
  recursion Python's recursion limit, as in any process

and answers with one JSON object on stdout. On Linux the child dies with its parent (a parent
killed while a template renders leaves nothing running). Whatever goes wrong (a syntax error, any exception,
MemoryError, the time running out, the child dying) becomes one JaxvtError naming the file.
The variables cross as JSON, so they must be JSON data (messages, tools, flags).

The template sees HF's conventions: `messages`, `add_generation_prompt`, `bos_token`,
`eos_token` and the caller's extra variables; helpers `raise_exception`, `strftime_now`, the
filter `tojson`, the `{% generation %}` tag and loop controls.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import subprocess
import sys
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxvt.errors import JaxvtError, escape

RENDER_SECONDS = 3  # CPU seconds; the wall-clock limit adds START_SECONDS for the child's start
START_SECONDS = 7
RENDER_MEMORY = 1 << 30
MAX_TEMPLATE_CHARS = 1 << 20
MAX_OUTPUT_CHARS = 1 << 20  # plus 4x the characters of the messages (a template repeats them)

# The child: first (Linux) have the kernel kill it when the parent dies (prctl
# PR_SET_PDEATHSIG), and leave if the parent died before that; then read the request, put the
# parent's import path in place, render, answer. argv[1] is the parent's pid.
_CHILD = ("import sys\n"
          "if sys.platform.startswith('linux'):\n"
          "  import ctypes, os, signal\n"
          "  ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
          "  if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
          "import json; req = json.loads(sys.stdin.buffer.read()); "
          "sys.path[:0] = req['path']; "
          "from jaxvt.gguf.chat_template import child_main; child_main(req)")


def render(template: str, variables: dict[str, Any], source: str) -> str:
  """The template rendered with `variables`; JaxvtError (naming `source`) for any failure."""
  where = f"the chat template of {escape(source)}"
  fix = "pass a raw prompt instead (--nochat / chat=False) or use another model file"
  if len(template) > MAX_TEMPLATE_CHARS:
    raise JaxvtError(f"{where} is {len(template)} characters long (at most "
                     f"{MAX_TEMPLATE_CHARS}); {fix}")
  try:
    payload = json.dumps(variables)
  except (TypeError, ValueError) as e:
    raise JaxvtError(f"the chat template's variables must be JSON data ({escape(e)}); pass "
                     "messages, tools and flags as dicts, lists, strings and numbers") from None
  request = json.dumps({"template": template, "variables": json.loads(payload),
                        "path": [p for p in sys.path if isinstance(p, str)],
                        "max_output": MAX_OUTPUT_CHARS + 4 * len(payload),
                        "seconds": RENDER_SECONDS, "memory": RENDER_MEMORY})
  try:
    p = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD, str(os.getpid())],
                       input=request.encode(),
                       capture_output=True, timeout=RENDER_SECONDS + START_SECONDS)
  except subprocess.TimeoutExpired:
    raise JaxvtError(f"{where} ran longer than {RENDER_SECONDS:g} s; {fix}") from None
  except OSError as e:
    raise JaxvtError(f"could not start a process to render {where} ({escape(e)})") from None
  try:
    answer = json.loads(p.stdout)
  except ValueError:
    answer = None
  if p.returncode != 0 or not isinstance(answer, dict):
    if p.returncode in (-9, -24, 128 + 9, 128 + 24):  # SIGKILL / SIGXCPU: out of time
      raise JaxvtError(f"{where} ran longer than {RENDER_SECONDS:g} s; {fix}")
    why = (p.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit status "
                                                                          f"{p.returncode}"])[-1]
    raise JaxvtError(f"{where} crashed its renderer ({escape(why, 120)}); {fix}")
  if "error" in answer:
    raise JaxvtError(f"{where} {escape(answer['error'], 300)}; {fix}")
  if not isinstance(answer.get("text"), str):
    raise JaxvtError(f"{where} gave no text; {fix}")
  return answer["text"]


# ---- the child process ----------------------------------------------------------------------

class _Refused(Exception):
  """The template called raise_exception."""


class _Failed(Exception):
  """A failure the child reports as it is."""


def _raise_exception(message: str):
  raise _Refused(str(message))


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


class _GenerationTags(jinja2.ext.Extension):
  """HF's `{% generation %}...{% endgeneration %}` (marks assistant spans): rendered as is."""
  tags = {"generation"}

  def parse(self, parser):
    parser.stream.skip(1)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def environment() -> ImmutableSandboxedEnvironment:
  """The sandbox a chat template runs in (HF's settings: trim_blocks, lstrip_blocks)."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTags, "jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


def _render_bounded(req: dict) -> str:
  try:
    template = environment().from_string(req["template"])
  except jinja2.TemplateSyntaxError as e:
    raise _Failed(f"does not parse ({e.message}, line {e.lineno})") from None
  out, n = [], 0
  for piece in template.generate(**req["variables"]):
    n += len(piece)
    if n > req["max_output"]:
      raise _Failed(f"rendered more than {req['max_output']} characters")
    out.append(piece)
  return "".join(out)


def child_main(req: dict) -> None:
  """Runs in the child: limits itself, renders, writes {"text"} or {"error"} to stdout."""
  cpu = int(req["seconds"])
  resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
  resource.setrlimit(resource.RLIMIT_AS, (req["memory"], req["memory"]))
  try:
    answer = {"text": _render_bounded(req)}
  except _Refused as e:
    answer = {"error": f"refused the messages: {e}"}
  except _Failed as e:
    answer = {"error": str(e)}
  except MemoryError:
    answer = {"error": f"needed more than {req['memory'] >> 20} MiB of memory"}
  except RecursionError:
    answer = {"error": "recursed too deeply"}
  except Exception as e:  # whatever else the template raised: it is the file's failure
    answer = {"error": f"failed ({type(e).__name__}: {e})"}
  sys.stdout.write(json.dumps(answer))
  sys.stdout.flush()
