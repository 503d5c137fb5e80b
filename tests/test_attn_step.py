"""The fused attention decode step (jaxvt.ffi.attn.attn_step) against its jnp reference
(jaxvt.model.layers.attn_step_ref, the model's own functions), and in the model: a decode under a
rule with attn_fused against the jnp path. tests/test_attn_step_gpu.py reruns the op's tests on a
GPU (the `device` fixture)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvt
from jaxvt import engine, ffi
from jaxvt.errors import JaxvtError
from jaxvt.ffi import attn
from jaxvt.model import sharding
from jaxvt.ffi.tuning import GPU_PRODUCTS, Products
from jaxvt.model.layers import attn_step_ref

from test_ffi_cases import (assert_rel, assert_written_in_place, chained_steps, decode_text,
                            kernel_and_reference, prefill_text)
from test_ffi_cases import device  # noqa: F401  (the shared fixture: the CPU)
from test_qwen_fixtures import MOE8, synth_file

pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")

# Relative to each output's largest magnitude: float32 sums of up to a few thousand terms in
# another order than XLA's, and cos / sin / exp from another library, stay within a few
# hundred ulps (2^-23 = 1.2e-7).
TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
  b: int
  H: int
  K: int
  D: int
  Dv: int
  rope_dim: int
  gate: bool
  qk_norm: bool
  interleaved: bool
  S: int  # cache positions
  kv_len: int
  positions: tuple  # one per row
  theta: float = 1e4
  A: int = 3  # attention layers in the stacks


CASES = {
    # the Qwen3.5/3.6 35B shape: 16 heads over 2 kv heads of 256, 64 rotary dims, gate, q/k norm
    "35b": Case(1, 16, 2, 256, 256, 64, True, True, False, 300, 256, (200,), theta=1e7),
    "35b_b2_long": Case(2, 16, 2, 256, 256, 64, True, True, False, 1100, 1024, (700, 37),
                        theta=1e7, A=2),
    # llama-like: interleaved RoPE on every dim, no gate, no q/k norm
    "llama": Case(2, 8, 2, 64, 64, 64, False, False, True, 80, 64, (3, 40)),
    "gqa1": Case(2, 4, 4, 32, 32, 32, False, True, False, 48, 48, (47, 0)),
    "rows_buckets": Case(3, 4, 2, 64, 64, 32, True, True, False, 1100, 1024, (0, 500, 1023)),
    "end_of_cache": Case(2, 4, 2, 32, 32, 16, False, True, False, 64, 64, (63, 64)),
    "beyond_kv_len": Case(2, 4, 2, 32, 32, 16, True, True, False, 100, 64, (80, 63)),
    "dv_partial_rope": Case(2, 6, 3, 64, 32, 16, False, True, True, 40, 40, (10, 39)),
    "group16": Case(1, 16, 1, 128, 128, 128, False, True, False, 40, 40, (25,)),
    "long_chunks": Case(1, 4, 2, 64, 64, 64, True, True, False, 8192, 8192, (5000,), theta=1e6,
                        A=1),
    "max_chunk": Case(1, 2, 1, 32, 32, 32, False, True, False, 40000, 40000, (39999,),
                      theta=1e6, A=1),
}


def params(c: Case) -> dict:
  return dict(kv_len=c.kv_len, theta=c.theta, rope_dim=c.rope_dim, interleaved=c.interleaved,
              eps=1e-6, gate=c.gate, qk_norm=c.qk_norm)


def make_inputs(rng, c: Case, layer=None, positions=None) -> dict:
  """Random operands of attn_step on stacks of c.A layers with random caches; `layer` random
  in [0, A) unless given."""
  n = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(np.float32)
  layer = int(rng.integers(0, c.A)) if layer is None else layer
  pos = c.positions if positions is None else positions
  return dict(q=n(c.b, c.H * c.D * (2 if c.gate else 1)), k=n(c.b, c.K * c.D),
              v=n(c.b, c.K * c.Dv), q_norm=1 + n(c.A, c.D, scale=0.1),
              k_norm=1 + n(c.A, c.D, scale=0.1), k_cache=n(c.A, c.b, c.S, c.K, c.D),
              v_cache=n(c.A, c.b, c.S, c.K, c.Dv), layer=np.int32(layer),
              positions=np.asarray(pos, np.int32))


def _fns(device, c: Case):
  """(the kernel on `device`, the reference on the CPU), each taking numpy operands; the
  kernel's cache stacks donated."""
  p = params(c)
  return kernel_and_reference(device, functools.partial(attn.attn_step, **p),
                              functools.partial(attn_step_ref, **p), ("k_cache", "v_cache"))


