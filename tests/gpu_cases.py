"""What the GPU test files (tests/test_*_gpu.py) share: the first GPU JAX sees, and whether this
jaxvt build has kernels for its platform (else the files skip, with the reason); and the
`device` / `tier` fixtures that replace the CPU files' ones (import them after the CPU file's
tests)."""

from __future__ import annotations

import jax
import pytest

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


@pytest.fixture(scope="module")
def device():
  return GPU


@pytest.fixture(scope="module")
def tier():
  """A host tier in pinned, device-mapped memory."""
  from jaxvt.offload.host_tier import HostTier
  with HostTier(backend="gpu") as t:
    yield t
