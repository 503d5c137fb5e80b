"""jaxvt: GGUF language models as pure JAX functions, larger than the accelerator they run on.

`jaxvt.load`, `jaxvt.Engine` and `jaxvt.SamplingParams` are imported on first use, so that
`python -m jaxvt.run` can report a bad flag or file without starting JAX.
"""

from jaxvt.errors import JaxvtError  # noqa: F401

__version__ = "0.1.0"
_LAZY = {"load": "jaxvt.engine", "Engine": "jaxvt.engine", "SamplingParams": "jaxvt.sampling"}


def __getattr__(name):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'jaxvt' has no attribute {name!r}")
