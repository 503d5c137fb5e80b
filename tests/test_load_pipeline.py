"""Loading in a pipeline: rows read from the file on threads, stacks placed while others upload,
and the first token's programs compiled while the weights load (jaxvt.load's while_loading).
Every tier holds the file's bytes exactly as the one-row-at-a-time copy from the memory map did;
errors come out once nothing is being written; what was compiled early is what generate runs."""

from __future__ import annotations

import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest

import jaxvt
from jaxvt import engine, ffi, loader, programs, synth, transfer
from jaxvt.model import sharding
from jaxvt.errors import JaxvtError
from jaxvt.gguf.reader import open_gguf
from jaxvt.offload.host_tier import HostTier, Staging, staging_for
from jaxvt.qweight import HOST_BIT, QWeight

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="the jaxvt extension is not built (pip install -e .)")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("pipeline") / "tiny-q35moe.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe", n_layers=8), "mixed", seed=5)
  return path


def _host_bytes(tier: HostTier) -> dict[int, np.ndarray]:
  return {b.device_address: b.array for b in tier._buffers}  # pylint: disable=protected-access


def _gpu_case(*values):
  from gpu_cases import OK, REASON  # pylint: disable=import-outside-toplevel
  return pytest.param(*values, marks=[pytest.mark.gpu, pytest.mark.skipif(not OK, reason=REASON)])


@pytest.mark.parametrize("backend,stacks,staged", [("cpu", 1, False), ("cpu", 3, False),
                                                   ("cpu", 1, True), ("cpu", 3, True),
                                                   _gpu_case("gpu", 3, True)])
@pytest.mark.parametrize("where", ["device", "host", "alternate"])
def test_every_tier_holds_the_files_bytes(moe_file, monkeypatch, where, backend, stacks, staged):
  """Each matrix's device rows equal the tensors' bytes packed from the memory map (the loader
  before it read with pread), zero-padded; each host-tier buffer equals its tensor's bytes;
  vectors equal the file's floats. Small copy pieces, small uploads and a small host budget make
  every path run: chunked reads, uploads in pieces into a donated array, stacks waiting for
  host memory; with stacks=3 three weights at once on threads, as on an accelerator. staged:
  through pinned-staging buffers copied into device arrays made up front by one program
  (host_tier.Staging, loader._device_arrays: the GPU's path; on the CPU its CPU form), file rows
  read on the extension's native threads, pieces smaller than a row and not a multiple of the
  row stride, and fewer buffers than weights in flight; the buffers are freed when placing
  ends. gpu: the real GPU path (run with -m gpu on a GPU host)."""
  monkeypatch.setattr(loader, "_stacks_in_flight", lambda platform: stacks)
  monkeypatch.setattr(transfer, "COPY_CHUNK", 4096 + 17)
  monkeypatch.setattr(transfer, "upload_max", lambda: 3 * 4096)
  monkeypatch.setattr(loader, "STAGE_PIECE", 3 * 4096 + 5)
  made, arrays = [], []
  real_arrays = loader._device_arrays  # pylint: disable=protected-access

  def staging(platform, n, piece):
    assert platform == backend and piece == loader.STAGE_PIECE
    made.append(Staging(max(1, n - 1), piece, backend="cpu") if backend == "cpu"
                else staging_for(platform, n, piece))
    return made[-1]

  def device_arrays(*a):
    out = real_arrays(*a)
    arrays.append(len(out))  # (placing takes its arrays out of the dict)
    return out
  if staged:
    monkeypatch.setattr(loader, "_device_arrays", device_arrays)
  m = loader.open_model(moe_file)
  placement = {"device": loader.all_device,
               "host": lambda n, l: "host",
               "alternate": lambda n, l: "host" if (l or 0) % 2 else "device"}[where]
  par = sharding.one_device(jax.devices(backend)[0])
  with HostTier(backend=backend) as tier:
    times = loader.LoadTimes()
    weights = loader.place(m, placement, par=par, host=tier, times=times,
                           staging=staging if staged else None)
    host = _host_bytes(tier)
    n_host = 0
    for d in m.decls:
      w, tensors = weights[d.name], m.tensors(d)
      if not isinstance(w, QWeight):
        want = np.stack([np.asarray(t.data, np.float32).reshape(d.shape) for t in tensors])
        np.testing.assert_array_equal(np.asarray(w), want if d.layers else want[0])
        continue
      table = np.asarray(w.table).astype(np.uint64)
      addr = table[:, 0] | (table[:, 1] << np.uint64(32))
      fmts = np.asarray(w.fmts)
      dev = [i for i in range(len(tensors)) if not fmts[i] & HOST_BIT]
      for i, t in enumerate(tensors):
        if fmts[i] & HOST_BIT:
          n_host += 1
          np.testing.assert_array_equal(host[int(addr[i])], t.raw().reshape(-1))
      if dev:
        assert w.data.devices() == {par.devices[0]}
        stride = max(tensors[i].n_bytes for i in dev)
        np.testing.assert_array_equal(np.asarray(w.data),
                                      loader.pack_rows([tensors[i] for i in dev], stride))
        assert [int(addr[i]) for i in dev] == list(range(len(dev)))
    assert (n_host > 0) == (where != "device")
    matrices = sum(t.n_bytes for d in m.decls if d.matrix for t in m.tensors(d))
    assert times.read_bytes + times.host_bytes >= matrices
    assert all(s.tier.closed and s.tier.nbytes == 0 for s in made) and len(made) == staged
    # the device stacks came from _device_arrays' one program (none where all is in the host tier)
    assert [n > 0 for n in arrays] == ([where != "host"] if staged else [])


