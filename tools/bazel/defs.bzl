"""Bazel macros of jaxvt (see docs/BAZEL.md): jaxvt_py_test, one tests/test_*.py file run by
pytest; jaxvt_nanobind_module, one of the extension's nanobind modules."""

def jaxvt_py_test(name, src, helpers = [], data = [], pytest_args = [], **kwargs):
    """A py_test that runs `pytest <src>` on the local interpreter against the Bazel-built jaxvt.

    Args:
      name: target name.
      src: the test file, e.g. "tests/test_quants.py".
      helpers: other Python files the test imports (fixtures modules next to it).
      data: data files the test reads (recordings under tests/reference, notebooks ...).
      pytest_args: extra pytest arguments.
      **kwargs: passed to py_test (size, timeout, tags, ...).
    """
    native.py_test(
        name = name,
        srcs = ["//tools/bazel:pytest_main.py", src] + helpers,
        main = "//tools/bazel:pytest_main.py",
        args = ["$(location %s)" % src] + pytest_args,
        data = ["//:pyproject.toml"] + data,
        deps = [
            "//:jaxvt",
            "//tools/bazel:jaxvt_tree_guard",
        ],
        # No generated __init__.py files: tests/ is not a package (pytest's rootdir-relative
        # "prepend" import mode puts tests/ on sys.path, so test files import their fixtures
        # modules by bare name, as under `pytest` at the top level).
        legacy_create_init = False,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )


def jaxvt_nanobind_module(name, srcs, x86_srcs, copts, x86_copts, hdrs, data = [], deps = []):
    """A nanobind module `<name>.so` as CMake's nanobind_add_module(... NB_STATIC ...) builds it.

    The AVX2 units (x86_srcs, compiled with x86_copts as well) form a library `<basename>_x86`
    linked in on x86-64 (the ":x86_64" config_setting of the calling package).

    Args:
      name: the module's path without ".so", e.g. "jaxvt/ffi/_jaxvt_ffi".
      srcs: its sources.
      x86_srcs: its x86-64-only sources.
      copts: every unit's flags (may be a select).
      x86_copts: the x86-64-only units' own flags.
      hdrs: the headers the sources include.
      data: passed to the cc_binary.
      deps: passed to both (beyond nanobind and CPython's headers).
    """
    x86 = name.split("/")[-1].lstrip("_") + "_x86"
    native.cc_library(
        name = x86,
        srcs = x86_srcs + hdrs,
        copts = copts + x86_copts,
        linkstatic = True,
        alwayslink = True,
        deps = deps,
    )
    native.cc_binary(
        name = name + ".so",
        srcs = srcs + hdrs,
        copts = copts,
        data = data,
        linkopts = [
            "-pthread",
            "-Wl,-s",
            "-Wl,--gc-sections",
        ],
        linkshared = True,
        deps = [
            "@local_python//:nanobind",
            "@local_python//:python_headers",
        ] + deps + select({
            ":x86_64": [":" + x86],
            "//conditions:default": [],
        }),
    )
