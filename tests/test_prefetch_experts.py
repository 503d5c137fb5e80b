"""Decode's predicted experts copied ahead (jaxvt.ffi.prefetch.fetch_experts, csrc/common/prefetch.h
XHeader) and the experts kernels reading them from the ring, on CPU.

The contract: a fetch of a host-tier layer copies the first n predicted experts' bytes into the
ring (n = n_host after a host-tier layer, n_device after a device-tier one), and nothing for a
device-tier or out-of-range layer; an experts call given the ring reads an expert the ring holds
for its layer from the ring, every other expert where it lives. The references: the ring's bytes
against the file's (the stack's raw blocks), and the experts products with the ring against the
same products read in place; that the ring is really read is shown by swapping a slot's bytes
for another expert's (the product then follows the swapped bytes). test_prefetch_experts_gpu.py
runs these tests on a GPU, where the copy runs on a stream of jaxvt's own and the kernels wait
for it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi

pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="jaxvt's extension is not built (pip install -e .)")

if ffi.available("cpu"):
  from jaxvt.ffi import ops, prefetch

from test_ffi_cases import Q4_K, Q6_K, Q8_0, make_stack  # noqa: E402
from test_ffi_cases import device, put, rng, tier  # noqa: E402,F401  (the shared fixtures)

E, ROWS, COLS, K = 12, 32, 512, 4
FMTS = [Q4_K, Q6_K, Q4_K, Q8_0, Q6_K]
HOST = (1, 2, 4)  # 1 after a device-tier layer, 2 after a host-tier one


def header(ring) -> dict:
  """The ring's XHeader fields (prefetch.h)."""
  r = np.asarray(ring)
  u32, i32 = r[:96].view(np.uint32), r[:96].view(np.int32)
  return dict(seq=int(u32[0]), layer=int(i32[1]), n=int(i32[2]),
              slot=int(r[16:24].view(np.int64)[0]), ids=i32[8:16].tolist(),
              tag=u32[16:24].tolist())


def slot_bytes(ring, j: int, nbytes: int) -> np.ndarray:
  h = header(ring)
  start = prefetch.XHEADER + j * h["slot"]
  return np.asarray(ring)[start:start + nbytes]


def expert_raw(stack, layer: int, e: int) -> np.ndarray:
  raw = np.asarray(stack.raws[layer]).reshape(E, ROWS, -1)
  return raw[e].reshape(-1)


@pytest.fixture
def stack(rng, tier):
  return make_stack(rng, FMTS, ROWS, COLS, experts=E, host=HOST, tier=tier)


@functools.partial(jax.jit, static_argnames=("n_host", "n_device", "inline"))
def fetched(w, target, ids, n_host=2, n_device=3, inline=False):
  """A new ring after one fetch, read back once the copy is done (join: on a GPU the copy runs on
  a stream of jaxvt's own; inline: on XLA's, in its command buffer)."""
  ring = prefetch.fetch_experts({"w": prefetch.new_expert_ring(w.meta)}, {"w": w}, target, ids,
                                n_host=n_host, n_device=n_device, inline=inline,
                                blocks=3 if inline else 0)["w"]
  return ring, prefetch.join(jnp.zeros((), jnp.float32), ring)


@pytest.fixture(params=[False, True], ids=["side", "inline"])
def inline(request):
  return request.param


PRED = np.array([7, 2, 11, 0, 5, 9, 3, 1], np.int32)


@pytest.mark.parametrize("target,n_expected", [(1, 3), (2, 2), (4, 3), (0, 0), (3, 0), (5, 0),
                                               (-1, 0)])
