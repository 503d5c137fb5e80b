"""jaxvt's XLA FFI kernels over GGUF block formats.

The compiled extension `jaxvt.ffi._jaxvt_ffi` holds the handlers (platform "cpu" always, "CUDA"
or "ROCM" when built with a GPU toolchain) and the host-tier allocator; its op table
(csrc/handlers/ops.inc) is the one list of custom-call targets, read here through
`registrations()` (`targets()`). The debug module `jaxvt.ffi._jaxvt_debug` holds the measurement
probes (`debug_extension()`). `jaxvt.ffi.ops` has the ops and their jnp references; importing it
registers the handlers with JAX once (`register()`, idempotent). Nothing here is imported by
`import jaxvt`.
"""

from __future__ import annotations

import functools
import threading
from types import ModuleType

import jax

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


@functools.cache
def debug_extension() -> ModuleType | None:
  """The debug module (measurement probes), or None when jaxvt was installed without it."""
  try:
    from jaxvt.ffi import _jaxvt_debug
  except ImportError:
    return None
  return _jaxvt_debug


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


def targets(platform: str | None = None) -> frozenset[str]:
  """The custom-call target names the extension registers for `platform` ("cpu", "cuda"/"gpu",
  "rocm"; any case), or for any platform when None; empty without the extension."""
  ext = extension()
  if ext is None:
    return frozenset()
  regs = ext.registrations()
  if platform is not None:
    return frozenset(regs.get(_platform_key(platform), {}))
  return frozenset(name for names in regs.values() for name in names)


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
