"""Probe: cache format, rates from it, managed-memory verdict, guarded extension import."""

import json
import sys
import types

import pytest

from jaxvt.errors import JaxvtError
from jaxvt.offload import cost as C
from jaxvt.offload import probe


def test_cache_path(monkeypatch, tmp_path):
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  assert probe.cache_path("cuda", "NVIDIA H200") == tmp_path / ".cache/jaxvt/probe-cuda-NVIDIA_H200.json"
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # as the compilation cache
  assert probe.cache_path("cuda", "NVIDIA H200") == tmp_path / "xdg/jaxvt/probe-cuda-NVIDIA_H200.json"
  assert probe.cache_path("ROCM", "AMD Radeon RX 9060 XT", tmp_path).name == \
      "probe-rocm-AMD_Radeon_RX_9060_XT.json"
  assert probe.cache_path("cpu", "").name == "probe-cpu-unknown.json"


def test_load_rates_defaults_without_cache(tmp_path):
  r = probe.load_rates(platform="cuda", device_kind="NVIDIA H200", path=tmp_path / "none.json")
  assert r == C.default_rates("cuda") and r.source.startswith("default")
  (tmp_path / "bad.json").write_text("{not json")
  assert probe.load_rates(platform="rocm", path=tmp_path / "bad.json").source.startswith("default")


def test_round_trip_uses_gemv_rate_not_streaming(tmp_path):
  res = probe.ProbeResult("cuda", "NVIDIA H200", 1 << 30, dma_h2d_gbps=55.3, zero_copy_gbps=51.3,
                          host_gemv_gbps=40.0, device_gemv_gbps=1500.0, managed_first_gbps=7.0,
                          managed_repeat_gbps=4000.0, managed_migrates=True, notes=("x",))
  path = tmp_path / "p.json"
  path.write_text(res.to_json())
  assert probe.ProbeResult.from_json(path.read_text()) == res
  assert json.loads(path.read_text())["version"] == probe.CACHE_VERSION
  r = probe.load_rates(platform="cuda", device_kind="NVIDIA H200", path=path)
  assert r.source.startswith("measured at an unknown time on NVIDIA H200: ") and str(path) in r.source
  assert (r.host_read_gbps, r.device_read_gbps, r.zero_copy_gbps) == (40.0, 1500.0, 51.3)
  assert r.managed_migrates is True
  # Without a GEMV arm the host rate is the platform default, never the streaming number.
  part = probe.ProbeResult("rocm", "gfx1200", 1 << 30, zero_copy_gbps=23.0)
  path.write_text(part.to_json())
  r = probe.load_rates(platform="rocm", device_kind="gfx1200", path=path)
  assert r.host_read_gbps == C.default_rates("rocm").host_read_gbps == 8.0
  assert "defaults for host GEMV" in r.source


def test_managed_verdict():
  assert probe.managed_migrates(7.0, 4000.0, 55.3) is True  # H200
  assert probe.managed_migrates(7.64, 7.77, 23.0) is False  # gfx1200: flat
  assert probe.managed_migrates(7.64, 7.77, None) is False
  assert probe.managed_migrates(5.0, 300.0, None) is True


class FakeExt(types.ModuleType):
  def __init__(self, managed):
    super().__init__("jaxvt.ffi._jaxvt_ffi")
    self.managed = managed
    self.calls = []

  def measure_dma_h2d(self, nbytes, iters):
    self.calls.append(("dma", nbytes, iters))
    return 55.0

  def measure_zero_copy_read(self, nbytes, iters):
    return 50.0

  def measure_managed(self, nbytes):
    return self.managed


def test_run_probe_with_fake_extension(monkeypatch, tmp_path):
  ext = FakeExt((7.0, 4000.0))
  monkeypatch.setitem(sys.modules, "jaxvt.ffi._jaxvt_ffi", ext)
  monkeypatch.setitem(sys.modules, "jaxvt.ffi._jaxvt_debug", ext)  # the link probes
  monkeypatch.setattr(probe, "time_qmatmul", lambda w, iters: 123.0)
  monkeypatch.setattr(probe, "platform_of", lambda device: "cuda")  # a link to measure
  closed = []
  r = probe.run_probe(nbytes=1 << 16, iters=2,
                      make_host_weight=lambda n: ("host weight", lambda: closed.append(n)))
  assert ext.calls == [("dma", 1 << 16, 2)] and closed == [1 << 16]
  assert (r.platform, r.dma_h2d_gbps, r.zero_copy_gbps) == ("cuda", 55.0, 50.0)
  assert r.measured_at.endswith(" UTC")
  assert (r.host_gemv_gbps, r.device_gemv_gbps, r.managed_migrates) == (123.0, 123.0, True)
  monkeypatch.setitem(sys.modules, "jaxvt.ffi._jaxvt_debug", None)  # no probes: a note, no rates
  r = probe.run_probe(nbytes=1 << 16, iters=2,
                      make_host_weight=lambda n: ("host weight", lambda: closed.append(n)))
  assert r.dma_h2d_gbps is None and r.zero_copy_gbps is None and r.host_gemv_gbps == 123.0
  assert any("no measurement module" in n for n in r.notes)
  monkeypatch.setitem(sys.modules, "jaxvt.ffi._jaxvt_ffi", FakeExt(None))
  monkeypatch.setitem(sys.modules, "jaxvt.ffi._jaxvt_debug", sys.modules["jaxvt.ffi._jaxvt_ffi"])

  def no_ops(w, iters):
    raise ImportError("No module named 'jaxvt.ffi.ops'")

  monkeypatch.setattr(probe, "time_qmatmul", no_ops)
  r = probe.run_probe(nbytes=1 << 16, iters=2)  # the fake has no host_alloc either
  assert r.managed_migrates is None and r.host_gemv_gbps is None
  assert any("no managed allocator" in n for n in r.notes)
  assert any("host GEMV not measured" in n and "not the streaming rate" in n for n in r.notes)
  assert any(n.startswith("device GEMV not measured (ImportError") for n in r.notes)
  out = tmp_path / "c.json"
  assert probe.main(["--bytes", "65536", "--iters", "1", "--cache", str(out)]) == 0
  assert probe.ProbeResult.from_json(out.read_text()).zero_copy_gbps == 50.0