def test_fetch_copies_the_predicted_experts(stack, device, target, n_expected, inline):
  """n_host = 2 after a host-tier layer, n_device = 3 after a device-tier one; nothing for a
  device-tier or out-of-range target; each slot holds the file's bytes of its expert (the copy on
  a stream of jaxvt's own or inline)."""
  w = put(stack.w, device)
  ring, _ = fetched(w, jnp.int32(target), jnp.asarray(PRED), inline=inline)
  h = header(ring)
  assert h["n"] == n_expected
  assert h["slot"] == prefetch.expert_slot_bytes(w.meta)
  if n_expected == 0:
    assert h["layer"] == -1
    return
  assert h["layer"] == target and h["seq"] != 0
  assert h["ids"][:n_expected] == PRED[:n_expected].tolist()
  assert all(i == -2 for i in h["ids"][n_expected:])  # unused slots match no routed id
  assert h["tag"][:n_expected] == [h["seq"]] * n_expected
  for j in range(n_expected):
    want = expert_raw(stack, target, int(PRED[j]))
    np.testing.assert_array_equal(slot_bytes(ring, j, want.size), want)


@functools.partial(jax.jit, static_argnames=("when", "inline"))
def fetched_twice(w, first, second, ids, when, inline=False):
  """A ring fetched for `first` (any target), then for `second` under `when`."""
  rings = prefetch.fetch_experts({"w": prefetch.new_expert_ring(w.meta)}, {"w": w}, first, ids,
                                 n_host=2, n_device=3, inline=inline)
  rings = prefetch.fetch_experts(rings, {"w": w}, second, ids[::-1], n_host=2, n_device=3,
                                 when=when, inline=inline)
  return rings["w"], prefetch.join(jnp.zeros((), jnp.float32), rings["w"])


@pytest.mark.parametrize("when,second,fetches", [
    ("after_device", 1, True), ("after_device", 2, False), ("after_device", 3, False),
    ("after_host", 2, True), ("after_host", 1, False), ("after_host", 4, False),
    ("after_host", -1, False)])
def test_fetch_when(stack, device, when, second, fetches, inline):
  """A fetch for one kind of target (two rings a stack) copies that kind (layer 1 follows a
  device-tier layer, 2 a host-tier one) and leaves the ring as it was for any other target."""
  w = put(stack.w, device)
  ids = jnp.asarray(PRED)
  ring, _ = fetched_twice(w, jnp.int32(4), jnp.int32(second), ids, when, inline=inline)
  h = header(ring)
  if not fetches:  # layer 4's experts 7, 2, 11 still there, their tags those of its copy
    assert h["layer"] == 4 and h["ids"][:3] == PRED[:3].tolist() and h["n"] == 3
    assert h["tag"][:3] == [h["seq"]] * 3
    want = expert_raw(stack, 4, int(PRED[0]))
    np.testing.assert_array_equal(slot_bytes(ring, 0, want.size), want)
    return
  n = 2 if second == 2 else 3
  rev = PRED[::-1]
  assert h["layer"] == second and h["n"] == n and h["ids"][:n] == rev[:n].tolist()
  for j in range(n):
    want = expert_raw(stack, second, int(rev[j]))
    np.testing.assert_array_equal(slot_bytes(ring, j, want.size), want)


def test_fetch_skips_experts_out_of_range(stack, device):
  w = put(stack.w, device)
  ids = jnp.asarray(np.array([3, E + 4, -1, 6], np.int32))
  ring, _ = fetched(w, jnp.int32(1), ids, n_host=4, n_device=4)
  h = header(ring)
  assert h["n"] == 4 and h["ids"][:4] == [3, -2, -2, 6]


# Three stacks host-tier at different layers: 1, 2 and 4 for all three; 0 and 3 for "down" alone
# (its own layers 0-4 hold 4 experts' rows each: the byte counts differ, the rule does not)
SCALED_HOST = {"gate": (1, 2, 4), "up": (1, 2, 4), "down": (0, 1, 2, 3, 4)}


@functools.partial(jax.jit, static_argnames=("scale", "inline"))
def fetched_scaled(ws, target, ids, scale, inline=False):
  rings = {n: prefetch.new_expert_ring(w.meta) for n, w in ws.items()}
  rings = prefetch.fetch_experts(rings, ws, target, ids, n_host=2, n_device=3, inline=inline,
                                 blocks=8 if inline else 0, scale=scale)
  return rings, prefetch.join(jnp.zeros((), jnp.float32), rings["down"])


