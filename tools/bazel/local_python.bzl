"""Repository rule `local_python`: the local CPython and the packages jaxvt's extension builds against.

It runs the local interpreter once (repository_ctx.execute) to find, offline:
  - the interpreter itself (sys.executable), which becomes the registered Python toolchain, so
    py_binary/py_test run on it and import jax, numpy, gguf, pytest ... from its site-packages;
  - CPython's headers (sysconfig.get_paths()["include"]);
  - nanobind's headers and sources (nanobind.include_dir(), nanobind.source_dir()) and the robin_map
    headers bundled in nanobind's ext/ directory;
  - the XLA FFI headers shipped with jaxlib (jax.ffi.include_dir()).
Each directory is symlinked into the external repository and exposed by a cc_library (see
local_python.BUILD.tpl). Nothing is downloaded.

The interpreter is `$JAXVT_PYTHON` when set, else the first `python3` (then `python`) on PATH; e.g.
  bazel build --repo_env=JAXVT_PYTHON=/opt/py311/bin/python3 //...
The rule is `local`, so it is re-run whenever Bazel re-evaluates external repositories (a new
server, or `bazel sync --configure`); after upgrading nanobind/jax run `bazel sync --configure`.
"""

_PROBE = r"""
import os, re, sys, sysconfig
import nanobind
import jax.ffi

nb_root = os.path.dirname(os.path.abspath(nanobind.__file__))
cmake = os.path.join(nb_root, "cmake", "nanobind-config.cmake")
# The libnanobind sources exactly as nanobind's own CMake lists them (nanobind_build_library).
text = open(cmake, encoding="utf-8").read()
block = text[text.index("function (nanobind_build_library"):]
block = block[block.index("add_library(${TARGET_NAME}"):]
block = block[:block.index(")")]
srcs = re.findall(r"\$\{NB_DIR\}/src/([A-Za-z0-9_]+\.cpp)", block)
if not srcs:
  raise SystemExit("could not read the libnanobind source list from " + cmake)
info = {
    "python": sys.executable,
    "version": "%d.%d" % sys.version_info[:2],
    "python_include": sysconfig.get_paths()["include"],
    "nanobind_version": nanobind.__version__,
    "nanobind_include": nanobind.include_dir(),
    "nanobind_src": nanobind.source_dir(),
    "robin_map_include": os.path.join(nb_root, "ext", "robin_map", "include"),
    "xla_ffi_include": jax.ffi.include_dir(),
    "nanobind_srcs": ",".join(srcs),
}
for k, v in info.items():
  print("%s=%s" % (k, v))
"""

def _fail(msg):
    fail("local_python: " + msg)

def find_python(rctx):
    """The interpreter: $JAXVT_PYTHON, else python3 (then python) on PATH."""
    python = rctx.os.environ.get("JAXVT_PYTHON", "")
    if not python:
        found = rctx.which("python3") or rctx.which("python")
        if not found:
            fail("%s: no python3 on PATH; set --repo_env=JAXVT_PYTHON=/path/to/python3" % rctx.name)
        python = str(found)
    return python

def _local_python_impl(rctx):
    python = find_python(rctx)
    res = rctx.execute([python, "-c", _PROBE], timeout = 120, quiet = True)
    if res.return_code != 0:
        _fail("running %s failed (it needs nanobind and jax installed):\n%s%s" %
              (python, res.stdout, res.stderr))
    info = {}
    for line in res.stdout.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            info[k.strip()] = v.strip()
    for k in ["python", "version", "python_include", "nanobind_version", "nanobind_include",
              "nanobind_src", "robin_map_include", "xla_ffi_include", "nanobind_srcs"]:
        if not info.get(k):
            _fail("the probe did not report %s:\n%s%s" % (k, res.stdout, res.stderr))

    for key, dst in [
        ("python_include", "python_include"),
        ("nanobind_include", "nanobind_include"),
        ("nanobind_src", "nanobind_src"),
        ("robin_map_include", "robin_map_include"),
        ("xla_ffi_include", "xla_ffi_include"),
    ]:
        src = rctx.path(info[key])
        if not src.exists:
            _fail("%s (%s) does not exist" % (key, info[key]))
        rctx.symlink(src, dst)

    rctx.template("BUILD.bazel", rctx.attr._build_tpl, {
        "%{python}": info["python"],
        "%{version}": info["version"],
        "%{nanobind_version}": info["nanobind_version"],
        "%{nanobind_srcs}": repr(["nanobind_src/" + f for f in info["nanobind_srcs"].split(",")]),
    }, executable = False)
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    # For `bazel query`/humans: what was found.
    rctx.file("local_python.txt", "\n".join(["%s=%s" % (k, info[k]) for k in sorted(info.keys())]) + "\n")

local_python = repository_rule(
    implementation = _local_python_impl,
    attrs = {
        "_build_tpl": attr.label(default = Label("//tools/bazel:local_python.BUILD.tpl")),
    },
    environ = ["JAXVT_PYTHON", "PATH"],
    local = True,
)
