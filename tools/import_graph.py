"""The house drawn from its imports: jaxvt's rooms, the arrows between them and their floors.

  python tools/import_graph.py            # rooms by floor, arrow count, back-edges
  python tools/import_graph.py --dot      # the same graph in Graphviz dot
  python tools/import_graph.py --modules  # module-level arrows too

A room is a subpackage of jaxvt (`jaxvt.gguf`, `jaxvt.model`, ...) or a top-level module
(`jaxvt.engine`, `jaxvt.errors`, ...); the package's own `__init__` is the room `jaxvt`. An arrow
A -> B means some module of A imports a module of B: every `import` / `from ... import` in the
module's syntax tree counts, at the top or inside a function (a lazy import is still a
dependency), and so does a `"jaxvt.x"` string in a module-level `_LAZY` table (the package's lazy
attributes). Arrows into the room `jaxvt` itself (importing the package) are not counted: any
import of a submodule runs the package `__init__` anyway.

Floors: a room's floor is the length of the longest arrow path from it down to a room that
imports no other room (floor 0); the house has max floor + 1 floors. On a graph with cycles the
floors are computed without the back-edges a depth-first search finds (an arrow that closes a
cycle), and each back-edge is reported as an arrow that runs back up. `tests/test_layering.py`
requires none.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools
import os
import sys

PACKAGE = "jaxvt"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_name(path: str, root: str) -> str:
  """'…/jaxvt/gguf/reader.py' -> 'jaxvt.gguf.reader'; a package's __init__ is the package."""
  rel = os.path.relpath(path, root)[:-3].split(os.sep)
  if rel[-1] == "__init__":
    rel = rel[:-1]
  return ".".join(rel)


def room_of(module: str) -> str:
  """jaxvt.gguf.reader -> jaxvt.gguf; jaxvt.engine -> jaxvt.engine; jaxvt -> jaxvt."""
  parts = module.split(".")
  return ".".join(parts[:2])


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
  """The absolute module of a relative import."""
  base = module.split(".") if is_package else module.split(".")[:-1]
  base = base[:len(base) - (level - 1)] if level > 1 else base
  return ".".join(base + ([name] if name else []))


def imports_of(path: str, module: str, known: set[str]) -> set[str]:
  """The jaxvt modules that `module` (the file at `path`) imports."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  is_package = path.endswith("__init__.py")
  out = set()

  def add(name: str):
    # `from jaxvt.ffi import ops` names the module jaxvt.ffi.ops; `from jaxvt.qweight import
    # QWeight` names a module attribute: take the longest known module prefix.
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
      cand = ".".join(parts[:n])
      if cand in known:
        out.add(cand)
        return

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] == PACKAGE:
          add(a.name)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = _resolve(module, is_package, node.level, node.module)
      if base.split(".")[0] != PACKAGE:
        continue
      for a in node.names:
        add(f"{base}.{a.name}")
    elif isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
      for c in ast.walk(node.value):
        if isinstance(c, ast.Constant) and isinstance(c.value, str) and \
            c.value.startswith(PACKAGE + "."):
          add(c.value)
  out.discard(module)
  return out


def imported_names(path: str) -> set[str]:
  """Every absolute module name the file at `path` imports (`import a.b`: "a.b"; `from a.b
  import c`: "a.b" and "a.b.c"), at the top or inside a function; relative imports are left out.
  The layering test reads the product's files with it: none may import `benchmarks`."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names)
  return out


def modules(root: str = ROOT) -> dict[str, str]:
  """{module name: file path} of every module of the package under `root`."""
  out = {}
  for d, dirs, files in os.walk(os.path.join(root, PACKAGE)):
    dirs[:] = sorted(x for x in dirs if not x.startswith((".", "_")) and x != "csrc")
    for f in sorted(files):
      if f.endswith(".py"):
        p = os.path.join(d, f)
        out[module_name(p, root)] = p
  return out


@dataclasses.dataclass
class House:
  module_edges: dict[str, set[str]]  # module -> modules it imports
  rooms: list[str]
  arrows: set[tuple[str, str]]  # (room, room it imports)
  back_edges: list[tuple[str, str]]  # arrows that close a cycle (run back up)
  floors: dict[str, int]  # room -> floor (0: imports no other room)
  cycles: list[list[str]]  # strongly connected groups of more than one room

  @property
  def n_floors(self) -> int:
    return max(self.floors.values(), default=-1) + 1


def _weights(h_edges: dict[str, set[str]]) -> dict[tuple[str, str], int]:
  """(room, room) -> how many module-to-module imports make that arrow."""
  w: dict[tuple[str, str], int] = {}
  for a, bs in h_edges.items():
    for b in bs:
      if room_of(a) != room_of(b) and room_of(b) != PACKAGE:
        w[(room_of(a), room_of(b))] = w.get((room_of(a), room_of(b)), 0) + 1
  return w