@pytest.mark.parametrize("scale", [0, 3, 2])
def test_fetch_scales_the_count_by_the_targets_host_stacks(rng, tier, device, scale, inline):
  """scale > 0: the counts are for a target with `scale` host-tier stacks; a target where k of
  the call's stacks are host-tier gets n * scale // k experts of each (at most 8), so a layer
  holding only its down stack in the host tier copies three times the experts of one holding all
  three (scale 3); every slot the file's bytes of its expert. scale 0: the counts as given."""
  ws, stacks = {}, {}
  for n, host in SCALED_HOST.items():
    stacks[n] = make_stack(rng, FMTS, ROWS, COLS, experts=E, host=host, tier=tier)
    ws[n] = put(stacks[n].w, device)
  for target in range(len(FMTS)):
    rings, _ = fetched_scaled(ws, jnp.int32(target), jnp.asarray(PRED), scale, inline=inline)
    k = sum(target in h for h in SCALED_HOST.values())
    for n, host in SCALED_HOST.items():
      h = header(rings[n])
      if target not in host:
        assert h["n"] == 0 and h["layer"] == -1, (n, target)
        continue
      base = 2 if target - 1 in host else 3  # n_host after a host-tier layer, else n_device
      want = min(8, base * scale // k) if scale else base
      assert h["n"] == want and h["layer"] == target, (n, target, h["n"], want)
      assert h["ids"][:want] == PRED[:want].tolist() and h["tag"][:want] == [h["seq"]] * want
      for j in range(want):
        raw = expert_raw(stacks[n], target, int(PRED[j]))
        np.testing.assert_array_equal(slot_bytes(rings[n], j, raw.size), raw)


def _routing(rng):
  # slots routed to the predicted experts 7 and 2, to others, and nowhere; none to 4
  ids = np.array([[7, 3, 2, 10], [2, 7, 8, -1], [5, 6, 7, 1]], np.int32)
  return jnp.asarray(ids), jnp.asarray(rng.standard_normal((3, COLS)).astype(np.float32))


@pytest.mark.parametrize("mode", ["ggml", "f32"])
@pytest.mark.parametrize("layer", [1, 2])
def test_experts_read_the_ring(rng, stack, device, mode, layer):
  """With the ring holding layer `layer`'s predicted experts the products are those read in
  place, bit for bit; with slot 0's bytes swapped for another expert's, the slots routed to the
  predicted expert give that other expert's product (the kernels read the ring); a ring holding
  another layer changes nothing."""
  w = put(stack.w, device)
  ids, x = _routing(rng)
  pred = jnp.asarray(PRED)

  @jax.jit
  def products(w, ring, layer, ids=ids):
    return (ops.qmatmul_experts(x, w, layer, ids, mode, ring=ring),
            ops.qmatmul_experts(x, w, layer, ids, mode))

  ring, _ = fetched(w, jnp.int32(layer), pred)
  with_ring, in_place = products(w, ring, jnp.int32(layer))
  np.testing.assert_array_equal(np.asarray(with_ring), np.asarray(in_place))

  # slot 0 (expert 7) now holds expert 4's bytes
  h = header(ring)
  swapped = np.array(ring)
  src = expert_raw(stack, layer, 4)
  start = prefetch.XHEADER
  swapped[start:start + src.size] = src
  got, _ = products(w, jnp.asarray(swapped), jnp.int32(layer))
  # the reference: expert 4 read in place where 7 was routed (4 is routed nowhere else, so the
  # experts are grouped alike)
  _, ref4 = products(w, ring, jnp.int32(layer), jnp.where(ids == 7, 4, ids))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref4))
  routed7 = np.asarray(ids) == 7
  assert not np.array_equal(np.asarray(got)[routed7], np.asarray(in_place)[routed7])
  assert h["ids"][0] == 7
  # the same swapped ring at another layer: nothing read from it
  other = 4 if layer != 4 else 1
  got_other, ref_other = products(w, jnp.asarray(swapped), jnp.int32(other))
  np.testing.assert_array_equal(np.asarray(got_other), np.asarray(ref_other))


