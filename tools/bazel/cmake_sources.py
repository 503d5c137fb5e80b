"""Reads the extension's sources and flags from CMakeLists.txt, for the Bazel build.

CMakeLists.txt is the one place that says what `jaxvt.ffi._jaxvt_ffi` and its debug module
`jaxvt.ffi._jaxvt_debug` are built from; Bazel reads it (through the @jaxvt_cmake repository,
tools/bazel/cmake_lists.bzl) instead of repeating it:

  python tools/bazel/cmake_sources.py CMakeLists.txt          # prints the generated sources.bzl

It understands the subset of CMake that CMakeLists.txt uses for the two module targets --
set(), if()/elseif()/else()/endif(), nanobind_add_module(), target_sources(),
target_compile_options(), target_compile_definitions(), set_source_files_properties(... PROPERTIES
COMPILE_OPTIONS ...) -- unconditionally or inside the x86-64 block (`if(CMAKE_SYSTEM_PROCESSOR
MATCHES "x86_64...")`); commands inside `JAXVT_GPU` blocks are the CUDA/HIP build, which Bazel does
not do. Anything else aimed at a module target stops it with an error naming the command, so a
change to CMakeLists.txt cannot silently make the two builds differ.
"""

from __future__ import annotations

import re
import sys

# module target -> the prefix of its variables in sources.bzl
TARGETS = {"_jaxvt_ffi": "FFI", "_jaxvt_debug": "DEBUG"}
SRC_PREFIX = "${CMAKE_CURRENT_SOURCE_DIR}/"
# Commands on the target that carry nothing the Bazel build has to mirror (it sets them itself:
# the include directories are the csrc/ directory and the XLA FFI headers, the threads library is
# -pthread, the install rule is pip's).
IGNORED = {"target_include_directories", "target_link_libraries", "install", "find_package",
           "set_target_properties"}


class CMakeError(Exception):
  pass


def _strip_comments(text: str) -> str:
  out = []
  for line in text.splitlines():
    in_str = False
    cut = len(line)
    for i, c in enumerate(line):
      if c == '"' and (i == 0 or line[i - 1] != "\\"):
        in_str = not in_str
      elif c == "#" and not in_str:
        cut = i
        break
    out.append(line[:cut])
  return "\n".join(out)


def _commands(text: str):
  """Yields (name, [args], line) for every command, with quoted arguments unquoted."""
  text = _strip_comments(text)
  i, n = 0, len(text)
  pat = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
  while i < n:
    m = pat.match(text, i)
    if not m:
      if text[i:].strip() == "":
        return
      raise CMakeError(f"cannot parse near line {text.count(chr(10), 0, i) + 1}: "
                       f"{text[i:i + 60]!r}")
    name, j, depth, args, cur, quoted = m.group(1), m.end(), 1, [], "", False
    while True:
      if j >= n:
        raise CMakeError(f"unterminated {name}(")
      c = text[j]
      if quoted:
        if c == '"':
          quoted = False
          args.append(cur)
          cur = ""
        else:
          cur += c
      elif c == '"':
        quoted = True
      elif c == "(":
        depth += 1
        cur += c
      elif c == ")":
        depth -= 1
        if depth == 0:
          if cur:
            args.append(cur)
          break
        cur += c
      elif c.isspace():
        if cur:
          args.append(cur)
          cur = ""
      else:
        cur += c
      j += 1
    yield name.lower(), args, text.count("\n", 0, m.start(1)) + 1
    i = j + 1


def _expand(arg: str, env: dict[str, str]) -> str:
  for _ in range(10):
    new = re.sub(r"\$\{([A-Za-z0-9_]+)\}", lambda m: env.get(m.group(1), m.group(0)), arg)
    if new == arg:
      break
    arg = new
  return arg


def _cxx_flags(items: list[str]) -> list[str]:
  """Flags from target_compile_options arguments: $<$<COMPILE_LANGUAGE:CXX>:...> kept, others'
  languages dropped (CMake splits the unquoted genex on spaces and rejoins it with ';')."""
  joined = ";".join(items)
  out = []
  pos = 0
  genex = re.compile(r"\$<\$<COMPILE_LANGUAGE:([A-Za-z]+)>:([^<>]*)>")
  for m in genex.finditer(joined):
    out += [f for f in joined[pos:m.start()].split(";") if f]
    if m.group(1) == "CXX":
      out += [f for f in m.group(2).split(";") if f]
    pos = m.end()
  out += [f for f in joined[pos:].split(";") if f]
  for f in out:
    if "$<" in f or ">" in f:
      raise CMakeError(f"generator expression not understood in compile options: {joined}")
  return out


def _src(path: str, line: int) -> str:
  if not path.startswith(SRC_PREFIX):
    raise CMakeError(f"line {line}: source {path!r} is not under the source directory")
  return path[len(SRC_PREFIX):]