@pytest.mark.parametrize("backend", ["cpu", _gpu_case("gpu")])
@pytest.mark.parametrize("piece", [7, 4096, 3 * 5003 + 1, 1 << 20])
def test_staged_stack_is_the_packed_stack(piece, backend):
  """A stack through the staging buffers (rows of unequal sizes, so padding; pieces cutting rows
  anywhere, smaller and larger than a row) holds exactly the packed rows, whatever the reused
  buffer held before (here 0xff). gpu: pinned buffers DMA-copied into a GPU array (run with
  -m gpu on a GPU host)."""
  rng = np.random.default_rng(piece)
  sizes = [5003, 17, 4999, 1, 5003, 2500]
  rows = [transfer.array_row(rng.integers(0, 256, s, dtype=np.uint8)) for s in sizes]
  stride = max(sizes)
  with Staging(2, piece, backend=backend) as staging:
    with staging.buffer() as buf:
      buf.array[:] = 0xff
    got = transfer.device_stack(rows, stride, jax.devices(backend)[0], lead=1, staging=staging)
    assert got.shape == (1, len(rows), stride)
    np.testing.assert_array_equal(np.asarray(got)[0], transfer._pack(rows, stride))  # pylint: disable=protected-access


def test_read_into_refuses_a_file_that_shrank(moe_file, tmp_path):
  """pread past the end of a file cut short after it was opened is the one-line error (a read
  through the memory map would end the process with SIGBUS)."""
  path = str(tmp_path / "cut.gguf")
  shutil.copy(moe_file, path)
  gf = open_gguf(path)
  t = max(gf.tensors.values(), key=lambda t: t.offset)
  dst = np.empty(t.n_bytes, np.uint8)
  gf.read_into(dst, t)
  np.testing.assert_array_equal(dst, t.raw().reshape(-1))
  part = np.empty(100, np.uint8)
  gf.read_into(part, t, 7)
  np.testing.assert_array_equal(part, dst[7:107])
  # the same through the extension's native reader (the staged path), in pieces of 64 bytes
  read = lambda fd, ranges: ffi.extension().read_ranges(fd, ranges, 2, 64)
  many = np.full(t.n_bytes + 100, 0xff, np.uint8)
  gf.read_ranges([(t, 0, many.ctypes.data, t.n_bytes), (t, 7, many.ctypes.data + t.n_bytes, 100)],
                 read)
  np.testing.assert_array_equal(many[:t.n_bytes], dst)
  np.testing.assert_array_equal(many[t.n_bytes:], dst[7:107])
  os.truncate(path, t.offset + 10)
  with pytest.raises(JaxvtError, match="changed while it was read"):
    gf.read_into(dst, t)
  with pytest.raises(JaxvtError, match=f"changed while it was read .*'{t.name}' ends early"):
    gf.read_ranges([(t, 0, many.ctypes.data, t.n_bytes)], read)
  with pytest.raises(ValueError):
    gf.read_into(np.empty(t.n_bytes + 1, np.uint8), t)
  with pytest.raises(ValueError):
    gf.read_ranges([(t, 1, many.ctypes.data, t.n_bytes)], read)


