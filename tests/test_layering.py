"""The package drawn from its imports (tools/import_graph.py): no cycle, no arrow back up, fewer
floors than the 9 it had before it was restructured; the product imports no benchmark, and the
benchmarks use only the package's public API: its public modules (PUBLIC_MODULES) and in them
no private name."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("import_graph",
                                               os.path.join(ROOT, "tools", "import_graph.py"))
graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = graph  # its dataclasses look their module up there
_spec.loader.exec_module(graph)

FLOORS_BEFORE = 9  # tools/import_graph.py on the package before it was restructured

# jaxvt's public API: the modules a benchmark (or a notebook) may import, each for its reason.
# The one list; docs/ARCHITECTURE.md ("The public API") names the same modules.
PUBLIC_MODULES = {
    "jaxvt": "load, Engine, open_model, layout, plan, place, SamplingParams, JaxvtError",
    "jaxvt.engine": "the steps one by one and the programs an Engine runs (exec_for, Exec, "
                    "prefill_fn, first_token_fn, decode_fn, decode_loop_fn, decode_sample_fn, "
                    "row_key, xla_workspace_of)",
    "jaxvt.parallel.mesh": "the --mesh spec (parse, build), beside jaxvt.layout",
    "jaxvt.ffi": "the extension: available, extension, debug_extension (the probes)",
    "jaxvt.ffi.ops": "the kernel ops (qmatmul, qmatmul_experts, qdequant, ...)",
    "jaxvt.ffi.grouped": "the grouped and tiled kernel ops",
    "jaxvt.ffi.tuning": "the kernel rule (Products) whose crossovers benchmarks.products measures",
    "jaxvt.qweight": "the ops' operand (QWeight, QMeta), which a kernel benchmark builds",
    "jaxvt.offload.host_tier": "the host tier (HostTier) that place() fills and the kernels read",
    "jaxvt.gguf.formats": "the GGUF block formats",
    "jaxvt.gguf.tokenizer": "the Tokenizer an Engine is built with",
    "jaxvt.sampling": "the per-row sampling and token-mask functions (apply_mask, mask_words) the "
                      "structured-output benchmark times on their own",
    "jaxvt.gguf.default_model": "where the embedded default model's file is (default_model_path)",
    "jaxvt.synth": "synthetic GGUF files to benchmark on",
    "jaxvt.synth_routing": "the routing statistics a synthetic file is written for and measured by",
    "jaxvt.model.presets": "the published models' shapes, for jaxvt.synth",
}


def test_no_cycle_and_no_arrow_back_up():
  h = graph.build(ROOT)
  assert not h.cycles and not h.back_edges, graph.render(h)
  for a, b in h.arrows:
    assert h.floors[a] > h.floors[b], (a, b, graph.render(h))


def test_fewer_floors_than_before():
  h = graph.build(ROOT)
  assert h.n_floors < FLOORS_BEFORE, graph.render(h)


def test_the_product_imports_no_benchmark():
  """jaxvt/ never imports benchmarks/ (the benchmarks sit on top of the package, and the wheel
  does not ship them)."""
  users = sorted(m for m, p in graph.modules(ROOT).items()
                 if any(n == "benchmarks" or n.startswith("benchmarks.")
                        for n in graph.imported_names(p)))
  assert not users, users
  assert not os.path.exists(os.path.join(ROOT, "jaxvt", "bench"))


def _private_uses(path: str) -> list[str]:
  """`from jaxvt... import _x` and `m._x` on a jaxvt module `m` in the file at `path`."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  modules, out = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxvt"):
      for a in node.names:
        if a.name.startswith("_"):
          out.append(f"from {node.module} import {a.name}")
        modules.add(a.asname or a.name)
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("jaxvt"):
          modules.add(a.asname or a.name.split(".")[0])
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in modules and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      out.append(f"{node.value.id}.{node.attr}")
  return out


def _py_files(*parts: str) -> list[str]:
  d = os.path.join(ROOT, *parts)
  return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".py"))


def test_benchmarks_use_only_public_names():
  files = _py_files("benchmarks") + _py_files("tools")
  bad = {os.path.relpath(f, ROOT): u for f in files for u in [_private_uses(f)] if u}
  assert not bad, bad


def _is_module(name: str) -> bool:
  path = os.path.join(ROOT, *name.split("."))
  return os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__init__.py"))