def assert_close(got, want, what):
  assert_rel(got, want, what, TOL)


def written(x, c: Case) -> np.ndarray:
  """bool [A, b, S]: the cache rows a step writes (layer clamped, positions in the cache)."""
  m = np.zeros((c.A, c.b, c.S), bool)
  l = int(np.clip(x["layer"], 0, c.A - 1))
  for r, p in enumerate(np.asarray(x["positions"])):
    if 0 <= p < c.S:
      m[l, r, p] = True
  return m


def assert_step(got, want, x, c: Case, what):
  """o close to the reference; the written cache rows close; every other row bit for bit."""
  ok, kk, vk = map(np.asarray, got)
  orf, kr, vr = map(np.asarray, want)
  assert_close(ok, orf, f"o, {what}")
  m = written(x, c)
  for name, k, r, old in (("k", kk, kr, x["k_cache"]), ("v", vk, vr, x["v_cache"])):
    assert_close(k[m], r[m], f"{name} written rows, {what}")
    np.testing.assert_array_equal(k[~m], np.asarray(old)[~m], err_msg=f"{name} others, {what}")


@pytest.mark.parametrize("name", list(CASES))
def test_step_matches_reference(name, device):
  """One step on a random layer of the stacks: o, the written rows and the rest of the caches."""
  c = CASES[name]
  rng = np.random.default_rng(sum(map(ord, name)))
  kern, ref = _fns(device, c)
  x = make_inputs(rng, c)
  assert_step(kern(**dict(x)), ref(**x), x, c, name)


@pytest.mark.parametrize("name", ["35b", "llama", "rows_buckets"])
def test_chained_steps(name, device):
  """Four decode steps at increasing positions, each on a random layer, each kernel's caches fed
  to its next step (and the reference's to its): o and the caches agree every step."""
  c = CASES[name]
  rng = np.random.default_rng(7 + len(name))
  kern, ref = _fns(device, c)
  first = make_inputs(rng, c)
  at = lambda step: tuple(min(p + step, c.kv_len - 1) for p in c.positions)
  for step, xk, got, want in chained_steps(kern, ref, first,
                                           lambda step: make_inputs(rng, c, positions=at(step)),
                                           ("k_cache", "v_cache")):
    assert_step(got, want, xk, c, f"step {step}")
    assert_close(got[1], want[1], f"k stack, step {step}")
    assert_close(got[2], want[2], f"v stack, step {step}")


@pytest.mark.parametrize("layer", [-3, 0, 2, 7])
def test_layer_index_is_clamped(layer, device):
  """An index outside the stacks reads and writes the nearest layer (as the reference's clamp),
  never outside the buffers."""
  c = CASES["beyond_kv_len"]
  kern, ref = _fns(device, c)
  x = make_inputs(np.random.default_rng(11), c, layer=layer)
  assert_step(kern(**dict(x)), ref(**x), x, c, f"layer {layer}")