def test_cpu_backend_has_no_link_and_prints_a_table(monkeypatch, tmp_path, capsys):
  """On the CPU backend the link arms are not run (a memcpy timed as DMA read 17,573,515 GB/s);
  the table says there is no link, and the GEMV rates the cost model uses are still measured."""
  import ctypes
  ext = FakeExt((7.0, 4000.0))
  buf = ctypes.create_string_buffer(1 << 16)
  ext.host_alloc = lambda n, coherent, gpu: (ctypes.addressof(buf), ctypes.addressof(buf))
  ext.host_free = lambda address, gpu: None
  monkeypatch.setitem(sys.modules, "jaxvt.ffi._jaxvt_ffi", ext)
  monkeypatch.setattr(probe, "time_qmatmul", lambda w, iters: 12.5)
  monkeypatch.setattr(probe, "time_launch", lambda device: 3.0)
  out = tmp_path / "c.json"
  assert probe.main(["--bytes", "65536", "--iters", "1", "--cache", str(out)]) == 0
  text = capsys.readouterr().out
  assert ext.calls == []
  r = probe.ProbeResult.from_json(out.read_text())
  assert r.dma_h2d_gbps is r.zero_copy_gbps is r.managed_migrates is None
  assert probe.NO_LINK in r.notes and r.host_gemv_gbps == 12.5
  lines = text.splitlines()
  assert lines[0].startswith("probe of ") and "(cpu)" in lines[0] and "UTC" in lines[0]
  assert "no link (CPU)" in next(l for l in lines if "(DMA)" in l)
  assert "12.5 GB/s" in next(l for l in lines if "host tier" in l)
  assert not text.lstrip().startswith("{")
  r2 = probe.load_rates(platform="cpu", path=out)
  assert r2.source.startswith(f"measured {r.measured_at} on ") and str(out) in r2.source
  assert probe.main(["--bytes", "65536", "--iters", "1", "--cache", str(out), "--json"]) == 0
  assert json.loads(capsys.readouterr().out.split("\ncached at")[0])["host_gemv_gbps"] == 12.5


def test_missing_extension_is_a_clear_error(monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "jaxvt.ffi._jaxvt_ffi", None)  # import raises ImportError
  with pytest.raises(JaxvtError, match="needs jaxvt's compiled extension"):
    probe.run_probe(nbytes=1 << 16)
  assert probe.main(["--bytes", "65536"]) == 2
  assert "compiled extension" in capsys.readouterr().err


def test_device_facts_on_cpu():
  with pytest.raises(JaxvtError, match="--device-gb"):
    probe.device_facts()  # the CPU device reports no memory limit
  f = probe.device_facts(device_gb=2)
  assert f.capacity_bytes == 2 << 30 and f.platform == "cpu"


def test_host_qweight_layout():
  import ctypes

  import numpy as np

  from jaxvt.qweight import HOST_BIT

  buf = ctypes.create_string_buffer(b"\xff" * (4 * 2304))
  addr = ctypes.addressof(buf)
  freed = []
  ext = types.SimpleNamespace(host_alloc=lambda n, coherent, gpu: (addr, addr + (1 << 40)),
                              host_free=lambda h, gpu: freed.append((h, gpu)))
  w, close = probe.host_qweight(4 * 2304, ext, gpu=True)  # 4 rows of 4096 Q4_K = 2304 B each
  assert w.meta.rows == 4 and w.meta.host_layers == (0,) and w.meta.formats == (12,)
  assert int(np.asarray(w.fmts)[0]) == 12 | HOST_BIT
  lo, hi = (int(v) for v in np.asarray(w.table)[0])
  assert lo | hi << 32 == addr + (1 << 40)  # the device-readable address
  assert buf.raw[:4 * 2304] == bytes(4 * 2304)  # zero-filled: valid blocks in every format
  close()
  assert freed == [(addr, True)]
