"""Host-tier layers copied ahead of their turn (jaxvt.ffi.prefetch: fetch / take / join) on CPU.

The contract (csrc/common/prefetch.h): fetch copies a host-tier layer's bytes into a ring; take gives a
table that points the kernels at the ring for that layer only, and leaves every other layer where
it lives; a fetch of -1 leaves the ring as it is, a fetch of a device-tier layer empties it. The
reference is the identity: the kernels' results through take's table equal, bit for bit, those
of the same layer read in place from the host tier and from a device-tier copy; the ring's bytes
equal the file's. test_prefetch_gpu.py runs these tests on a GPU (the copy there runs on a
stream of jaxvt's own while XLA's stream goes on).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="jaxvt's extension is not built (pip install -e .)")

if ffi.available("cpu"):
  from jaxvt.ffi import grouped as gops, ops, prefetch

from test_ffi_cases import Q4_K, Q6_K, Q8_0, make_stack  # noqa: E402
from test_ffi_cases import device, put, rng, tier  # noqa: E402,F401  (the shared fixtures)
from test_qwen_fixtures import MOE8, synth_file  # noqa: E402

E, ROWS, COLS, T, K = 6, 32, 512, 24, 3
FMTS = [Q4_K, Q6_K, Q4_K, Q8_0, Q6_K]
HOST = (1, 2, 4)  # two in a row: a ring is fetched again the moment it is freed


def addresses(table) -> np.ndarray:
  t = np.asarray(table).astype(np.uint64)
  return t[:, 0] | (t[:, 1] << np.uint64(32))


def stacks(rng, tier):
  """The same experts three ways: host-tier layers HOST, every layer in the device tier."""
  host = make_stack(rng, FMTS, ROWS, COLS, experts=E, host=HOST, tier=tier)
  dev = make_stack(rng, FMTS, ROWS, COLS, experts=E, raws=host.raws)
  return host, dev


def routing(rng):
  return np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)


def test_ring_bytes_and_schedule():
  from jaxvt.qweight import QMeta
  m = QMeta(rows=ROWS, cols=COLS, experts=E, formats=(Q4_K, Q6_K), n_layers=5, host_layers=HOST)
  # the largest layer (Q6_K: 210 bytes a 256-element block) rounded to 256, then the header
  assert prefetch.layer_bytes(m) == E * ROWS * COLS // 256 * 210
  assert prefetch.ring_bytes(m) == -(-prefetch.layer_bytes(m) // 256) * 256 + prefetch.HEADER
  first, after = prefetch.schedule(m)
  assert first == 1 and after.tolist() == [-1, 2, 4, -1, -1]
  none_first, none_after = prefetch.schedule(QMeta(ROWS, COLS, E, (Q4_K,), 3))
  assert none_first == -1 and none_after.tolist() == [-1, -1, -1]
  # two rings taking the host-tier layers in turns: 1, 4 and 2
  six = QMeta(ROWS, COLS, E, (Q4_K,), 6, host_layers=(1, 2, 4, 5))
  assert [(f, a.tolist()) for f, a in (prefetch.schedule(six, k, 2) for k in (0, 1))] == [
      (1, [-1, 4, -1, -1, -1, -1]), (2, [-1, -1, 5, -1, -1, -1])]
  from jaxvt.offload import schedule
  assert [schedule.ring_parts(m, 2), schedule.ring_parts(six, 2), schedule.ring_parts(six, 1)] == [2, 2, 1]
  assert schedule.ring_parts(QMeta(ROWS, COLS, E, (Q4_K,), 6, host_layers=(3,)), 2) == 1


def test_take_redirects_only_the_fetched_layer(rng, device, tier):
  """fetch(1); take(l) for every l: only layer 1 points at the ring, and the ring holds layer 1's
  bytes; a fetch of -1 keeps it; a fetch of a device-tier layer empties the ring."""
  host, _ = stacks(rng, tier)
  w = put(host.w, device)
  orig = addresses(w.table)

  @jax.jit
  def run(w):
    ring = prefetch.fetch(prefetch.new_ring(w.meta), w, 1)
    ring = prefetch.fetch(ring, w, -1)  # nothing asked: the copy stays
    tables = []
    for l in range(len(FMTS)):
      ring, wl = prefetch.take(ring, w, l)
      tables.append(wl.table)
    held = ring
    ring = prefetch.fetch(ring, w, 0)  # a device-tier layer: the ring is emptied
    ring, w1 = prefetch.take(ring, w, 1)
    return held, tables, prefetch.join(w1.table, ring)

  held, tables, after_empty = run(w)
  n = host.raws[1].size
  np.testing.assert_array_equal(np.asarray(held)[:n], host.raws[1].reshape(-1))
  for l, t in enumerate(tables):
    got = addresses(t)
    changed = np.nonzero(got != orig)[0].tolist()
    assert changed == ([1] if l == 1 else []), (l, changed)
  np.testing.assert_array_equal(addresses(after_empty), orig)


def test_first_copies_go_in_the_order_their_layers_are_needed(rng, device, tier):
  """start_rings: each ring's first fetch, earliest layer first, each after the one before (the
  one copy stream takes them in that order); a stack with no host-tier layer last."""
  from jaxvt.offload import schedule
  made = {n: make_stack(rng, FMTS, ROWS, COLS, experts=E, host=h, tier=tier)
          for n, h in zip(schedule.ROUTED, [(4,), (1, 2), ()])}
  ws = {n: put(m.w, device) for n, m in made.items()}
  jaxpr = jax.make_jaxpr(lambda ws: schedule.start_rings(ws, schedule.ROUTED))(ws).jaxpr
  calls = [e for e in jaxpr.eqns if e.params.get("target_name") == "jaxvt_prefetch_fetch"]
  assert [int(dict(e.params["attributes"])["first"]) for e in calls] == [1, 4, -1]
  for prev, nxt in zip(calls, calls[1:]):
    assert nxt.invars[4] is prev.outvars[0]  # `after`: the ring the fetch before it returned
  rings = schedule.start_rings(ws, schedule.ROUTED)
  assert list(rings) == ["moe.w_up", "moe.w_gate", "moe.w_down"]
  assert [len(r) for r in rings.values()] == [1, 1, 1]
  held = jax.jit(lambda ws: schedule.start_rings(ws, schedule.ROUTED))(ws)
  for n, layer in (("moe.w_up", 1), ("moe.w_gate", 4)):  # the bytes arrive as before
    raw = made[n].raws[layer].reshape(-1)
    np.testing.assert_array_equal(np.asarray(held[n][0])[:raw.size], raw)
  # two rings where host-tier layers are adjacent (up's 1 and 2): each receives its first
  jaxpr = jax.make_jaxpr(lambda ws: schedule.start_rings(ws, schedule.ROUTED, 2))(ws).jaxpr
  calls = [e for e in jaxpr.eqns if e.params.get("target_name") == "jaxvt_prefetch_fetch"]
  assert [int(dict(e.params["attributes"])["first"]) for e in calls] == [1, 2, 4, -1]
  held = jax.jit(lambda ws: schedule.start_rings(ws, schedule.ROUTED, 2))(ws)
  assert {n: len(r) for n, r in held.items()} == {"moe.w_up": 2, "moe.w_gate": 1, "moe.w_down": 1}
  for k, layer in enumerate((1, 2)):
    raw = made["moe.w_up"].raws[layer].reshape(-1)
    np.testing.assert_array_equal(np.asarray(held["moe.w_up"][k])[:raw.size], raw)


@pytest.mark.parametrize("parts", [1, 2], ids=["one-ring", "two-rings"])
@pytest.mark.parametrize("registered", [False, True], ids=["device-view", "registered"])
@pytest.mark.parametrize("path", ["grouped", "matvec"])
def test_scan_schedule_keeps_the_bits(path, registered, parts, rng, device, tier):
  """A lax.scan over the layers with a ring on prefetch.schedule (the model's pattern), or two
  rings taking the host-tier layers in turns: every host-tier layer is read from a ring, and the
  products equal, bit for bit, the same layers read in place from the host tier and from
  device-tier copies (grouped and per-slot kernels). With the table registered
  (HostTier.register_tables) a GPU copies by DMA, the host reckoning each call's layer from its
  ring's schedule; without, by a kernel reading the table on the device."""
  host, dev = stacks(rng, tier)
  x = put(rng.standard_normal((T, COLS)).astype(np.float32), device)
  ids = put(routing(rng), device)
  mm = {"grouped": lambda w, l: gops.qmatmul_grouped(x, w, l, ids),
        "matvec": lambda w, l: ops.qmatmul_experts(x, w, l, ids, mode="q8")}[path]
  layers = jnp.arange(len(FMTS), dtype=jnp.int32)

  @jax.jit
  def plain(w):
    return jax.lax.scan(lambda c, l: (c, mm(w, l)), None, layers)[1]

  @jax.jit
  def ahead(w):
    plans = [prefetch.schedule(w.meta, k, parts) for k in range(parts)]

    def body(rings, l):
      wl, got = w, []
      for r in rings:
        r, wl = prefetch.take(r, wl, l)
        got.append(r)
      y = mm(wl, l)
      rings = tuple(prefetch.fetch(r, w, jnp.asarray(after)[l], after=y, part=k, parts=parts)
                    for k, (r, (_, after)) in enumerate(zip(got, plans)))
      return rings, (y, wl.table)

    rings, after = [], None
    for k, (first, _) in enumerate(plans):
      rings.append(after := prefetch.fetch(prefetch.new_ring(w.meta), w, first, after,
                                           first=True, part=k, parts=parts))
    rings, (ys, tables) = jax.lax.scan(body, tuple(rings), layers)
    for r in rings:
      ys = prefetch.join(ys, r)
    return ys, tables

  wh, wd = put(host.w, device), put(dev.w, device)
  if registered:
    assert tier.register_tables({"w": wh}) >= 1
  try:
    ys, tables = ahead(wh)
  finally:  # a later test's table may reuse this one's address (a stale entry is only slower)
    ffi.extension().prefetch_unregister(wh.table.unsafe_buffer_pointer())
  np.testing.assert_array_equal(np.asarray(ys), np.asarray(plain(wh)))
  np.testing.assert_array_equal(np.asarray(ys), np.asarray(plain(wd)))
  orig = addresses(wh.table)
  for l in range(len(FMTS)):
    changed = np.nonzero(addresses(tables[l]) != orig)[0].tolist()
    assert changed == ([l] if l in HOST else []), (l, changed)
  # the poison check: a ring whose bytes were not the layer's would change the products
  assert np.abs(np.asarray(ys)).max() > 0


# ---------------------------------------------------------------------------------------------
# In the model: prefill with host-tier expert layers copied ahead (Products.prefetch_per_expert)


@pytest.fixture(scope="module")
def moe8(tmp_path_factory):
  return synth_file(tmp_path_factory.mktemp("prefetch"), "qwen35moe", "q4_k_m", 7, **MOE8)[1]


def routed_on_host(name: str, layer) -> str:
  """The placement of the model tests here: the routed experts of layers 1, 2, 5 and layer 7's
  down in the host tier, everything else on the device."""
  host = name.startswith("moe.w_") and (layer in (1, 2, 5) or (name == "moe.w_down" and layer == 7))
  return "host" if host else "device"


@pytest.mark.parametrize("rings", [1, 2])
@pytest.mark.parametrize("rule", ["grouped", "per-slot"])
def test_prefill_with_prefetch_equals_in_place(moe8, device, tier, rule, rings):
  """Routed experts of layers 1, 2, 5 (and layer 7's down only) in the host tier: a 32-token
  prefill copying them ahead, with one ring a stack or two taking its layers in turns (1 and 2
  are adjacent), gives the logits and cache of the same program reading them in place, bit for
  bit; the program holds the prefetch calls only where the rule asks, no copy of a ring, and
  XLA's memory analysis counts the rings."""
  import dataclasses
  import re
  from jaxvt import engine, loader
  from jaxvt.model import decoder
  from jaxvt.offload import schedule
  from jaxvt.ffi.tuning import Products
  from jaxvt.model.sharding import one_device
  m = loader.open_model(moe8)
  par = one_device(device)
  weights = loader.place(m, routed_on_host, par=par, host=tier)
  assert weights["moe.w_gate"].meta.host_layers == (1, 2, 5)
  assert weights["moe.w_down"].meta.host_layers == (1, 2, 5, 7)
  T = 32
  base = engine.exec_for(device.platform, True, par)
  grouped = T * m.cfg.n_experts_used if rule == "grouped" else 0
  off = dataclasses.replace(base, products=Products(grouped_slots=grouped))
  on = dataclasses.replace(base, products=Products(grouped_slots=grouped, prefetch_per_expert=1,
                                                    prefetch_rings=rings))
  toks = jnp.asarray(np.random.default_rng(3).integers(3, 300, (1, T)), jnp.int32)
  args = (toks, jnp.arange(T, dtype=jnp.int32)[None], jnp.ones((1, T), bool),
          jnp.asarray([T - 1], jnp.int32))

  def run(ex):
    cache = decoder.init_cache(m.cfg, 1, T)
    logits, cache = engine.prefill_fn(weights, cache, *args, cfg=m.cfg, ex=ex, kv_len=T)
    return np.asarray(logits), {k: np.asarray(v) for k, v in cache.items()}

  (l_off, c_off), (l_on, c_on) = run(off), run(on)
  np.testing.assert_array_equal(l_on, l_off)
  for k in c_off:
    np.testing.assert_array_equal(c_on[k], c_off[k])
  cache = jax.eval_shape(lambda: decoder.init_cache(m.cfg, 1, T))
  lower = lambda ex: engine.prefill_fn.lower(weights, cache, *args, cfg=m.cfg, ex=ex, kv_len=T)
  text_on, text_off = lower(on).as_text(), lower(off).as_text()
  for name in ("fetch", "take", "join"):
    assert f"jaxvt_prefetch_{name}" in text_on and f"jaxvt_prefetch_{name}" not in text_off
  # each layer of the scanned period takes from every ring of every stack
  parts = [schedule.ring_parts(weights[n].meta, rings) for n in schedule.ROUTED]
  assert parts == [rings] * 3
  assert text_on.count("@jaxvt_prefetch_take(") == len(decoder.layer_period(m.cfg)) * sum(parts)
  # no side-effecting call: a failed run of a program with JAX effects leaves its error in JAX's
  # runtime tokens, raised again by every later program (the 2026-12-02 sweep after an OOM)
  assert "has_side_effect = true" not in text_on
  # a call of fewer slots than the rule's threshold copies nothing
  per_expert = T * m.cfg.n_experts_used // m.cfg.n_experts
  few = dataclasses.replace(base, products=Products(grouped_slots=grouped,
                                                    prefetch_per_expert=per_expert + 1))
  assert "jaxvt_prefetch" not in lower(few).as_text()
  compiled = lower(on).compile()
  sizes = {prefetch.ring_bytes(weights[n].meta) for n in ("moe.w_gate", "moe.w_up", "moe.w_down")}
  hlo = compiled.as_text()
  for n in sizes:  # the rings are updated in place: XLA copies none (but the zeros they start as)
    copies = re.findall(rf"u8\[{n}\]\{{0\}} copy\((%[\w.-]+)", hlo)
    assert all(c.startswith("%broadcast") for c in copies), (n, copies)
  ma, ma_off = compiled.memory_analysis(), lower(off).compile().memory_analysis()
  if ma is not None and ma_off is not None:
    held = sum(prefetch.ring_bytes(weights[n].meta) * schedule.ring_parts(weights[n].meta, rings)
               for n in schedule.ROUTED)
    assert ma.temp_size_in_bytes >= ma_off.temp_size_in_bytes + held
