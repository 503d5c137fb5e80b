"""What `python -m jaxvt.run` says about itself: --help (the flags in groups, with examples),
--version, and the one line for a flag it does not know (with the closest names).

Built from the CLI's absl FlagValues (each flag's help string is the text shown), spelled as a
user types the flags (--max-tokens; booleans as --[no]chat). Imports nothing heavy: --help and
--version answer without starting JAX.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import textwrap

from absl import flags

import jaxvt
from jaxvt.errors import escape

USAGE = "usage: python -m jaxvt.run [PROMPT] [--model PATH] [--offload-gb N|auto] [flags...]"
SUMMARY = ("Runs a GGUF language model with JAX: generated text streams to stdout; the placement, "
           "progress and timings go to stderr. A mistake (a bad flag, file or budget) is one line "
           "on stderr and exit status 2.")
EXAMPLES = (
    ("python -m jaxvt.run", "the default model answers a short question"),
    ('python -m jaxvt.run "Why is the sky blue?"', "your question, in the file's chat template"),
    ('python -m jaxvt.run --nochat --prompt "The capital of France is" --max-tokens 32',
     "raw text completion"),
    ('python -m jaxvt.run --model path/to/model.gguf --temperature 0.7 --top-p 0.9 "Hello"',
     "sampled"),
    ("python -m jaxvt.run --model big.gguf --offload-gb 7", "7 GiB of weights in the host tier"),
    ("python -m jaxvt.run --interactive", "a conversation; each turn prefills only what is new"),
    ("python -m jaxvt.run --model big.gguf --offload-gb auto --plan",
     "print the plan, don't generate"),
)
GROUPS = (
    ("model and placement", ("model", "max_context", "offload_gb", "offload_pattern",
                             "device_gb", "expert_cache_gb", "expert_cache_policy", "force",
                             "plan", "mesh", "coordinator",
                             "num_processes", "process_id", "join_timeout")),
    ("generation", ("prompt", "chat", "interactive", "max_tokens")),
    ("sampling", ("temperature", "top_k", "top_p", "seed")),
    ("runtime", ("numerics", "batch_invariant", "deterministic", "compile_cache", "verbose",
                 "help", "helpfull", "version")),
)
# --helpfull adds the environment the CLI reads.
ENVIRONMENT = (
    ("JAXVT_EXPORT_STORE=0", "trace the model's programs again instead of reading them back"),
    ("JAXVT_COMPILE_CACHE=DIR|0", "where compiled programs are kept (0: nowhere)"),
    ("JAXVT_DETERMINISTIC=0", "XLA's own algorithm choices (as --nodeterministic)"),
    ("XDG_CACHE_HOME", "the cache's parent directory (default ~/.cache)"),
    ("JAX_PLATFORMS=cpu", "run on the CPU even where a GPU is present (JAX's own variable)"),
)
METAVARS = {"model": "PATH", "prompt": "TEXT", "max_tokens": "N", "temperature": "T",
            "top_k": "K", "top_p": "P", "seed": "S", "max_context": "N", "offload_gb": "N|auto",
            "offload_pattern": "REGEX[=host|device]", "device_gb": "N", "mesh": "tp=N|ep=N|tp=N,ep=M",
            "coordinator": "HOST:PORT", "num_processes": "N", "process_id": "I",
            "join_timeout": "S",
            "expert_cache_gb": "N|auto", "expert_cache_policy": "lru|lfru",
            # jaxvt.serve's
            "host": "ADDRESS", "port": "PORT", "api_key": "KEY", "max_batch": "N",
            "max_queue": "N", "prefix_cache_gb": "N", "drain_seconds": "S",
            "header_timeout": "S", "timeout_keep_alive": "S", "send_timeout": "S",
            "limit_concurrency": "N"}
# A flag not named above: by its type.
TYPE_METAVARS = {"int": "N", "float": "N"}
HELP_FLAGS = ("-h", "--help", "--helpfull")
WIDTH, INDENT = 100, 30


def spelling(name: str) -> str:
  """--max_tokens as a user types it: --max-tokens."""
  return "--" + name.replace("_", "-")


def _entry(flag: flags.Flag) -> str:
  if isinstance(flag, flags.BooleanFlag):
    name = "--" + ("" if flag.name.startswith("help") or flag.name in ("version", "verbose")
                   else "[no]") + flag.name.replace("_", "-")
  else:
    metavar = METAVARS.get(flag.name) or TYPE_METAVARS.get(flag.flag_type(), "TEXT")
    name = f"{spelling(flag.name)} {metavar}"
  if flag.short_name:
    name = f"-{flag.short_name}, {name}"
  return name


_ENUM_PREFIX = re.compile(r"^<[^<>]*>: ")
_LIST_NOTE = re.compile(r";\s*repeat this option to specify a list of values\.?$")


def _wrap(text: str, width: int) -> list[str]:
  """Lines of at most `width` characters, broken between words only (never inside a word such
  as Retry-After or --offload-gb)."""
  return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


def _text(flag: flags.Flag) -> str:
  """The flag's help string, with "(default: ...)" where it does not say it already."""
  # absl's own additions: "<a|b>: " before an enum's help, "; repeat this option to specify a
  # list of values" after a repeatable flag's (which says so in its own words)
  text = _LIST_NOTE.sub("", _ENUM_PREFIX.sub("", flag.help.strip()))
  if ("default" in text or flag.default is None or isinstance(flag, flags.BooleanFlag)
      or isinstance(flag, flags.MultiFlag)):
    return text
  default = f" (default: {flag.default_as_str.strip(chr(39))})"
  return text[:-1] + default + "." if text.endswith(".") else text + default