def _jaxvt_modules(path: str) -> set[str]:
  """The jaxvt modules the file at `path` uses, wherever it imports them: `import jaxvt.a.b`,
  `from jaxvt.a import b` (jaxvt.a.b where b is a module, else jaxvt.a), and `jaxvt.a` reached
  as an attribute of the package."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.split(".")[0] == "jaxvt"}
    elif (isinstance(node, ast.ImportFrom) and not node.level
          and (node.module or "").split(".")[0] == "jaxvt"):
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        out.add(sub if _is_module(sub) else node.module)
    elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id == "jaxvt" and _is_module(f"jaxvt.{node.attr}")):
      out.add(f"jaxvt.{node.attr}")
  return out


def test_benchmarks_import_only_public_modules():
  """Every jaxvt module a benchmark uses is one of PUBLIC_MODULES (add one there, with its
  reason, and to docs/ARCHITECTURE.md, only for what the package's names cannot do)."""
  assert all(_is_module(m) for m in PUBLIC_MODULES), PUBLIC_MODULES
  used = {os.path.relpath(f, ROOT): _jaxvt_modules(f) for f in _py_files("benchmarks")}
  bad = {f: sorted(m - set(PUBLIC_MODULES)) for f, m in used.items() if m - set(PUBLIC_MODULES)}
  assert not bad, bad
  assert set().union(*used.values()) == set(PUBLIC_MODULES)  # no entry that nothing needs


def test_the_architecture_document_names_the_public_modules():
  text = open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8").read()
  section = text.split("\n## The public API\n", 1)[1].split("\n## ", 1)[0]
  first = [l.split("|")[1] for l in section.splitlines() if l.startswith("| `")]  # the table's
  assert set(re.findall(r"`(jaxvt(?:\.\w+)*)`", " ".join(first))) == set(PUBLIC_MODULES)


def test_public_module_check_sees_every_way_in(tmp_path):
  p = tmp_path / "b.py"
  p.write_text("import jaxvt\nfrom jaxvt import engine, load\nfrom jaxvt.loader import pack_rows\n"
               "import jaxvt.model.layers as L\nfrom jaxvt.ffi import ops\n"
               "def f():\n  from jaxvt.offload import plan\n  return jaxvt.loader, jaxvt.load\n")
  assert _jaxvt_modules(str(p)) == {"jaxvt", "jaxvt.engine", "jaxvt.loader", "jaxvt.model.layers",
                                    "jaxvt.ffi.ops", "jaxvt.offload.plan"}


def test_tools_import_no_benchmark_and_nothing_imports_a_tool():
  """tools/ holds scripts a contributor runs; the product, the tests and the benchmarks import
  none of them (test_layering reads import_graph.py as a file)."""
  tools = {f[:-3] for f in os.listdir(os.path.join(ROOT, "tools")) if f.endswith(".py")}
  files = ([p for p in graph.modules(ROOT).values()] + _py_files("benchmarks")
           + _py_files("tests"))
  bad = {os.path.relpath(f, ROOT): sorted(n for n in graph.imported_names(f)
                                          if n.split(".")[0] in ("tools", *tools))
         for f in files}
  assert not {f: n for f, n in bad.items() if n}, bad


# ---- the tool itself, on small packages ----------------------------------------------------

def _package(root, files: dict[str, str]) -> str:
  for name, text in files.items():
    path = root / "jaxvt" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
  return str(root)


def test_tool_sees_a_cycle_through_a_lazy_import(tmp_path):
  root = _package(tmp_path, {
      "__init__.py": "",
      "low.py": "def f():\n  from jaxvt import high\n  return high\n",
      "high.py": "from jaxvt import low\n",
      "base.py": "",
      "top/__init__.py": "",
      "top/a.py": "from jaxvt.high import x\nimport jaxvt.base\n",
  })
  h = graph.build(root)
  assert h.cycles == [["jaxvt.high", "jaxvt.low"]]
  assert len(h.back_edges) == 1 and set(h.back_edges[0]) == {"jaxvt.high", "jaxvt.low"}
  assert h.floors["jaxvt.top"] > max(h.floors["jaxvt.high"], h.floors["jaxvt.low"])
  assert h.floors["jaxvt.base"] == 0


def test_tool_counts_relative_imports_and_floors(tmp_path):
  root = _package(tmp_path, {
      "__init__.py": "_LAZY = {'x': 'jaxvt.c'}\n",
      "a/__init__.py": "",
      "a/m.py": "from . import n\nfrom ..b import q\n",
      "a/n.py": "",
      "b/__init__.py": "",
      "b/q.py": "from jaxvt.c import thing\n",
      "c.py": "thing = 1\n",
  })
  h = graph.build(root)
  assert not h.cycles and not h.back_edges
  assert h.arrows == {("jaxvt.a", "jaxvt.b"), ("jaxvt.b", "jaxvt.c"), ("jaxvt", "jaxvt.c")}
  assert (h.floors["jaxvt.c"], h.floors["jaxvt.b"], h.floors["jaxvt.a"]) == (0, 1, 2)
  assert h.n_floors == 3
