"""Measured read rates of the current device, cached per device: `python -m jaxvt.offload.probe`.

Arms (GB/s = 1e9 bytes/s):
  dma_h2d       pinned host -> device copy (the link's practical ceiling)
  zero_copy     a kernel streaming host memory in place
  host_gemv     jaxvt's qmatmul reading a host-tier QWeight: the host tier's rate, the one the
                cost model uses (a streaming read can overstate it ~3x: jaxvt.offload.cost)
  device_gemv   the same kernel reading a device-tier QWeight
  managed       first and repeated device reads of managed memory: it migrates when the repeat
                runs faster than the link can deliver (on some GPUs it does, on others the
                rate stays flat)

The first three and `managed` call the nanobind extension `jaxvt.ffi._jaxvt_ffi`; this module
imports without it and says at run time what is missing. On the CPU backend host and "device"
memory are the same DRAM: there is no link, so the DMA, streaming and managed arms are not run
(a host-to-host memcpy timed as "DMA" reads petabytes per second) and a note says so. Results
are cached as JSON, with the time they were taken, at
`~/.cache/jaxvt/probe-<platform>-<device_kind>.json` (`$XDG_CACHE_HOME/jaxvt/...` where set); `load_rates` returns them, or the
platform's defaults when there is no cache, and `Rates.source` says which, and when.
`python -m jaxvt.offload.probe` prints a table (`--json`: the cache's JSON).
This is the one module of jaxvt.offload that touches a JAX device.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import importlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import inputs
from jaxvt.errors import JaxvtError
from jaxvt.ffi import ops
from jaxvt.ffi.numerics import default_mode
from jaxvt.gguf.formats import Q4_K, row_bytes
from jaxvt.offload import cost
from jaxvt.offload.memory import DeviceFacts
from jaxvt.programs import default_cache_root
from jaxvt.qweight import HOST_BIT, QMeta, QWeight, split_u64

CACHE_VERSION = 1


def platform_of(device) -> str:
  """The device's platform ("cpu", "cuda", "rocm")."""
  p = str(getattr(device, "platform", "cpu")).lower()
  if p == "gpu":  # older jaxlibs: tell CUDA from ROCm by the client's version string
    client = getattr(device, "client", None)
    p = "rocm" if "rocm" in str(getattr(client, "platform_version", "")).lower() else "cuda"
  return p


def cache_path(platform: str, device_kind: str, cache_dir: str | os.PathLike | None = None) -> Path:
  """`<cache_dir or $XDG_CACHE_HOME/jaxvt or ~/.cache/jaxvt>/probe-<platform>-<device_kind>.json`
  (kind made file-safe): the compilation cache's root (jaxvt.programs.default_cache_root)."""
  kind = re.sub(r"[^A-Za-z0-9._-]+", "_", device_kind).strip("_") or "unknown"
  base = Path(cache_dir if cache_dir is not None else default_cache_root())
  return base / f"probe-{platform.lower()}-{kind}.json"