def test_attributes_matter_and_results_repeat(device):
  """The rotary layout, the gate and the q/k norm reach the kernel (each changes o), and a
  second call gives the same bits."""
  base = CASES["dv_partial_rope"]
  x = make_inputs(np.random.default_rng(3), base, layer=1)
  o = lambda c: np.asarray(_fns(device, c)[0](**dict(x))[0])
  want = o(base)
  for change in (dict(interleaved=False), dict(qk_norm=False), dict(theta=1e6)):
    other = o(dataclasses.replace(base, **change))
    assert np.abs(other - want).max() > 100 * TOL * np.abs(want).max(), change
  kern, _ = _fns(device, base)
  for got, again in zip(kern(**dict(x)), kern(**dict(x))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))
  gated = dataclasses.replace(CASES["beyond_kv_len"])
  xg = make_inputs(np.random.default_rng(4), gated, layer=0)
  a = np.asarray(_fns(device, gated)[0](**dict(xg))[0])
  xz = {**xg, "q": xg["q"].copy()}
  xz["q"].reshape(gated.b, gated.H, 2, gated.D)[:, :, 1] = 30.0  # sigmoid(gate) = 1
  b = np.asarray(_fns(device, gated)[0](**xz)[0])
  assert np.abs(a - b).max() > 100 * TOL * np.abs(b).max()


def test_not_donated_leaves_operands(device):
  """Without donation XLA copies the stacks before the in-place call: the caller's arrays keep
  their values, the results hold the step."""
  c = CASES["llama"]
  x = make_inputs(np.random.default_rng(5), c)
  xd = jax.device_put(x, device)
  before = [np.asarray(xd[k]).copy() for k in ("k_cache", "v_cache")]
  got = jax.jit(lambda x: attn.attn_step(**x, **params(c)))(xd)
  for k, b in zip(("k_cache", "v_cache"), before):
    np.testing.assert_array_equal(np.asarray(xd[k]), b)
  _, ref = _fns(device, c)
  assert_step(got, ref(**x), x, c, "not donated")


def test_other_cache_dtype_falls_back(device):
  """A bfloat16 cache is converted, updated and converted back (not in place): the results
  agree with the reference on the same bfloat16 cache to bfloat16 rounding."""
  c = CASES["llama"]
  x = make_inputs(np.random.default_rng(6), c)
  x = {**x, "k_cache": jnp.asarray(x["k_cache"], jnp.bfloat16),
       "v_cache": jnp.asarray(x["v_cache"], jnp.bfloat16)}
  got = jax.jit(lambda x: attn.attn_step(**x, **params(c)))(jax.device_put(x, device))
  want = jax.jit(lambda x: attn_step_ref(**x, **params(c)))(x)
  assert got[1].dtype == jnp.bfloat16 and got[2].dtype == jnp.bfloat16
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.abs(g - w).max() <= 1e-2 * np.abs(w).max()


def test_chunk_rule():
  assert [attn.chunk(n) for n in (1, 256, 1024, 2048, 2049, 4096, 16384, 65536, 262144)] == [
      16, 16, 16, 16, 32, 32, 128, 256, 256]


def test_shape_errors():
  c = CASES["beyond_kv_len"]
  x = make_inputs(np.random.default_rng(0), c)
  p = params(c)
  with pytest.raises(JaxvtError, match="do not fit"):
    attn.attn_step(**{**x, "q": x["q"][:, 1:]}, **p)
  with pytest.raises(JaxvtError, match="do not fit"):
    attn.attn_step(**{**x, "positions": np.zeros(3, np.int32)}, **p)
  with pytest.raises(JaxvtError, match="do not fit"):
    attn.attn_step(**{**x, "layer": np.zeros(1, np.int32)}, **p)
  with pytest.raises(JaxvtError, match="do not fit"):
    attn.attn_step(**x, **{**p, "kv_len": c.S + 1})
  with pytest.raises(JaxvtError, match="do not fit"):
    attn.attn_step(**x, **{**p, "rope_dim": 7})
  with pytest.raises(JaxvtError, match="must be"):
    attn.attn_step(**{**x, "k_cache": x["k_cache"][0]}, **p)
  big = Case(1, 2, 1, 264, 264, 8, False, False, False, 4, 4, (0,))
  with pytest.raises(JaxvtError, match="at most 256"):
    attn.attn_step(**make_inputs(np.random.default_rng(0), big), **params(big))


