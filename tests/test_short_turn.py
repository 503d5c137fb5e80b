"""Short calls through the expert cache (Products.routed_per_expert, jaxvt.offload.cost
.routed_crossover) and a batch's shared expert reads, on the CPU kernels.

The references: the crossover against the two paths' costs computed in float64 from the
distinct-expert count of uniform routing (its defining equation, not its bisection); the short
prefill through the cache against the same call streamed (each host-tier layer copied whole
into a ring, the per-slot kernels reading the copy), bit for bit, turn after turn, and its
cache counters against the real tokens' routed slots counted here (padding reads no expert); a
decode batch of identical rows against the same batch without the cache, bit for bit, with one
fill per distinct expert however many rows route to it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvt
from jaxvt import engine, ffi
from jaxvt.ffi.tuning import GPU_PRODUCTS, ROUTED_SLOTS_MAX, Products, products_for
from jaxvt.model.presets import qwen36_35b_a3b_config
from jaxvt.offload import cost
from jaxvt.offload import schedule
from jaxvt.offload.expert_cache import CACHE

needs_ext = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")


def _costs(r: float, E: int, rates: cost.Rates, h: float) -> tuple[float, float]:
  """(routed, streamed) seconds per expert byte of a call of r * E slots over E experts."""
  S = r * E
  distinct = E * (1.0 - (1.0 - 1.0 / E) ** S)
  streamed = distinct / (rates.host_read_gbps * 1e9)
  routed = (1 - h) * distinct / (rates.host_read_gbps * 1e9) + S / (rates.device_read_gbps * 1e9)
  return routed, streamed


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("hit", [0.2, cost.ROUTED_HIT_RATE, 0.9])
def test_the_crossover_is_where_the_paths_cost_the_same(platform, hit):
  """Below the crossover the routed path costs less than streaming the distinct experts, above
  it more (a large layer, where the exponential form is exact to 1e-4); a warmer cache moves it
  up."""
  rates = cost.DEFAULT_RATES[platform]
  r = cost.routed_crossover(rates, hit)
  assert r > 0
  rb, sb = _costs(0.98 * r, 1 << 16, rates, hit)
  ra, sa = _costs(1.02 * r, 1 << 16, rates, hit)
  assert rb < sb and ra > sa
  assert cost.routed_crossover(rates, min(1.0, hit + 0.05)) > r


def test_no_crossover_where_the_host_tier_is_as_fast():
  """On the CPU both tiers are the host's DRAM: the routed path never wins, and the CPU's row is
  the tuning table's own."""
  assert cost.routed_crossover(cost.DEFAULT_RATES["cpu"]) == 0
  assert cost.products_for("cpu") == products_for("cpu")
  with pytest.raises(ValueError):
    cost.routed_crossover(cost.DEFAULT_RATES["cuda"], 0.0)


def test_a_chats_next_turn_takes_the_cache_on_a_gpu():
  """The GPU row with the cost model's crossover, on the 35B model (256 experts, 8 a token): a
  64-token program (a 20-token turn's bucket) reads through the expert cache and takes no layer
  rings, in every tier (the rule sees slots and experts only); a 256-token one streams, as
  before; the cap is the cache's call limit."""
  cfg = qwen36_35b_a3b_config(n_nextn=0)
  p = cost.products_for("cuda")
  assert p.routed_per_expert == cost.routed_crossover(cost.DEFAULT_RATES["cuda"])
  assert dataclasses.replace(p, routed_per_expert=0) == GPU_PRODUCTS
  k, E = cfg.n_experts_used, cfg.n_experts
  assert cost.routed_tokens(p, cfg) == ROUTED_SLOTS_MAX // k == 127
  assert p.routed(64 * k, E) and p.experts(64 * k, E) == "matvec"
  assert GPU_PRODUCTS.experts(64 * k, E) == "grouped"  # the path it replaces
  assert not p.routed(256 * k, E) and p.experts(256 * k, E) == "grouped"
  assert p.experts(64 * k) == "grouped"  # experts not known: the plain rule
  ex = engine.Exec(kernels=True, numerics="q8", products=p)
  w = {CACHE: object()}
  assert schedule.cached(w, cfg, ex, 64) and not schedule.prefetched(w, cfg, ex, 64)
  assert not schedule.cached(w, cfg, ex, 128)
  # a small layer (8 experts, 2 a token) crosses over before the cap
  small = dataclasses.replace(cfg, n_experts=8, n_experts_used=2)
  assert cost.routed_tokens(p, small) == int(p.routed_per_expert * 8) // 2


# ---- on the engine (CPU kernels, the GPU's kind of rule) ------------------------------------

