"""What the GPU test files (tests/test_*_gpu.py) share: the first GPU JAX sees, and whether this
jaxvt build has kernels for its platform (else the files skip, with the reason)."""

from __future__ import annotations

import jax

from jaxvt import ffi


def _gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


GPU = _gpu()
REASON = ("JAX sees no GPU" if GPU is None else
          f"jaxvt was built without {GPU.platform} kernels (rebuild with JAXVT_GPU=CUDA or HIP)")
OK = GPU is not None and ffi.available(GPU.platform)
