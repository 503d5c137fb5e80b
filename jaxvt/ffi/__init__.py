"""jaxvt's XLA FFI kernels over GGUF block formats.

The compiled extension `jaxvt.ffi._jaxvt_ffi` holds the handlers (platform "cpu" always, "CUDA"
or "ROCM" when built with a GPU toolchain), the host-tier allocator and the bandwidth probes.
`jaxvt.ffi.ops` has the ops and their jnp references; importing it registers the handlers with
JAX once (`register()`, idempotent). Nothing here is imported by `import jaxvt`.
"""

from __future__ import annotations

import functools
import threading
from types import ModuleType

import jax

TARGETS = ("jaxvt_qmatmul", "jaxvt_qmatmul_experts", "jaxvt_qembed", "jaxvt_qdequant",
           "jaxvt_qmatmul_q8", "jaxvt_qmatmul_experts_q8", "jaxvt_qmatmul_grouped",
           "jaxvt_moe_route", "jaxvt_gdn_step", "jaxvt_attn_step", "jaxvt_prefetch_fetch",
           "jaxvt_prefetch_take", "jaxvt_prefetch_join", "jaxvt_prefetch_experts",
           "jaxvt_prefetch_experts_inline")
# The targets a GPU build registers for its platform ("CUDA" or "ROCM").
GPU_TARGETS = ("jaxvt_qmatmul", "jaxvt_qmatmul_experts", "jaxvt_qembed", "jaxvt_qdequant",
               "jaxvt_qmatmul_grouped", "jaxvt_qmatmul_multi", "jaxvt_qmatmul_experts2",
               "jaxvt_qmatmul_q8", "jaxvt_qmatmul_experts_q8", "jaxvt_moe_route",
               "jaxvt_gdn_step", "jaxvt_attn_step", "jaxvt_prefetch_fetch", "jaxvt_prefetch_take",
               "jaxvt_prefetch_join", "jaxvt_prefetch_experts", "jaxvt_prefetch_experts_inline")
_lock = threading.Lock()
_registered: set[str] = set()


@functools.cache
def extension() -> ModuleType | None:
  """The compiled extension module, or None when jaxvt was installed without it."""
  try:  # built by pip install; a source checkout without a build runs the jnp references
    from jaxvt.ffi import _jaxvt_ffi
  except ImportError:
    return None
  return _jaxvt_ffi


def _platform_key(platform: str) -> str:
  p = platform.lower()
  if p in ("cuda", "gpu"):
    return "CUDA"
  if p in ("rocm", "hip"):
    return "ROCM"
  return p


def available(platform: str = "cpu") -> bool:
  """Whether kernels exist for `platform` ("cpu", "cuda"/"gpu", "rocm"; any case)."""
  ext = extension()
  return ext is not None and _platform_key(platform) in ext.registrations()


def register() -> tuple[str, ...]:
  """Registers every handler the extension has with JAX (once); returns the platforms done."""
  ext = extension()
  if ext is None:
    return ()
  with _lock:
    for platform, targets in ext.registrations().items():
      if platform in _registered:
        continue
      for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
      _registered.add(platform)
    return tuple(sorted(_registered))
