"""pyproject.toml against what README tells a user to run: `pip install --no-build-isolation`
after `pip install -e '.[build]'` finds every package the build needs."""

import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _names(requirements) -> set[str]:
  return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-")
          for r in requirements}


def test_the_build_extra_brings_what_the_build_requires():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    pyproject = tomllib.load(f)
  build = _names(pyproject["project"]["optional-dependencies"]["build"])
  assert _names(pyproject["build-system"]["requires"]) <= build
  assert {"cmake", "ninja"} <= build  # found in the environment only without isolation
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  assert "pip install --no-build-isolation -e" in readme and "'.[build]'" in readme