def parse(text: str, target: str = "_jaxvt_ffi") -> dict[str, list[str]]:
  """The sources and flags of module `target` (a nanobind_add_module of CMakeLists.txt)."""
  TARGET = target  # noqa: N806 (the messages name it as the constant they always named)
  env: dict[str, str] = {"CMAKE_CURRENT_SOURCE_DIR": SRC_PREFIX.rstrip("/")}
  out = {k: [] for k in ("srcs", "copts", "defines", "x86_srcs", "x86_copts", "x86_defines",
                         "gpu_srcs", "nanobind_options")}
  seen_module = False
  stack: list[str] = []  # per open if(): "x86", "gpu" or "other"

  def block() -> str:
    kinds = set(stack)
    if "gpu" in kinds:
      return "gpu"
    if "other" in kinds:
      return "other"
    return "x86" if "x86" in kinds else "top"

  for name, raw, line in _commands(text):
    if name in ("if", "elseif"):
      cond = " ".join(raw)
      kind = ("gpu" if "JAXVT_GPU" in cond else
              "x86" if "CMAKE_SYSTEM_PROCESSOR" in cond and "x86_64" in cond else
              "other")
      if name == "if":
        stack.append(kind)
      else:
        stack[-1] = kind
      continue
    if name == "else":
      stack[-1] = "gpu" if stack[-1] == "gpu" else "other"
      continue
    if name == "endif":
      stack.pop()
      continue
    args = [_expand(a, env) for a in raw]
    where = block()
    if name == "set":
      if len(args) >= 2 and "CACHE" not in args:
        env[args[0]] = ";".join(args[1:])
      continue
    args = [x for a in args for x in a.split(";") if x]
    mentions_target = TARGET in args or any(TARGET in a for a in args)
    if where == "gpu":
      continue
    if name == "nanobind_add_module" and args[:1] == [TARGET]:
      if where != "top":
        raise CMakeError(f"line {line}: nanobind_add_module({TARGET}) inside an if() block")
      seen_module = True
      for a in args[1:]:
        if re.fullmatch(r"[A-Z][A-Z0-9_]*", a):
          out["nanobind_options"].append(a)
        else:
          out["srcs"].append(_src(a, line))
      continue
    if name == "set_source_files_properties":
      if "PROPERTIES" not in args:
        raise CMakeError(f"line {line}: set_source_files_properties without PROPERTIES")
      k = args.index("PROPERTIES")
      files, props = args[:k], args[k + 1:]
      if not props or props[0] != "COMPILE_OPTIONS" or where != "x86":
        raise CMakeError(f"line {line}: only COMPILE_OPTIONS in the x86-64 block are understood")
      x86 = set(out["x86_srcs"])
      if not any(_src(f, line) in x86 for f in files):  # another module's sources
        continue
      out["x86_copts"] += props[1:]
      continue
    if not mentions_target:
      continue
    if name in IGNORED:
      continue
    if where not in ("top", "x86"):
      raise CMakeError(f"line {line}: {name}({TARGET} ...) inside an if() not understood")
    if args[0] != TARGET or len(args) < 2 or args[1] not in ("PRIVATE", "PUBLIC"):
      raise CMakeError(f"line {line}: {name}({' '.join(args)}) not understood")
    items = args[2:]
    prefix = "x86_" if where == "x86" else ""
    if name == "target_sources":
      out[prefix + "srcs"] += [_src(a, line) for a in items]
    elif name == "target_compile_options":
      out[prefix + "copts"] += _cxx_flags(items)
    elif name == "target_compile_definitions":
      out[prefix + "defines"] += [a[2:] if a.startswith("-D") else a for a in items]
    else:
      raise CMakeError(f"line {line}: {name}({TARGET} ...) is not mirrored by the Bazel build; "
                       "teach tools/bazel/cmake_sources.py about it")
  if not seen_module:
    raise CMakeError(f"no nanobind_add_module({TARGET} ...)")
  if "NB_STATIC" not in out["nanobind_options"]:
    raise CMakeError("the Bazel build links libnanobind statically: nanobind_add_module needs "
                     f"NB_STATIC (has {out['nanobind_options']})")
  gpu = env.get("GPU_SOURCES", "")
  out["gpu_srcs"] = [_src(s, 0) for s in gpu.split(";") if s]
  return out


def render(infos: dict[str, dict[str, list[str]]], origin: str) -> str:
  """sources.bzl: PREFIX_KEY = [...] for each module target (TARGETS) and key."""
  lines = [f'"""Generated from {origin} by tools/bazel/cmake_sources.py; do not edit."""', ""]
  for target, info in infos.items():
    doc = {
        "srcs": f"nanobind_add_module({target} ...) sources (+ unconditional target_sources)",
        "copts": f"target_compile_options({target} ...), C++ only",
        "defines": f"target_compile_definitions({target} ...)",
        "x86_srcs": "x86-64 only: the AVX2 translation units",
        "x86_copts": "x86-64 only: their set_source_files_properties(... COMPILE_OPTIONS ...)",
        "x86_defines": f"x86-64 only: target_compile_definitions({target} ...) (every unit)",
        "gpu_srcs": "GPU_SOURCES (CUDA/HIP; not built by Bazel)",
        "nanobind_options": "nanobind_add_module options",
    }
    for key in doc:
      lines.append(f"# {doc[key]}")
      lines.append(f"{TARGETS[target]}_{key.upper()} = {info[key]!r}")
      lines.append("")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print(__doc__, file=sys.stderr)
    return 2
  try:
    with open(argv[1], encoding="utf-8") as f:
      text = f.read()
    infos = {target: parse(text, target) for target in TARGETS}
  except CMakeError as e:
    print(f"cmake_sources: {argv[1]}: {e}", file=sys.stderr)
    return 1
  print(render(infos, "CMakeLists.txt"))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