def _back_edges(groups: list[list[str]], weights: dict[tuple[str, str], int]
                ) -> list[tuple[str, str]]:
  """The arrows that run back up: inside each cycle group, the arrows against the order of its
  rooms that leaves the fewest module imports pointing backwards (every order is tried for a
  group of up to 8 rooms; a larger one is ordered greedily, the room with the most imports out
  minus in first)."""
  back = []
  for g in groups:
    inner = {(a, b): n for (a, b), n in weights.items() if a in g and b in g}
    cost = lambda order: sum(n for (a, b), n in inner.items() if order.index(a) > order.index(b))
    if len(g) <= 8:
      best = min(itertools.permutations(sorted(g)), key=cost)
    else:
      score = lambda r: sum(n for (a, _), n in inner.items() if a == r) - sum(
          n for (_, b), n in inner.items() if b == r)
      best = tuple(sorted(g, key=lambda r: (-score(r), r)))
    # an arrow a -> b runs down when a comes before b (a imports b, b sits lower)
    back += sorted((a, b) for (a, b) in inner if best.index(a) > best.index(b))
  return back


def _cycles(rooms: list[str], arrows: set[tuple[str, str]]) -> list[list[str]]:
  """Strongly connected groups of two or more rooms (Tarjan)."""
  succ = {r: sorted(b for a, b in arrows if a == r) for r in rooms}
  index, low, stack, on, out = {}, {}, [], set(), []

  def strong(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in succ[v]:
      if w not in index:
        strong(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        out.append(sorted(group))

  for r in rooms:
    if r not in index:
      strong(r)
  return out


def build(root: str = ROOT) -> House:
  files = modules(root)
  known = set(files)
  medges = {m: imports_of(p, m, known) for m, p in files.items()}
  rooms = sorted({room_of(m) for m in files})
  arrows = {(room_of(a), room_of(b)) for a, bs in medges.items() for b in bs
            if room_of(a) != room_of(b) and room_of(b) != PACKAGE}
  cycles = _cycles(rooms, arrows)
  back = _back_edges(cycles, _weights(medges))
  dag = arrows - set(back)
  floors: dict[str, int] = {}

  def floor(r):
    if r not in floors:
      floors[r] = 1 + max((floor(b) for a, b in dag if a == r), default=-1)
    return floors[r]

  for r in rooms:
    floor(r)
  return House(medges, rooms, arrows, back, floors, cycles)


def render(h: House, show_modules: bool = False) -> str:
  short = lambda r: r if r == PACKAGE else r[len(PACKAGE) + 1:]
  lines = [f"{len(h.rooms)} rooms on {h.n_floors} floors, {len(h.arrows)} arrows, "
           f"{len(h.back_edges)} back up, {len(h.cycles)} cycles"]
  for f in range(h.n_floors - 1, -1, -1):
    rooms = [r for r in h.rooms if h.floors[r] == f]
    lines.append(f"floor {f}:")
    for r in rooms:
      to = sorted(short(b) for a, b in h.arrows if a == r)
      lines.append(f"  {short(r):12} -> {', '.join(to) if to else '(nothing)'}")
  for a, b in h.back_edges:
    why = sorted(f"{m} -> {n}" for m, ns in h.module_edges.items() for n in ns
                 if room_of(m) == a and room_of(n) == b)
    lines.append(f"back up: {short(a)} -> {short(b)} ({'; '.join(why)})")
  for c in h.cycles:
    lines.append("cycle: " + " <-> ".join(short(r) for r in c))
  if show_modules:
    lines.append("modules:")
    for m in sorted(h.module_edges):
      lines.append(f"  {m} -> {', '.join(sorted(h.module_edges[m])) or '(nothing)'}")
  return "\n".join(lines)


def dot(h: House) -> str:
  out = ["digraph jaxvt {", "  rankdir=BT;"]
  for f in range(h.n_floors):
    out.append("  { rank=same; " + " ".join(f'"{r}";' for r in h.rooms if h.floors[r] == f)
               + " }")
  for a, b in sorted(h.arrows):
    style = " [color=red]" if (a, b) in h.back_edges else ""
    out.append(f'  "{a}" -> "{b}"{style};')
  out.append("}")
  return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--root", default=ROOT, help="the repository root (holds jaxvt/)")
  ap.add_argument("--dot", action="store_true", help="print Graphviz dot")
  ap.add_argument("--modules", action="store_true", help="also list module-level imports")
  args = ap.parse_args(argv)
  h = build(args.root)
  print(dot(h) if args.dot else render(h, args.modules))
  return 0


if __name__ == "__main__":
  sys.exit(main())
