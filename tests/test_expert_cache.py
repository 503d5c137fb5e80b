"""The device expert cache (jaxvt.ffi.expert_cache, jaxvt.offload.expert_cache,
csrc/common/expert_cache.h) on the CPU; test_expert_cache_gpu.py runs the op tests on a GPU.

The references: the decision against its numpy reference (assign_ref), call by call and in the
directory it leaves; the experts products with the cache against the same products without it
(bit for bit) and each filled slot's bytes against the file's; hits really read from the cache
(the host copy of a cached expert poisoned afterwards does not change them); greedy tokens with
the cache on (LRU, LFRU, too small for the working set) against a run with every weight on the
device; the planner's sizing against the breakdown it reports.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvt
from jaxvt import ffi
from jaxvt.errors import JaxvtError

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="jaxvt's extension is not built (pip install -e .)")

if ffi.available("cpu"):
  from jaxvt.ffi import expert_cache as xc
  from jaxvt.ffi import ops
  from jaxvt.offload import expert_cache

from test_ffi_cases import Q4_K, Q6_K, Q8_0, make_stack, poison_experts, row_bytes  # noqa: E402
from test_ffi_cases import device, put, rng, tier  # noqa: E402,F401  (the shared fixtures)

E, FFN, D, K, SLOTS = 16, 256, 256, 4, 5
FMTS = {"moe.w_gate": [Q4_K, Q4_K, Q8_0, Q4_K], "moe.w_up": [Q4_K, Q6_K, Q8_0, Q4_K],
        "moe.w_down": [Q6_K, Q6_K, Q4_K, Q8_0]}
HOST = {"moe.w_gate": (0, 2), "moe.w_up": (0, 2), "moe.w_down": (0, 1, 2)}  # layer 3: device
CACHED = (0, 1, 2)


SHAPE = {"moe.w_gate": (FFN, D), "moe.w_up": (FFN, D), "moe.w_down": (D, FFN)}  # rows, cols


def _plan(policy: str, slots: int = SLOTS) -> "expert_cache.CachePlan":
  """The cache of the stacks below: every host-tier layer, `slots` slots each (a slot: the
  stack's largest expert, rounded up to 256 bytes)."""
  parts = tuple((n, HOST[n]) for n in expert_cache.ROUTED)
  per = {n: max(SHAPE[n][0] * row_bytes(FMTS[n][l], SHAPE[n][1]) for l in HOST[n])
         for n in expert_cache.ROUTED}
  return expert_cache.CachePlan(slots, E, policy, parts,
                                tuple((n, -(-per[n] // 256) * 256) for n in expert_cache.ROUTED),
                                tuple((l, 1) for l in CACHED))


@pytest.fixture
def stacks(rng, tier):
  return {n: make_stack(rng, FMTS[n], *SHAPE[n], experts=E, host=HOST[n], tier=tier)
          for n in expert_cache.ROUTED}


def _weights(stacks, device) -> dict:
  return {n: put(s.w, device) for n, s in stacks.items()}


def _cache(stacks, device, policy: str, slots: int = SLOTS):
  w = _weights(stacks, device)
  return w, expert_cache.ExpertCache(_plan(policy, slots), w, device)


def _calls(rng, n: int) -> list[tuple[int, np.ndarray]]:
  """(layer, ids [rows, K]) with temporal locality: half of each call's ids come from the
  previous ones of its layer; rows of 1 (decode) or 3 (a batch: shared experts); some ids out of
  range (clamped, as the kernels clamp them) or negative (routed nowhere)."""
  out, recent = [], {l: list(range(K)) for l in range(4)}
  for _ in range(n):
    l = int(rng.integers(0, 4))
    rows = int(rng.choice([1, 3]))
    ids = np.empty((rows, K), np.int32)
    for r in range(rows):
      pool = recent[l]
      row = []
      while len(row) < K:
        e = int(rng.choice(pool)) if rng.random() < 0.5 else int(rng.integers(0, E))
        if e not in row:
          row.append(e)
      ids[r] = row
    recent[l] = ids.reshape(-1).tolist()
    if rng.random() < 0.2:
      ids[0, -1] = -1 if rng.random() < 0.5 else E + 3
    out.append((l, ids))
  return out


@jax.jit
def _assign(ids, layer, stab):
  return xc.assign(ids, layer, stab)


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_assign_matches_the_numpy_reference(stacks, device, rng, policy):
  """Call by call the decision (hits, fills, none) is the reference's, and the directory, scores,
  clock and counters it leaves are too; an uncached layer gets -1 everywhere."""
  w, cache = _cache(stacks, device, policy)
  stab = cache.tables().stab
  refs = {l: xc.LayerState(E, SLOTS, policy) for l in CACHED}
  for layer, ids in _calls(rng, 60):
    got = np.asarray(_assign(jnp.asarray(ids), jnp.int32(layer), stab))
    if layer not in refs:
      assert (got == -1).all()
      continue
    want = xc.assign_ref(refs[layer], ids)
    np.testing.assert_array_equal(got, want.reshape(ids.shape), err_msg=f"layer {layer} {ids}")
  words = xc.layer_words(E, SLOTS)
  state = np.asarray(jnp.copy(cache.state)).reshape(len(CACHED), words)
  for row, l in zip(state, CACHED):
    got, ref = xc.LayerState.from_words(row), refs[l]
    assert (got.clock, got.hits, got.misses, got.fills) == (ref.clock, ref.hits, ref.misses,
                                                            ref.fills)
    np.testing.assert_array_equal(got.dir, ref.dir)
    np.testing.assert_array_equal(got.owner, ref.owner)
    np.testing.assert_array_equal(got.score, ref.score)
  assert refs[0].hits > 0 and refs[0].misses > SLOTS  # the stream both hit and evicted
  s = cache.stats()
  assert (s.hits, s.misses, s.fills) == (sum(r.hits for r in refs.values()),
                                         sum(r.misses for r in refs.values()),
                                         sum(r.fills for r in refs.values()))


@functools.partial(jax.jit, static_argnames=("mode", "cached"))
def _moe(w, x, ids, wts, layer, mode, cached: bool):
  kw = {}
  if cached:
    t = w[expert_cache.CACHE]
    kw["cache"] = t.operands(xc.assign(ids, layer, t.stab))
  return ops.moe_experts(x, w["moe.w_gate"], w["moe.w_up"], w["moe.w_down"], layer, ids, wts,
                         mode=mode, **kw)


def _mode(device) -> str:
  return "ggml" if device.platform == "cpu" else "q8"


def _slot_bytes(cache, name: str, layer: int, j: int, nbytes: int) -> np.ndarray:
  cp = cache.plan
  part = dict(cp.parts)[name].index(layer)
  sb = dict(cp.slot_bytes)[name]
  data = np.asarray(jnp.copy(cache.data[name]))
  start = (part * cp.slots + j) * sb
  return data[start:start + nbytes]


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_experts_have_the_same_bits_and_fill_the_files_bytes(stacks, device, rng, policy):
  """The MoE products with the cache equal those without it bit for bit, call after call (hits,
  fills, evictions); every slot the directory names holds its expert's bytes from the file, in
  each host-tier stack of its layer."""
  w, cache = _cache(stacks, device, policy)
  wc = {**w, expert_cache.CACHE: cache.tables()}
  mode = _mode(device)
  for layer, ids in _calls(rng, 40):
    x = jnp.asarray(rng.standard_normal((ids.shape[0], D)).astype(np.float32))
    wts = jnp.asarray(rng.random(ids.shape).astype(np.float32))
    plain = _moe(w, x, jnp.asarray(ids), wts, jnp.int32(layer), mode, False)
    got = _moe(wc, x, jnp.asarray(ids), wts, jnp.int32(layer), mode, True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
  assert cache.stats().hits > 0
  words = xc.layer_words(E, SLOTS)
  state = np.asarray(jnp.copy(cache.state)).reshape(len(CACHED), words)
  for row, l in zip(state, CACHED):
    owner = xc.LayerState.from_words(row).owner
    for n, s in stacks.items():
      if l not in HOST[n]:
        continue
      raw = np.asarray(s.raws[l]).reshape(E, -1)
      for j, e in enumerate(owner):
        if e >= 0:
          np.testing.assert_array_equal(_slot_bytes(cache, n, l, j, raw.shape[1]), raw[e],
                                        err_msg=f"{n} layer {l} slot {j} expert {e}")


def test_hits_read_the_cache(stacks, device, rng, tier):
  """Experts cached by one call, then poisoned in the host tier (NaN scales): a second call
  routed to them gives the first call's products (read from the cache); without the cache the
  poisoned bytes give NaN."""
  w, cache = _cache(stacks, device, "lru")
  wc = {**w, expert_cache.CACHE: cache.tables()}
  mode, layer = _mode(device), 2
  ids = jnp.asarray([[3, 7, 11, 5]], jnp.int32)
  x = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
  wts = jnp.full((1, K), 0.25, jnp.float32)
  first = np.asarray(_moe(wc, x, ids, wts, jnp.int32(layer), mode, True))
  for n, s in stacks.items():  # the host tier's copy of layer 2, poisoned where it is
    raw = np.asarray(s.raws[layer]).reshape(E * s.mats[layer].shape[1], -1)
    bad = poison_experts(raw, s.fmts[layer], E, keep=set())
    s.bufs[layer].array[:bad.size] = bad.reshape(-1)
  again = np.asarray(_moe(wc, x, ids, wts, jnp.int32(layer), mode, True))
  np.testing.assert_array_equal(again, first)
  assert np.isnan(np.asarray(_moe(w, x, ids, wts, jnp.int32(layer), mode, False))).all()


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_a_batch_reads_each_distinct_expert_once(stacks, device, rng, policy):
  """A decode step of 8 rows whose experts overlap (drawn from 9 of the layer's 16): the cache
  fills each distinct expert once (the call's bus reads), however many rows route to it, and
  counts one miss per routed slot; the products equal those without the cache bit for bit (on a
  GPU the later slots of an expert being filled read it from its slot, after the fill). The same
  experts in a second step, rows reordered: all hits, nothing filled."""
  w, cache = _cache(stacks, device, policy, slots=12)
  wc = {**w, expert_cache.CACHE: cache.tables()}
  mode, layer = _mode(device), 0
  pool = rng.permutation(E)[:9]
  ids = np.stack([rng.permutation(pool)[:K] for _ in range(8)]).astype(np.int32)
  distinct = len(set(ids.reshape(-1).tolist()))
  assert distinct < ids.size  # rows share experts
  eb = dict(cache.plan.expert_bytes)[layer]
  for step, rows in enumerate((ids, ids[rng.permutation(8)])):
    x = jnp.asarray(rng.standard_normal((8, D)).astype(np.float32))
    wts = jnp.asarray(rng.random((8, K)).astype(np.float32))
    before = cache.stats()
    got = _moe(wc, x, jnp.asarray(rows), wts, jnp.int32(layer), mode, True)
    plain = _moe(w, x, jnp.asarray(rows), wts, jnp.int32(layer), mode, False)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    d = cache.stats() - before
    if step == 0:
      assert (d.hits, d.misses, d.fills) == (0, ids.size, distinct)
      assert d.fill_bytes == distinct * eb and d.host_bytes == ids.size * eb
    else:
      assert (d.hits, d.misses, d.fills, d.fill_bytes) == (ids.size, 0, 0, 0)


# ---- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
  from jaxvt import synth
  cfg = synth.tiny_config("qwen35moe", d_model=256, expert_ffn_dim=256, shared_ffn_dim=256,
                          n_layers=8)
  path = str(tmp_path_factory.mktemp("xcache") / "qwen35moe.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=3)
  return path


PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def _slot_gib(path: str, slots: int) -> float:
  """GiB of a cache of `slots` slots a layer with every routed expert in the host tier."""
  placed = jaxvt.plan(jaxvt.open_model(path), offload_gb=64, max_context=128,
                      expert_cache_gb=0)
  cfg = placed.cfg
  per = expert_cache.cache_plan(placed.plan, cfg.n_experts, 1 << 40, "lru", 1)
  one = (per.nbytes - per.state_bytes) / per.slots
  return (slots * one + expert_cache.xc.layer_words(cfg.n_experts, slots) * 4 * 8 + 1024) / 2**30


@pytest.mark.parametrize("policy,slots", [("lru", 8), ("lru", 3), ("lfru", 3)])
def test_greedy_tokens_are_the_same_with_the_cache(moe_file, policy, slots):
  """Every routed expert in the host tier, and a third of them: the cache (every expert, or 3
  slots of 8 experts: evicting all the time) gives the tokens of a run with every weight on the
  device, and counts its hits."""
  with jaxvt.load(moe_file, max_context=128, expert_cache_gb=0) as dev:
    want = dev.generate(PROMPT, max_tokens=16).tokens
  gb = _slot_gib(moe_file, slots)
  for offload in (64, 0.004):
    with jaxvt.load(moe_file, max_context=128, offload_gb=offload, expert_cache_gb=gb,
                    expert_cache_policy=policy) as e:
      cp = e.plan.expert_cache
      assert cp is not None and cp.policy == policy
      if offload == 64:  # (a third in the host tier: the same GiB, more slots)
        assert cp.slots == slots
      assert e.memory.expert_cache == cp.nbytes
      assert e.generate(PROMPT, max_tokens=16).tokens == want
      s = jaxvt.engine.expert_cache_stats(e.weights)
      assert s.hits > 0 and s.misses > 0 and s.host_bytes > 0
      if slots < e.cfg.n_experts and offload == 64:
        assert s.misses > slots * len(cp.layers)  # evicted


def test_the_plan_gives_the_cache_what_is_free(moe_file):
  """auto: the largest cache the free memory holds (the next slot would not fit); the breakdown
  adds up with it; --plan and the report name it; too large a size, a negative one, or one with
  nothing in the host tier are refused or give no cache."""
  m = jaxvt.open_model(moe_file)
  plain = jaxvt.plan(m, offload_gb=0.004, device_gb=1, max_context=128, expert_cache_gb=0)
  free = plain.breakdown.free
  placed = jaxvt.plan(m, offload_gb=0.004, device_gb=1, max_context=128)
  cp, bd = placed.expert_cache, placed.breakdown
  assert cp is not None and 0 < cp.nbytes <= free
  if cp.slots < m.cfg.n_experts:
    bigger = expert_cache.cache_plan(placed.plan, cp.experts, free, "lru", 1)
    assert bigger.slots == cp.slots
  assert bd.expert_cache == cp.nbytes
  assert (bd.weights + bd.kv_cache + bd.state + bd.workspace + bd.expert_cache + bd.slack
          + bd.free == bd.capacity)
  assert "expert cache:" in placed.plan_text() and "expert cache" in placed.report()
  # the prediction counts the cache's share of the cached layers' routed reads as device reads
  routed = sum(u.read_bytes for u, k in zip(placed.plan.units, placed.plan.kinds)
               if k == "host" and u.name.startswith("moe.w_") and u.layer in cp.layers)
  moved = round(routed * cp.slots / cp.experts)
  assert placed.prediction.host_read_bytes == plain.prediction.host_read_bytes - moved > 0
  assert (placed.prediction.device_read_bytes ==
          plain.prediction.device_read_bytes + moved)
  with pytest.raises(JaxvtError, match="--expert-cache-gb .* does not fit"):
    jaxvt.plan(m, offload_gb=0.004, device_gb=1, max_context=128, expert_cache_gb=5)
  with pytest.raises(JaxvtError, match="expert_cache_gb"):
    jaxvt.plan(m, offload_gb=0.004, device_gb=1, max_context=128, expert_cache_gb=-1)
  assert jaxvt.plan(m, offload_gb=0, device_gb=1, max_context=128).expert_cache is None
  # the CPU backend's "device" is the host's own memory: no cache unless a size is given (a
  # GPU's free memory gets one)
  auto = jaxvt.plan(m, offload_gb=0.004, max_context=128)
  if auto.facts.platform == "cpu":
    assert auto.facts.host_memory and auto.expert_cache is None
  else:
    assert not auto.facts.host_memory and auto.expert_cache is not None
  # what the load's memory check expects of the same rule
  assert expert_cache.expected("auto", auto.facts.platform, None) == (auto.expert_cache is not None)
  assert expert_cache.expected(0.5, "cpu", None) and expert_cache.expected("auto", "cpu", 16)
  assert not expert_cache.expected(0, "cuda", None)
  assert jaxvt.plan(m, offload_gb=0.004, max_context=128, expert_cache_gb=0.002).expert_cache


def test_cache_plan_sizes_slots_from_bytes(moe_file):
  """cache_plan (pure): slots grow with the budget, one slot's bytes at a time, up to the
  experts; none below a token's k slots; the bytes it reports are the ones it allocates."""
  placed = jaxvt.plan(jaxvt.open_model(moe_file), offload_gb=64, max_context=128,
                      expert_cache_gb=0)
  E, k = placed.cfg.n_experts, placed.cfg.n_experts_used
  full = expert_cache.cache_plan(placed.plan, E, 1 << 40, "lfru", k)
  assert full.slots == E and full.policy == "lfru"
  assert full.layers == tuple(range(placed.cfg.n_layers))
  for s in range(k, E + 1):
    cp = expert_cache.cache_plan(placed.plan, E, expert_cache.cache_plan(
        placed.plan, E, 1 << 40, "lru", k).nbytes * s // E + 4096, "lru", k)
    assert cp.slots >= s - 1
  assert expert_cache.cache_plan(placed.plan, E, 1000, "lru", k) is None
  with pytest.raises(JaxvtError, match="--expert-cache-policy"):
    expert_cache.cache_plan(placed.plan, E, 1 << 30, "fifo", k)