class _Recording(HostTier):
  """A CPU host tier that notes whether every fill had ended when it was closed."""
  tiers: list = []

  def __init__(self, backend=None):
    super().__init__("cpu")
    self.started = self.ended = 0
    self.open_fills_at_close = None
    _Recording.tiers.append(self)

  def copy(self, key, nbytes, fill):
    self.started += 1
    try:
      return super().copy(key, nbytes, fill)
    finally:
      self.ended += 1

  def close(self):
    if self.open_fills_at_close is None:
      self.open_fills_at_close = self.started - self.ended
    super().close()


def test_a_failed_weight_stops_the_load_after_every_write(moe_file, monkeypatch):
  """One weight's error is the load's error, raised once the other weights in flight have
  stopped writing into the host tier, which is then freed."""
  real = loader._vector

  def broken(model, d, r, par):
    if d.name == "final_norm":
      raise JaxvtError("final_norm is broken")
    return real(model, d, r, par)

  monkeypatch.setattr(loader, "_vector", broken)
  monkeypatch.setattr(loader, "_stacks_in_flight", lambda platform: 3)
  monkeypatch.setattr(engine, "HostTier", _Recording)
  _Recording.tiers.clear()
  for warm in (None, lambda e: e.warm_up(3, 1)):
    with pytest.raises(JaxvtError, match="final_norm is broken"):
      jaxvt.load(moe_file, max_context=64, offload_gb=64, while_loading=warm)
  assert len(_Recording.tiers) == 2
  for tier in _Recording.tiers:
    assert tier.closed and tier.started > 0 and tier.open_fills_at_close == 0


def test_an_error_while_loading_waits_for_the_weights(moe_file, monkeypatch):
  """while_loading's own error comes out after placing ended, with the host tier freed."""
  monkeypatch.setattr(engine, "HostTier", _Recording)
  _Recording.tiers.clear()

  def fails(early):
    raise JaxvtError("no warm-up today")

  with pytest.raises(JaxvtError, match="no warm-up today"):
    jaxvt.load(moe_file, max_context=64, offload_gb=64, while_loading=fails)
  (tier,) = _Recording.tiers
  assert tier.closed and tier.ended == tier.started > 0 and tier.open_fills_at_close == 0


@pytest.mark.parametrize("device_gb", [None, 0.001])
def test_the_backend_starts_beside_the_plan_and_is_waited_for(moe_file, monkeypatch, device_gb):
  """load runs a first program on a thread of its own (programs.BackendStart) from before the
  plan, and returns or raises only after it ended; its error is dropped (a device of 0.001 GiB
  is refused by the plan, so that load raises while the thread still runs)."""
  monkeypatch.setattr(programs.BackendStart, "SKIP", ())
  seen = {}
  run = programs.BackendStart._run  # pylint: disable=protected-access

  def slow(device):
    seen["thread"] = threading.current_thread().name
    time.sleep(0.5)
    run(device)  # the real first program, on the CPU device
    seen["ended"] = time.perf_counter()
    raise RuntimeError("dropped")

  monkeypatch.setattr(programs.BackendStart, "_run", staticmethod(slow))
  if device_gb:
    with pytest.raises(JaxvtError, match="no budget is safe"):
      jaxvt.load(moe_file, max_context=64, device_gb=device_gb)
    out = time.perf_counter()
  else:
    eng = jaxvt.load(moe_file, max_context=64)
    out = time.perf_counter()
    assert eng.generate(PROMPT, max_tokens=2).tokens
    eng.close()
  assert seen["thread"] == "jaxvt-backend" and seen["ended"] <= out
  assert not any(t.name == "jaxvt-backend" for t in threading.enumerate())


