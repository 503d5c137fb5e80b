"""Repository rule `cmake_lists`: the extension's sources and flags, read from CMakeLists.txt.

Generates @jaxvt_cmake//:sources.bzl (FFI_SRCS, FFI_COPTS, FFI_X86_SRCS, FFI_X86_COPTS, ...) by
running tools/bazel/cmake_sources.py on CMakeLists.txt with the local interpreter, so that the
Bazel build compiles exactly the sources, with the target flags, that the pip/CMake build does.
Both files are label attributes: Bazel re-runs the rule when either changes. The rule fails, naming
the CMake command, when CMakeLists.txt uses something the reader does not understand.
"""

load("//tools/bazel:local_python.bzl", "find_python")

def _cmake_lists_impl(rctx):
    python = find_python(rctx)
    cmakelists = rctx.path(rctx.attr.cmakelists)
    script = rctx.path(rctx.attr._script)
    res = rctx.execute([python, str(script), str(cmakelists)], timeout = 60, quiet = True)
    if res.return_code != 0:
        fail("@%s: reading %s failed:\n%s%s" % (rctx.name, cmakelists, res.stdout, res.stderr))
    rctx.file("sources.bzl", res.stdout)
    rctx.file("BUILD.bazel", "exports_files([\"sources.bzl\"])\n")
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)

cmake_lists = repository_rule(
    implementation = _cmake_lists_impl,
    attrs = {
        "cmakelists": attr.label(default = Label("//:CMakeLists.txt"), allow_single_file = True),
        "_script": attr.label(default = Label("//tools/bazel:cmake_sources.py"), allow_single_file = True),
    },
    environ = ["JAXVT_PYTHON", "PATH"],
)