def test_moe_experts_with_rings_equal_in_place(rng, tier, device):
  """ops.moe_experts with the three stacks' rings (gate and up in one call on a GPU) gives the
  in-place result bit for bit, at a host-tier layer whose predicted experts are partly routed."""
  f = 256  # the expert hidden size: down's rows are its blocks
  stacks = {n: make_stack(rng, FMTS, f if n != "down" else COLS, COLS if n != "down" else f,
                          experts=E, host=HOST, tier=tier) for n in ("gate", "up", "down")}
  ws = {n: put(s.w, device) for n, s in stacks.items()}
  x = jnp.asarray(rng.standard_normal((1, COLS)).astype(np.float32))
  ids = jnp.asarray(np.array([[7, 4, 2, 10]], np.int32))
  wts = jnp.asarray(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32))

  @jax.jit
  def run(ws, layer):
    rings = {n: prefetch.new_expert_ring(ws[n].meta) for n in ws}
    rings = prefetch.fetch_experts(rings, ws, layer, jnp.asarray(PRED), n_host=3, n_device=3)
    args = (x, ws["gate"], ws["up"], ws["down"], layer, ids, wts)
    y = ops.moe_experts(*args, mode="q8", rings=rings)
    for r in rings.values():
      y = prefetch.join(y, r)
    return y, ops.moe_experts(*args, mode="q8")

  for layer in (1, 2, 3):
    a, b = run(ws, jnp.int32(layer))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# In the model: decode with the next host-tier layer's likeliest experts copied ahead