def _rows(pairs, indent: int = INDENT) -> list[str]:
  out = []
  for left, text in pairs:
    body = _wrap(text, WIDTH - indent) or [""]
    if len(left) + 2 > indent - 2:
      out.append("  " + left)
      out.extend(" " * indent + line for line in body)
    else:
      out.append(("  " + left).ljust(indent) + body[0])
      out.extend(" " * indent + line for line in body[1:])
  return out


def help_text(flag_values: flags.FlagValues, full: bool = False, *, usage: str = USAGE,
              summary: str = SUMMARY, examples=EXAMPLES, groups=GROUPS) -> str:
  """--help: usage, what the CLI does, examples, the flags in groups (and with `full`, the
  environment variables it reads). The defaults are jaxvt.run's page; jaxvt.serve passes its own."""
  lines = [usage, "", *_wrap(summary, WIDTH), "", "examples:"]
  for cmd, what in examples:
    lines += [f"  # {what}", f"  {cmd}"]
  shown = set()
  for title, names in groups:
    lines += ["", f"{title}:"]
    present = [flag_values[n] for n in names if n in flag_values]
    shown.update(f.name for f in present)
    lines += _rows((_entry(f), _text(f)) for f in present)
  rest = [flag_values[n] for n in sorted(flag_values) if n not in shown
          and flag_values[n].name == n and n not in ("flagfile", "undefok")]
  if rest:
    lines += ["", "other:"] + _rows((_entry(f), _text(f)) for f in rest)
  prompt = (" a PROMPT after the flags is the same as --prompt (after --, everything is the "
            "prompt)." if "prompt" in flag_values else "")
  lines += [""] + _wrap(
      "Flags take --max-tokens or --max_tokens spellings, and --flag=value or --flag value;"
      + prompt + ("" if full else " --helpfull also lists the environment variables jaxvt reads."),
      WIDTH)
  if full:
    lines += ["", "environment:"] + _rows(ENVIRONMENT)
  return "\n".join(lines) + "\n"


def _extension_file() -> str | None:
  """Where `from jaxvt.ffi import _jaxvt_ffi` would load the extension from, found as the import
  system finds it but without running jaxvt.ffi (which imports JAX): through sys.meta_path, so
  an editable install's finder (scikit-build-core keeps the built module in site-packages, away
  from the sources) answers as it does for the import."""
  try:
    package = importlib.util.find_spec("jaxvt.ffi")
  except (ImportError, ValueError):
    return None
  search = list(package.submodule_search_locations or []) if package else []
  for finder in sys.meta_path:
    find = getattr(finder, "find_spec", None)
    if find is None:
      continue
    try:
      spec = find("jaxvt.ffi._jaxvt_ffi", search)
    except (ImportError, OSError, ValueError):
      continue
    if spec is not None:
      return spec.origin if spec.origin and os.path.isfile(spec.origin) else None
  return None


def extension_build() -> str:
  """The CPU/GPU extension jaxvt would load: its file's name and SHA-256 prefix, or "not built"
  (found by its import spec: importing it would start JAX)."""
  found = _extension_file()
  if found is None:
    return "not built (the jnp reference path only)"
  h = hashlib.sha256()
  with open(found, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return f"{os.path.basename(found)} (sha256 {h.hexdigest()[:16]})"


def _dist_version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def version_text() -> str:
  """--version: jaxvt's, jax's and jaxlib's versions (from their metadata: JAX is not
  started), Python's, and the extension's build."""
  return "\n".join([
      f"jaxvt {jaxvt.__version__}",
      f"jax {_dist_version('jax')}, jaxlib {_dist_version('jaxlib')}, "
      f"Python {sys.version.split()[0]}",
      f"extension: {extension_build()}"]) + "\n"


def unknown_flag(err: flags.UnrecognizedFlagError, flag_values: flags.FlagValues) -> str:
  """The one line for a flag the CLI does not define: its name as typed, the closest names."""
  name = str(err.flagname)
  real = {flag_values[n] for n in flag_values if n not in ("flagfile", "undefok")}
  known = sorted({spelling(f.name) for f in real} |
                 {"--no" + spelling(f.name)[2:] for f in real
                  if isinstance(f, flags.BooleanFlag) and _entry(f).startswith("--[no]")})
  typed = spelling(name) if len(name) > 1 else f"-{name}"
  close = [k for k in known if len(name) >= 3 and k.startswith(typed)][:3]  # --temp, --offload
  close = close or difflib.get_close_matches(typed, known, n=3, cutoff=0.75)
  hint = f" (did you mean {' or '.join(close)}?)" if close else ""
  return f"unknown flag {escape(typed, 80)}{hint}; see --help"
