"""jaxvt: GGUF language models as pure JAX functions, larger than the accelerator they run on.

    engine = jaxvt.load(path, offload_gb=4)     # open -> plan -> place -> Engine, with defaults
    model = jaxvt.open_model(path)              # or the steps one by one (jaxvt.engine)
    par = jaxvt.layout(model.cfg)               # one device: the 1 x 1 mesh
    placed = jaxvt.plan(model, offload_gb=4, mesh=par)
    weights = jaxvt.place(model, placed, par, host=...)

These names are imported on first use, so that `python -m jaxvt.run` can report a bad flag or
file without starting JAX.
"""

import importlib

from jaxvt.errors import JaxvtError  # noqa: F401

__version__ = "0.1.0"
_LAZY = {"load": "jaxvt.engine", "Engine": "jaxvt.engine", "open_model": "jaxvt.engine",
         "layout": "jaxvt.engine", "plan": "jaxvt.engine", "place": "jaxvt.engine",
         "SamplingParams": "jaxvt.sampling"}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'jaxvt' has no attribute {name!r}")