@pytest.fixture(scope="module", params=["qwen35moe", "qwen3moe"])
def moe8(tmp_path_factory, request):
  from jaxvt import synth
  extra = dict(shared_ffn_dim=256) if request.param == "qwen35moe" else {}
  cfg = synth.tiny_config(request.param, n_layers=8, d_model=256, expert_ffn_dim=256, **extra)
  path = str(tmp_path_factory.mktemp("predict") / f"{request.param}8.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=7)
  return path


def test_decode_with_predicted_experts_equals_in_place(moe8, device, tier):
  """Routed experts of layers 1, 2, 5 (and layer 7's down only) in the host tier: 10 greedy decode
  steps with the predicted experts copied ahead give the logits and cache of the same program
  reading every expert in place, bit for bit (qwen35moe: a period of 4 layers, two ring sets;
  qwen3moe: 1, one set); the program holds the expert fetches only when asked, and only at one
  token."""
  import dataclasses
  from jaxvt import engine, loader
  from jaxvt.model import decoder
  from jaxvt.ffi.tuning import Products
  from jaxvt.model.sharding import one_device
  from test_prefetch import routed_on_host
  m = loader.open_model(moe8)
  par = one_device(device)
  weights = loader.place(m, routed_on_host, par=par, host=tier)
  base = engine.exec_for(device.platform, True, par)
  off = dataclasses.replace(base, products=Products())
  on = dataclasses.replace(base, products=Products(predict_after_host=2, predict_after_device=6))
  # the copy on XLA's stream, in its command buffers run concurrently (on a GPU)
  inline = dataclasses.replace(on, products=dataclasses.replace(on.products, predict_inline=True,
                                                                predict_blocks=5),
                               concurrent=True)
  n_ctx, prompt = 24, 6
  toks = jnp.asarray(np.random.default_rng(5).integers(3, 300, (1, prompt)), jnp.int32)

  def run(ex):
    cache = decoder.init_cache(m.cfg, 1, n_ctx)
    logits, cache = engine.prefill_fn(
        weights, cache, toks, jnp.arange(prompt, dtype=jnp.int32)[None],
        jnp.ones((1, prompt), bool), jnp.asarray([prompt - 1], jnp.int32), cfg=m.cfg, ex=ex,
        kv_len=n_ctx)
    out = [np.asarray(logits)]
    for i in range(10):
      tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
      logits, cache = engine.decode_fn(weights, cache, tok,
                                       jnp.asarray([[prompt + i]], jnp.int32), cfg=m.cfg, ex=ex,
                                       kv_len=n_ctx)
      out.append(np.asarray(logits))
    return out, {k: np.asarray(v) for k, v in cache.items()}

  # and the GPU's rule: 2 experts at 8 blocks for layers 1, 2 and 5, whose three stacks are in
  # the host tier, 6 at 4 for layer 7's down stack alone (predict_scale)
  six = dataclasses.replace(inline, products=dataclasses.replace(
      inline.products, predict_after_host=2, predict_after_device=2, predict_blocks=8,
      predict_scale=3))
  l_off, c_off = run(off)
  for ex in (on, inline, six):
    l_ex, c_ex = run(ex)
    for a, b in zip(l_ex, l_off):
      np.testing.assert_array_equal(a, b)
    for k in c_off:
      np.testing.assert_array_equal(c_ex[k], c_off[k])
  cache = jax.eval_shape(lambda: decoder.init_cache(m.cfg, 1, n_ctx))
  one = (jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))
  text = lambda ex: engine.decode_fn.lower(weights, cache, *one, cfg=m.cfg, ex=ex,
                                           kv_len=n_ctx).as_text()
  assert "jaxvt_prefetch_experts" in text(on) and "jaxvt_prefetch_experts" not in text(off)
  assert "jaxvt_prefetch_experts_inline" in text(inline)
  assert "jaxvt_prefetch_experts_inline" not in text(on)
  assert text(six) != text(inline)
  assert "has_side_effect = true" not in text(on)
  # a prefill (many tokens) predicts nothing
  pre = engine.prefill_fn.lower(weights, cache, toks, jnp.arange(prompt, dtype=jnp.int32)[None],
                                jnp.ones((1, prompt), bool), jnp.asarray([prompt - 1], jnp.int32),
                                cfg=m.cfg, ex=on, kv_len=n_ctx).as_text()
  assert "jaxvt_prefetch_experts" not in pre


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_experts2_read_the_rings(rng, tier, device, mode):
  """ops.qmatmul_experts2 (gate and up in one launch on a GPU) reads each stack's ring: with slot
  0 of the first stack's ring swapped for another expert's bytes, the first product follows the
  swapped bytes and the second is the in-place one."""
  s0, s1 = (make_stack(rng, FMTS, ROWS, COLS, experts=E, host=HOST, tier=tier) for _ in range(2))
  w0, w1 = put(s0.w, device), put(s1.w, device)
  ids, x = _routing(rng)
  layer = 1
  r0, _ = fetched(w0, jnp.int32(layer), jnp.asarray(PRED))
  r1, _ = fetched(w1, jnp.int32(layer), jnp.asarray(PRED))
  swapped = np.array(r0)
  src = expert_raw(s0, layer, 4)
  swapped[prefetch.XHEADER:prefetch.XHEADER + src.size] = src

  @jax.jit
  def run(w0, w1, r0, r1, ids):
    return (ops.qmatmul_experts2(x, w0, w1, jnp.int32(layer), ids, mode, rings=(r0, r1)),
            ops.qmatmul_experts2(x, w0, w1, jnp.int32(layer), ids, mode))

  (g, u), (g_in, u_in) = run(w0, w1, jnp.asarray(swapped), r1, ids)
  _, (g4, _) = run(w0, w1, r0, r1, jnp.where(ids == 7, 4, ids))
  np.testing.assert_array_equal(np.asarray(g), np.asarray(g4))
  np.testing.assert_array_equal(np.asarray(u), np.asarray(u_in))
  assert not np.array_equal(np.asarray(g), np.asarray(g_in))
