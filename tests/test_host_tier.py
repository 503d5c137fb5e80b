"""jaxvt.offload.host_tier: allocation, views, closing, failure, managed memory (CPU backend)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from jaxvt import ffi
from jaxvt.errors import JaxvtError

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="jaxvt's extension is not built (pip install -e .)")

if ffi.available("cpu"):
  from jaxvt.offload.host_tier import HostTier, managed_alloc


def test_alloc_gives_writable_aligned_view():
  with HostTier(backend="cpu") as tier:
    buf = tier.alloc(10_000)
    assert buf.array.dtype == np.uint8 and buf.array.shape == (10_000,)
    assert buf.array.flags.writeable
    assert buf.device_address % 4096 == 0 and buf.device_address == buf.host_address
    buf.array[:] = np.arange(10_000) % 251
    again = np.frombuffer((__import__("ctypes").c_uint8 * 10_000).from_address(buf.host_address),
                          np.uint8)
    np.testing.assert_array_equal(again, np.arange(10_000) % 251)
    other = tier.alloc(1)
    assert other.device_address != buf.device_address
    assert tier.nbytes == 10_001
  assert tier.closed


def test_close_is_idempotent_and_frees_everything():
  tier = HostTier(backend="cpu")
  bufs = [tier.alloc(4096 * (i + 1)) for i in range(3)]
  tier.close()
  tier.close()
  assert tier.closed and tier.nbytes == 0
  for b in bufs:
    assert b.closed
    with pytest.raises(JaxvtError, match="freed"):
      b.array
  with pytest.raises(JaxvtError, match="closed"):
    tier.alloc(10)


def test_context_manager_closes_on_error():
  with pytest.raises(RuntimeError):
    with HostTier(backend="cpu") as tier:
      buf = tier.alloc(100)
      raise RuntimeError("boom")
  assert tier.closed and buf.closed


def test_garbage_collection_frees():
  tier = HostTier(backend="cpu")
  buf = tier.alloc(1 << 20)
  ref = weakref.ref(tier)
  del tier
  gc.collect()
  assert ref() is None and buf.closed


def test_allocation_failure_is_one_line_error_and_leaks_nothing():
  with HostTier(backend="cpu") as tier:
    ok = tier.alloc(64)
    with pytest.raises(JaxvtError) as err:
      tier.alloc(1 << 62)
    msg = str(err.value)
    assert "\n" not in msg and "host memory" in msg and "offload less" in msg
    assert tier.nbytes == 64 and not ok.closed
    with pytest.raises(JaxvtError, match="positive"):
      tier.alloc(0)


def test_backend_choice():
  ext = ffi.extension()
  tier = HostTier()
  try:
    want = "gpu" if ext.gpu_platform() and ext.gpu_device_count() > 0 else "cpu"
    assert tier.backend == want
  finally:
    tier.close()
  with pytest.raises(JaxvtError, match="backend"):
    HostTier(backend="disk")
  if not ext.gpu_platform():
    with pytest.raises(JaxvtError, match="GPU"):
      HostTier(backend="gpu")


def test_managed_alloc_is_none_without_a_gpu():
  if ffi.extension().gpu_device_count() > 0:
    pytest.skip("a GPU is present: managed memory exists")
  assert managed_alloc(1 << 20) is None


def test_measurement_primitives_on_cpu():
  ext = ffi.extension()
  if ext.gpu_device_count() > 0:
    pytest.skip("GPU build with a device: measured on the GPU")
  probes = ffi.debug_extension()
  assert probes.measure_dma_h2d(1 << 20, 2) > 0.1
  assert probes.measure_zero_copy_read(1 << 20, 2) > 0.1
  assert probes.measure_managed(1 << 20) is None


def test_host_kinds_on_the_cpu_backend():
  """The benchmarks' allocation kinds (benchmarks.arms.KindTier) through the same tier."""
  from benchmarks.arms import KindTier
  with KindTier("huge_pages", backend="cpu") as tier:
    assert tier.kind == "huge_pages"
    buf = tier.alloc(3 << 20)
    assert buf.host_address % (2 << 20) == 0 and buf.device_address == buf.host_address
    buf.array[:] = 5
    assert int(buf.array[::4096].sum()) == 5 * len(buf.array[::4096])
  with pytest.raises(JaxvtError, match="write-combined host memory exists only for a GPU"):
    KindTier("write_combined", backend="cpu")
  with pytest.raises(JaxvtError, match="kind must be one of pinned, write_combined, huge_pages"):
    KindTier("mapped", backend="cpu")