def test_the_backend_start_is_skipped_on_the_cpu():
  start = programs.BackendStart(jax.devices("cpu")[0])
  with start:
    assert start._thread is None  # pylint: disable=protected-access


@pytest.mark.parametrize("offload_gb", [0.0, 0.02])
def test_programs_compiled_while_loading_are_the_ones_generate_runs(offload_gb):
  """warm_up against the weights' shapes (while_loading) leaves generate nothing to compile
  (no XLA compile, no persistent-cache load) and the same tokens as a plain load; a plain load
  of another context length (programs of other shapes) does compile in generate."""
  counter = programs.compile_counter()
  # shapes no other test compiled in this process; the KV cache holds max_context rounded up to
  # a multiple of 8 positions (Engine.cache_len), so the plain load's context is 8 shorter
  ctx = 216 if offload_gb else 232
  seen = []

  def warm(early):
    seen.append({type(a).__name__ for a in jax.tree_util.tree_leaves(early.weights)})
    early.warm_up(len(early.encode_prompt(PROMPT)), 1)

  with jaxvt.load(max_context=ctx, offload_gb=offload_gb, while_loading=warm) as eng:
    assert seen == [{"ShapeDtypeStruct"}] and eng.warm_seconds > 0 and eng.warmed
    assert eng.place_seconds > 0 and eng.load_times.read_bytes > 0
    before = counter.snapshot()
    early = eng.generate(PROMPT, max_tokens=1)
    assert counter.snapshot()[0] == before[0] and early.stats.compile_seconds == 0
  with jaxvt.load(max_context=ctx - 8, offload_gb=offload_gb) as plain:
    before = counter.snapshot()
    g = plain.generate(PROMPT, max_tokens=1)
    assert counter.snapshot()[0] > before[0] and g.stats.compile_seconds > 0
  assert early.tokens == g.tokens


def test_load_takes_the_tokenizer_built_from_its_file(tmp_path):
  """The CLI builds the tokenizer while it checks the file before JAX starts, and jaxvt.load
  takes that very object (with while_loading or without) instead of reading the vocabulary
  again: the same tokens as a load that builds its own. A tokenizer of another file (a copy:
  another inode), of this file changed since, or of no file at all is refused."""
  from jaxvt.gguf.default_model import default_model_path
  from jaxvt.gguf.tokenizer import Tokenizer
  path = default_model_path()
  gf = open_gguf(path)
  tok = Tokenizer.from_gguf_metadata(gf.metadata, source=path, identity=gf.identity)
  with jaxvt.load(path, max_context=64) as own:
    want = own.generate(PROMPT, max_tokens=4).tokens
    assert own.tokenizer is not tok and own.tokenizer.identity == gf.identity
  for warm in (None, lambda early: early.warm_up(len(early.encode_prompt(PROMPT)), 1)):
    with jaxvt.load(path, max_context=64, tokenizer=tok, while_loading=warm) as eng:
      assert eng.tokenizer is tok and eng.generate(PROMPT, max_tokens=4).tokens == want
  copy = str(tmp_path / "copy.gguf")
  shutil.copyfile(path, copy)
  other = open_gguf(copy)
  for bad in (tok, Tokenizer.from_gguf_metadata(gf.metadata, source=path),
              Tokenizer.from_gguf_metadata(other.metadata, source=copy,
                                           identity=other.identity[:3] + (0,))):
    with pytest.raises(JaxvtError, match="tokenizer=.*not built from"):
      jaxvt.load(copy, max_context=64, tokenizer=bad)