# ---- in the model ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen35moe", "llama"])
def model(request, tmp_path_factory):
  # qwen35moe: 8 layers (two attention layers; two periods, so the decode scan stays a loop)
  moe = request.param == "qwen35moe"
  return synth_file(tmp_path_factory.mktemp("attn"), request.param, "q4_k_m" if moe else "q8_0",
                    5, **(MOE8 if moe else dict(n_layers=2)))[1]


def _rule(eng, on: bool):
  """The engine's rule in q8 numerics (the GPU's; on the CPU the kernel stands in for the GPU's)
  with attn_fused on or off."""
  return dataclasses.replace(eng.ex, numerics="q8",
                             products=dataclasses.replace(eng.ex.products, attn_fused=on))


def _cache(eng, b):
  return sharding.init_cache(eng.cfg, eng.ex.par, b, eng.max_context, kv_dtype=jnp.float32)


def test_fused_decode_in_the_model(model):
  """A tiny model decodes 6 greedy tokens on two rows at different positions after a prefill,
  once with attn_fused and once without: logits close, the same tokens; only the fused decode
  program holds jaxvt_attn_step, and prefill never does."""
  assert GPU_PRODUCTS.attn_fused and not Products().attn_fused
  with jaxvt.load(model, max_context=64) as eng:
    plain, fused = _rule(eng, False), _rule(eng, True)
    rng = np.random.default_rng(4)
    lens, T = (11, 6), 16
    toks = np.zeros((2, T), np.int32)
    for r, n in enumerate(lens):
      toks[r, :n] = rng.integers(3, 300, n)
    pre = (jnp.asarray(toks), jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T)),
           jnp.asarray(np.arange(T)[None] < np.asarray(lens)[:, None]),
           jnp.asarray(lens, jnp.int32) - 1)
    _, cache = engine.prefill_fn(eng.weights, _cache(eng, 2), *pre, cfg=eng.cfg, ex=plain,
                                 kv_len=eng.kv_len(T))
    copy = lambda c: jax.tree.map(jnp.copy, c)

    def decode(ex, cache, n=6):
      logits, toks_out = [], []
      tok = toks[np.arange(2), np.asarray(lens) - 1]
      for i in range(n):
        pos = np.asarray(lens) + i
        lg, cache = engine.decode_fn(eng.weights, cache, jnp.asarray(tok[:, None], jnp.int32),
                                     jnp.asarray(pos[:, None], jnp.int32), cfg=eng.cfg, ex=ex,
                                     kv_len=eng.kv_len(int(pos.max()) + 1))
        logits.append(np.asarray(lg))
        tok = np.argmax(logits[-1], axis=-1)
        toks_out.append(tok.tolist())
      return np.stack(logits), toks_out

    want, want_toks = decode(plain, copy(cache))
    got, got_toks = decode(fused, copy(cache))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
    assert got_toks == want_toks

    spec = jax.eval_shape(lambda: _cache(eng, 1))
    lower = lambda ex: decode_text(eng, spec, ex, 1, 3, eng.kv_len(4))
    assert "jaxvt_attn_step" in lower(fused) and "jaxvt_attn_step" not in lower(plain)
    text = prefill_text(eng, spec, fused, T)
    assert "jaxvt_attn_step" not in text


def test_fused_decode_updates_the_cache_in_place(model):
  """The compiled decode program with attn_fused writes the cache's k / v stacks only through
  jaxvt_attn_step's aliased results: no copy, scatter, dynamic-update-slice or fusion producing
  a whole [n_attn, b, S, K, D] stack (the jnp path has them)."""
  with jaxvt.load(model, max_context=64) as eng:
    spec = jax.eval_shape(lambda: _cache(eng, 1))
    compiled = lambda on: decode_text(eng, spec, _rule(eng, on), 1, 3, eng.kv_len(4), True)
    assert_written_in_place(compiled(True), compiled(False), "jaxvt_attn_step",
                            {name: spec[name].shape for name in ("k", "v")})