@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
  """32 experts, 2 a token: a few tokens route to a few of a layer's experts."""
  from jaxvt import synth
  cfg = synth.tiny_config("qwen35moe", d_model=256, expert_ffn_dim=256, shared_ffn_dim=256,
                          n_layers=4, n_experts=32, n_experts_used=2)
  path = str(tmp_path_factory.mktemp("shortturn") / "qwen35moe.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=5)
  return path


def _prefill(eng, ex, cache, tokens: list[int], start: int, T: int, weights=None):
  """One prefill program of T positions holding `tokens` from `start`: (logits, cache)."""
  n = len(tokens)
  toks = jnp.asarray([tokens + [0] * (T - n)], jnp.int32)
  pos = jnp.arange(start, start + T, dtype=jnp.int32)[None]
  valid = jnp.arange(T)[None] < n
  last = jnp.asarray([n - 1], jnp.int32)
  return engine.prefill_fn(eng.weights if weights is None else weights, cache, toks, pos, valid,
                           last, cfg=eng.cfg, ex=ex, kv_len=eng.kv_len(start + T))


def _same(got, want, what: str) -> None:
  """Bit for bit on the CPU. On a GPU to float32 rounding: the expert products are the same bits
  (the decode-batch test below holds them to that), but XLA:GPU compiles the jnp parts of each
  program (norms, the DeltaNet mixer's prefill, attention) for that program, and a program that
  reads through the cache holds other ops than a streamed one; the first GPU run found ulp-level
  differences in an attention layer's K rows (3% of them, at most 4.8e-7)."""
  got, want = np.asarray(got), np.asarray(want)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(got, want, err_msg=what)
  else:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(np.abs(want).max(), 1e-30),
                               err_msg=what)


def _stats(eng):
  return jaxvt.engine.expert_cache_stats(eng.weights)


@needs_ext
def test_short_turns_read_through_the_cache_with_the_streamed_bits(moe_file):
  """Every routed expert in the host tier, a cache for all of them. Two turns (12 tokens, then
  5 more after them), each a 16-position program: streamed (whole layers copied into rings),
  routed (the crossover above 16 positions) and routed without the cache (each expert read in
  place) give the same logits and KV cache bit for bit (on a GPU to float32 rounding: _same);
  the routed calls count exactly the real tokens' routed slots in every cached layer (padding
  routes nowhere), fill each distinct expert once, and the second turn hits what the first
  filled."""
  with jaxvt.load(moe_file, max_context=64, offload_gb=64, expert_cache_gb=0.05) as eng:
    cp = eng.plan.expert_cache
    cfg = eng.cfg
    assert cp is not None and cp.slots == cfg.n_experts
    k, E, T = cfg.n_experts_used, cfg.n_experts, 16
    streamed = dataclasses.replace(eng.ex, products=Products(prefetch_per_expert=1))
    routed = dataclasses.replace(eng.ex, products=Products(prefetch_per_expert=1,
                                                           routed_per_expert=T * k / E))
    assert schedule.prefetched(eng.weights, cfg, streamed, T)
    assert not schedule.cached(eng.weights, cfg, streamed, T)
    assert schedule.cached(eng.weights, cfg, routed, T)
    rng = np.random.default_rng(7)
    turns = [[int(t) for t in rng.integers(3, 300, 12)], [int(t) for t in rng.integers(3, 300, 5)]]
    plain = {n: v for n, v in eng.weights.items() if n != CACHE}
    arms = {"streamed": (streamed, None), "routed": (routed, None), "uncached": (routed, plain)}
    caches = {a: eng.new_cache(1) for a in arms}
    start = 0
    for i, toks in enumerate(turns):
      got = {}
      for name, (ex, w) in arms.items():
        if name == "routed":
          before = _stats(eng)
        got[name], caches[name] = _prefill(eng, ex, caches[name], toks, start, T, w)
        if name == "routed":
          d = _stats(eng) - before
      for name in ("routed", "uncached"):
        _same(got[name], got["streamed"], "logits")
        for key in caches[name]:
          _same(caches[name][key], caches["streamed"][key], key)
      assert d.hits + d.misses == len(toks) * k * len(cp.layers)  # padding read nothing
      assert 0 < d.fills <= d.misses and d.fill_bytes > 0
      if i == 0:  # a cold cache: tokens share experts, each filled once
        assert d.hits == 0 and d.fills < d.misses
      else:
        assert d.hits > 0
      start += len(toks)


@needs_ext
def test_a_batch_of_identical_rows_fills_each_expert_once(moe_file):
  """8 identical rows through a decode step with the cache (cold): one miss per routed slot,
  one fill per distinct expert (a row's k in each cached layer), and the logits of the same step
  without the cache, bit for bit."""
  with jaxvt.load(moe_file, max_context=64, offload_gb=64, expert_cache_gb=0.05) as eng:
    cp = eng.plan.expert_cache
    k, B = eng.cfg.n_experts_used, 8
    toks = jnp.full((B, 1), 17, jnp.int32)
    pos = jnp.zeros((B, 1), jnp.int32)
    plain_w = {n: v for n, v in eng.weights.items() if n != CACHE}
    want, _ = engine.decode_fn(plain_w, eng.new_cache(B), toks, pos, cfg=eng.cfg, ex=eng.ex,
                               kv_len=eng.kv_len(1))
    before = _stats(eng)
    got, _ = engine.decode_fn(eng.weights, eng.new_cache(B), toks, pos, cfg=eng.cfg, ex=eng.ex,
                              kv_len=eng.kv_len(1))
    d = _stats(eng) - before
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    n = len(cp.layers)
    assert (d.hits, d.misses, d.fills) == (0, B * k * n, k * n)