@dataclasses.dataclass(frozen=True)
class ProbeResult:
  platform: str
  device_kind: str
  nbytes: int
  dma_h2d_gbps: float | None = None
  zero_copy_gbps: float | None = None
  host_gemv_gbps: float | None = None
  device_gemv_gbps: float | None = None
  managed_first_gbps: float | None = None
  managed_repeat_gbps: float | None = None
  managed_migrates: bool | None = None  # None: no managed allocator on this build/device
  launch_us: float | None = None
  notes: tuple[str, ...] = ()
  measured_at: str | None = None  # when run_probe ran: "YYYY-MM-DD HH:MM UTC"

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    d["notes"] = list(self.notes)
    d["version"] = CACHE_VERSION
    return json.dumps(d, indent=1, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "ProbeResult":
    d = json.loads(text)
    if d.pop("version", None) != CACHE_VERSION:
      raise ValueError("probe cache from another version")
    d["notes"] = tuple(d.get("notes", ()))
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def managed_migrates(first_gbps: float, repeat_gbps: float, link_gbps: float | None) -> bool:
  """Managed memory migrated when repeated reads beat what the link can carry (from device
  memory) by a clear margin; without a link figure, when the repeat is 4x the first touch."""
  if link_gbps:
    return repeat_gbps > 1.5 * link_gbps
  return repeat_gbps > 4.0 * first_gbps


def rates_from_probe(r: ProbeResult, source: str) -> cost.Rates:
  """Rates for the cost model: measured where the probe measured, platform default elsewhere.

  The host rate is the host-tier GEMV rate only; a missing one falls back to the platform
  default, never to the streaming or DMA number.
  """
  d = cost.default_rates(r.platform)
  defaulted = [n for n, v in (("host GEMV", r.host_gemv_gbps), ("device GEMV", r.device_gemv_gbps),
                              ("launch", r.launch_us)) if not v]
  note = f"; defaults for {', '.join(defaulted)}" if defaulted else ""
  when = r.measured_at or "at an unknown time"
  return cost.Rates(
      platform=r.platform, device_read_gbps=r.device_gemv_gbps or d.device_read_gbps,
      host_read_gbps=r.host_gemv_gbps or d.host_read_gbps, launch_us=r.launch_us or d.launch_us,
      dma_h2d_gbps=r.dma_h2d_gbps, zero_copy_gbps=r.zero_copy_gbps,
      managed_migrates=r.managed_migrates,
      source=f"measured {when} on {r.device_kind or r.platform}: python -m jaxvt.offload.probe, "
             f"cached in {source}{note}",
      op_us=d.op_us, step_ms=d.step_ms)


def load_rates(device=None, *, platform: str | None = None, device_kind: str | None = None,
               path: str | os.PathLike | None = None) -> cost.Rates:
  """Cached probe rates for `device` (or platform/device_kind), else the platform defaults.

  Reads a file only; never measures. `Rates.source` starts with "measured" or "default".
  """
  if platform is None:
    platform = platform_of(device) if device is not None else "cpu"
  if device_kind is None:
    device_kind = str(getattr(device, "device_kind", "")) if device is not None else ""
  p = Path(path) if path is not None else cache_path(platform, device_kind)
  try:
    r = ProbeResult.from_json(p.read_text(encoding="utf-8"))
  except (OSError, ValueError, TypeError, KeyError):
    return cost.default_rates(platform)
  return rates_from_probe(r, str(p))


def device_facts(device=None, device_gb: float | None = None) -> DeviceFacts:
  """DeviceFacts of a JAX device (`memory_stats()['bytes_limit']`), or from --device-gb."""
  device = device if device is not None else jax.devices()[0]
  stats = device.memory_stats() if device_gb is None else None
  return DeviceFacts.from_memory_stats(stats, platform_of(device), str(device.device_kind),
                                       device_gb)


# ----------------------------------------------------------------------------------------------
# Measurement (needs the extension and a device)


def _extension():
  try:  # the compiled extension is optional: say what is missing when a measurement needs it
    _jaxvt_ffi = importlib.import_module("jaxvt.ffi._jaxvt_ffi")  # honours sys.modules
  except ImportError as e:
    raise JaxvtError("the probe needs jaxvt's compiled extension jaxvt.ffi._jaxvt_ffi, which is "
                     f"not importable ({e}); build it with JAXVT_GPU=CUDA (or HIP) pip install -e "
                     ".") from None
  return _jaxvt_ffi


def _probes():
  """The extension's debug module (the link probes), or None where it was not built."""
  try:
    return importlib.import_module("jaxvt.ffi._jaxvt_debug")  # honours sys.modules
  except ImportError:
    return None


def time_qmatmul(w, iters: int = 20) -> float:
  """GB/s of `jaxvt.ffi.ops.qmatmul` reading the single layer of QWeight `w` at batch 1."""
  m = w.meta
  nbytes = max(m.experts, 1) * m.rows * row_bytes(m.formats[0], m.cols)
  mode = default_mode(w.data.devices().pop().platform)
  f = jax.jit(lambda x, w: ops.qmatmul(x, w, jnp.int32(0), mode))
  x = jnp.ones((1, m.cols), jnp.float32)
  f(x, w).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(iters):
    y = f(x, w)
  y.block_until_ready()
  return nbytes * iters / (time.perf_counter() - t0) / 1e9


def time_launch(device=None, steps: int = 256, reps: int = 5) -> float:
  """Microseconds per device kernel inside a jitted layer scan: each step runs one small matrix
  call (64 x 1024 Q4_K) and the elementwise fusion that consumes it, as a decode step's many
  small kernels do; the best of `reps` runs over `steps` steps, per kernel."""
  w = device_qweight(64 * 576, cols=1024, device=device)
  mode = default_mode(w.data.devices().pop().platform)

  @jax.jit
  def run(x):
    def body(x, _):
      return x + ops.qmatmul(x, w, jnp.int32(0), mode).sum(), None
    return jax.lax.scan(body, x, None, length=steps)[0]

  x = jax.device_put(jnp.zeros((1, 1024), jnp.float32), device)
  run(x).block_until_ready()
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    run(x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return best / (2 * steps) * 1e6


def device_qweight(nbytes: int, cols: int = 4096, type_id: int = Q4_K, device=None):
  """A one-layer, all-device QWeight of about `nbytes` (zero blocks: valid in every format)."""
  rb = row_bytes(type_id, cols)
  rows = max(1, nbytes // rb)
  put = lambda a: jax.device_put(a, device)
  return QWeight(put(np.zeros((1, rows * rb), np.uint8)), put(np.zeros((1, 2), np.uint32)),
                 put(np.full((1,), type_id, np.int32)), QMeta(rows, cols, 0, (type_id,), 1))


def host_qweight(nbytes: int, ext, gpu: bool, cols: int = 4096, type_id: int = Q4_K, device=None):
  """A one-layer QWeight of about `nbytes` whose layer lives in host-tier memory allocated by the
  extension (`host_alloc`: pinned and device-mapped with `gpu`), zero-filled; returns
  (weight, close) where close() frees the memory."""
  rb = row_bytes(type_id, cols)
  rows = max(1, nbytes // rb)
  host, dev_addr = ext.host_alloc(rows * rb, False, gpu)
  ctypes.memset(host, 0, rows * rb)
  put = lambda a: jax.device_put(a, device)
  w = QWeight(put(np.zeros((1, 1), np.uint8)), put(split_u64([dev_addr])),
              put(np.full((1,), type_id | HOST_BIT, np.int32)),
              QMeta(rows, cols, 0, (type_id,), 1, host_layers=(0,)))
  return w, lambda: ext.host_free(host, gpu)


# What a failing GEMV arm may raise (missing Python ops, an unsupported platform, XLA errors).
_ARM_ERRORS = (ImportError, AttributeError, JaxvtError, RuntimeError, NotImplementedError,
               ValueError)


def _why(e: BaseException) -> str:
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def run_probe(device=None, nbytes: int = 1 << 30, iters: int = 10,
              make_host_weight: Callable[[int], tuple[object, Callable[[], None]]] | None = None
              ) -> ProbeResult:
  """Measures every arm on `device`; an arm that cannot run is None, with a note saying why.

  `make_host_weight(nbytes) -> (QWeight, close)`: a one-layer weight in the host tier; default
  `host_qweight` on the extension's allocator.
  """
  device = device if device is not None else jax.devices()[0]
  platform = platform_of(device)
  ext = _extension()
  notes = []
  kw = {"measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
  if platform == "cpu":
    notes.append(NO_LINK)
  elif (probes := _probes()) is None:
    notes.append("no measurement module (jaxvt.ffi._jaxvt_debug): the link's rates are not "
                 "measured; rebuild the extension to measure them")
  else:
    kw["dma_h2d_gbps"] = float(probes.measure_dma_h2d(nbytes, iters))
    kw["zero_copy_gbps"] = float(probes.measure_zero_copy_read(nbytes, iters))
    managed = probes.measure_managed(nbytes)
    if managed is None:
      notes.append("no managed allocator: placement never uses managed memory")
    else:
      first, repeat = (float(v) for v in managed)
      kw.update(managed_first_gbps=first, managed_repeat_gbps=repeat,
                managed_migrates=managed_migrates(first, repeat, kw["dma_h2d_gbps"]))
  gemv_bytes = min(nbytes, 256 << 20)
  try:
    kw["device_gemv_gbps"] = time_qmatmul(device_qweight(gemv_bytes, device=device), iters * 5)
  except _ARM_ERRORS as e:
    notes.append(f"device GEMV not measured ({_why(e)})")
  try:
    kw["launch_us"] = time_launch(device)
  except _ARM_ERRORS as e:
    notes.append(f"kernel cost not measured ({_why(e)})")
  if make_host_weight is None:
    gpu = platform in ("cuda", "rocm")
    make_host_weight = lambda n: host_qweight(n, ext, gpu, device=device)
  try:
    w, close = make_host_weight(gemv_bytes)
    try:
      kw["host_gemv_gbps"] = time_qmatmul(w, iters)
    finally:
      close()
  except _ARM_ERRORS as e:
    notes.append(f"host GEMV not measured ({_why(e)}): the cost model uses the platform "
                 "default, not the streaming rate")
  return ProbeResult(platform, str(device.device_kind), nbytes, notes=tuple(notes), **kw)


NO_LINK = ("the CPU backend reads host memory as its device memory: there is no host-device "
           "link to measure (no DMA, streaming or managed-memory rate)")


def format_table(r: ProbeResult) -> str:
  """The probe's result as a few aligned lines: what was read, how fast, and what it is for."""
  def rate(v: float | None) -> str:
    return f"{v:10.1f} GB/s" if v is not None else "  not measured"

  link = "  no link (CPU)" if r.platform == "cpu" else None
  managed = ("  not measured" if r.managed_first_gbps is None else
             f"{r.managed_first_gbps:.1f} then {r.managed_repeat_gbps:.1f} GB/s ("
             f"{'migrates' if r.managed_migrates else 'stays in host memory'})")
  rows = [("pinned host -> device copy (DMA)", link or rate(r.dma_h2d_gbps)),
          ("kernel streaming host memory", link or rate(r.zero_copy_gbps)),
          ("managed memory, first then repeated read", link or managed),
          ("matrix kernel reading the host tier", rate(r.host_gemv_gbps) + "  (cost model: host)"),
          ("matrix kernel reading device memory",
           rate(r.device_gemv_gbps) + "  (cost model: device)"),
          ("one small kernel call", f"{r.launch_us:10.1f} us" if r.launch_us is not None
           else "  not measured")]
  size = (f"{r.nbytes / 2**30:.2f} GiB" if r.nbytes >= 2**30 else f"{r.nbytes / 2**20:.1f} MiB")
  lines = [f"probe of {r.device_kind or r.platform} ({r.platform}), {size} buffers, measured "
           f"{r.measured_at or 'at an unknown time'}"]
  lines += [f"  {name:<42}{value}" for name, value in rows]
  lines += [f"  note: {n}" for n in r.notes]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jaxvt.offload.probe", description=__doc__.split(
      "\n")[0])
  ap.add_argument("--bytes", type=int, default=1 << 30, help="buffer size per arm")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--cache", default=None, help="cache file (default ~/.cache/jaxvt/...)")
  ap.add_argument("--json", action="store_true", help="print the result as the cache's JSON")
  args = ap.parse_args(argv)
  try:
    inputs.whole("--bytes", args.bytes, 4096, 1 << 36)
    inputs.whole("--iters", args.iters, 1, 1 << 20)
    dev = jax.devices()[0]
    r = run_probe(dev, args.bytes, args.iters)
  except JaxvtError as e:
    print(f"jaxvt: error: {e}", file=sys.stderr)
    return e.exit_code
  path = Path(args.cache) if args.cache else cache_path(r.platform, r.device_kind)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(r.to_json(), encoding="utf-8")
  print(r.to_json() if args.json else format_table(r))
  print(f"cached at {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
