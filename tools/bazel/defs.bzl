"""jaxvt_py_test: one tests/test_*.py file run by pytest under Bazel (see docs/BAZEL.md)."""

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
