"""The MoE router as one custom call (route.moe_route, csrc/common/route.h) against its jnp
reference (route.moe_route_ref: softmax in float32, lax.top_k, renormalisation), which always
runs on the CPU backend: the same ids and weights to float32 rounding on random logits without near-ties,
exact ties to the lower expert index (across lanes and registers of the GPU kernel), NaN rows,
batched shapes, and the model with Products.fused_route on and off (same greedy tokens).

The kernels run on `device` (the CPU here; tests/test_moe_route_gpu.py re-runs these on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvt
from jaxvt import engine, ffi, synth
from jaxvt.errors import JaxvtError
from jaxvt.ffi import route

pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")

CPU = jax.devices("cpu")[0]


@pytest.fixture(scope="module")
def device():
  return CPU


@functools.partial(jax.jit, static_argnums=(1, 2))
def fused(logits, k, renormalise):
  return route.moe_route(logits, k, renormalise)


@functools.partial(jax.jit, static_argnums=(1, 2))
def reference(logits, k, renormalise):
  return route.moe_route_ref(logits, k, renormalise)


def run(fn, logits, k, renormalise, device):
  ids, wts = fn(jax.device_put(jnp.asarray(logits, jnp.float32), device), k, renormalise)
  return np.asarray(ids), np.asarray(wts)


def spaced_logits(rng, T: int, E: int) -> np.ndarray:
  """[T, E] logits without near-ties: each row a random permutation of E evenly spaced values
  (spacing 0.004 to 0.75, so neighbouring probabilities differ by 0.4% or more, far above float32
  rounding) plus a random offset (the max subtraction matters)."""
  step = rng.uniform(0.5, 1.5, (T, 1)) * min(0.5, 4.0 / E)
  ranks = np.argsort(rng.random((T, E)), axis=1)
  return (ranks * step + rng.uniform(-20, 20, (T, 1))).astype(np.float32)


CASES = [(E, k) for E in (8, 64, 256, 512) for k in sorted({1, 2, 8, E}) if k <= E]


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("E,k", CASES)
def test_matches_reference(device, E, k, renormalise):
  rng = np.random.default_rng(E * 1000 + k)
  for T in (1, 5, 130):
    x = spaced_logits(rng, T, E)
    ids, wts = run(fused, x, k, renormalise, device)
    want_ids, want_wts = run(reference, x, k, renormalise, CPU)
    assert ids.dtype == np.int32 and wts.dtype == np.float32 and ids.shape == (T, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(wts, want_wts, rtol=1e-5, atol=0)
    if renormalise:
      np.testing.assert_allclose(wts.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("renormalise", [True, False])
def test_exact_ties_go_to_the_lower_index(device, renormalise):
  """Ties between experts in the same lane (1 and 33 differ by 32), across lanes, and in
  different registers of one lane; rows of one value everywhere; and the reference agrees."""
  E, k = 512, 8
  x = np.full((3, E), -5.0, np.float32)
  x[0, [300, 33, 1, 511, 64]] = 2.0  # five-way tie at the top
  x[0, [480, 3]] = 1.0  # then a two-way tie, then the lowest index of the -5 rest
  x[1] = 0.25  # every expert tied
  x[2, [40, 8]] = 7.0
  ids, wts = run(fused, x, k, renormalise, device)
  assert ids[0].tolist() == [1, 33, 64, 300, 511, 3, 480, 0]
  assert ids[1].tolist() == list(range(k))
  assert ids[2].tolist() == [8, 40, 0, 1, 2, 3, 4, 5]
  assert len(set(wts[0, :5].tolist())) == 1 and wts[0, 5] == wts[0, 6]
  want_ids, want_wts = run(reference, x, k, renormalise, CPU)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(wts, want_wts, rtol=1e-5, atol=0)
  all_ids, _ = run(fused, x[1:2], E, renormalise, device)
  assert all_ids[0].tolist() == list(range(E))


@pytest.mark.parametrize("E", [8, 256, 300])
def test_nan_rows(device, E):
  """A row whose softmax is NaN (a NaN logit, a +inf logit, every logit -inf) gives ids
  0 .. k-1 and NaN weights, as the reference does; the other rows are unaffected."""
  k = 4
  x = spaced_logits(np.random.default_rng(E), 5, E)
  x[1, E // 2] = np.nan
  x[2, E - 1] = np.inf
  x[3] = -np.inf
  for renormalise in (True, False):
    ids, wts = run(fused, x, k, renormalise, device)
    want_ids, want_wts = run(reference, x, k, renormalise, CPU)
    for t in (1, 2, 3):
      assert ids[t].tolist() == list(range(k)) and np.isnan(wts[t]).all()
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(wts, want_wts, rtol=1e-5, atol=0)  # NaNs in the same places
    assert not np.isnan(wts[[0, 4]]).any()


def test_batched_shapes_and_vmap(device):
  x = spaced_logits(np.random.default_rng(9), 6, 64).reshape(2, 3, 64)
  ids, wts = run(fused, x, 8, True, device)
  want_ids, want_wts = run(reference, x.reshape(6, 64), 8, True, CPU)
  np.testing.assert_array_equal(ids.reshape(6, 8), want_ids)
  np.testing.assert_allclose(wts.reshape(6, 8), want_wts, rtol=1e-5)
  vm = jax.jit(jax.vmap(lambda l: route.moe_route(l, 8, True)))
  vids, vwts = vm(jax.device_put(jnp.asarray(x), device))
  np.testing.assert_array_equal(np.asarray(vids), ids)
  np.testing.assert_array_equal(np.asarray(vwts), wts)
  empty_ids, empty_wts = run(fused, np.zeros((0, 64), np.float32), 8, True, device)
  assert empty_ids.shape == (0, 8) and empty_wts.shape == (0, 8)


def _targets(lowered) -> set[str]:
  """The jaxvt custom calls of a lowered program."""
  text = lowered.as_text()
  return set(re.findall(r"custom_call @(jaxvt_\w+)", text)) | set(
      re.findall(r"custom_call_target\s*=\s*\"(jaxvt_\w+)\"", text))


def test_wide_routers_and_bad_k():
  """Routers wider than csrc/common/route.h's kMaxExperts run the reference; k outside 1 .. E is a
  user error."""
  narrow = jax.ShapeDtypeStruct((3, route.MAX_EXPERTS), jnp.float32)
  wide = jax.ShapeDtypeStruct((3, route.MAX_EXPERTS + 1), jnp.float32)
  assert "jaxvt_moe_route" in _targets(fused.lower(narrow, 8, True))
  assert "jaxvt_moe_route" not in _targets(fused.lower(wide, 8, True))
  x = spaced_logits(np.random.default_rng(1), 4, route.MAX_EXPERTS + 1)
  np.testing.assert_array_equal(run(fused, x, 8, True, CPU)[0], run(reference, x, 8, True, CPU)[0])
  for k in (0, 9):
    with pytest.raises(JaxvtError, match="moe_route"):
      route.moe_route(jnp.zeros((2, 8)), k, True)


# ---------------------------------------------------------------------------------------------
# In the model: Products.fused_route on and off.


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
  cfg = synth.tiny_config("qwen35moe", n_experts=64, n_experts_used=8)
  path = str(tmp_path_factory.mktemp("route") / "qwen35moe-64.gguf")
  synth.write_model(path, cfg, "mixed", seed=11)
  return path


def _greedy(eng, ex, prompt: list[int], steps: int):
  """Greedy tokens and the logits of every step (prefill's last, then each decode step)."""
  T = len(prompt)
  args = (jnp.asarray([prompt], jnp.int32), jnp.arange(T, dtype=jnp.int32)[None],
          jnp.ones((1, T), bool), jnp.asarray([T - 1], jnp.int32))
  logits, cache = engine.prefill_fn(eng.weights, eng.new_cache(1), *args, cfg=eng.cfg, ex=ex,
                                    kv_len=eng.kv_len(T + steps))
  out, toks = [np.asarray(logits[0])], [int(jnp.argmax(logits[0]))]
  for i in range(steps - 1):
    logits, cache = engine.decode_fn(eng.weights, cache, jnp.asarray([[toks[-1]]], jnp.int32),
                                     jnp.asarray([[T + i]], jnp.int32), cfg=eng.cfg, ex=ex,
                                     kv_len=eng.kv_len(T + steps))
    out.append(np.asarray(logits[0]))
    toks.append(int(jnp.argmax(logits[0])))
  return toks, np.stack(out)


def test_model_with_fused_route(moe_model):
  """The model on this backend's kernels (float32 numerics, the platform's product rule) with
  fused_route on and off: the program holds the custom call exactly when on, the greedy tokens
  are the same and the logits agree to float32 rounding (carried through 4 layers)."""
  with jaxvt.load(moe_model, max_context=64) as eng:
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 300, 12)]
    runs = {}
    for on in (False, True):
      ex = dataclasses.replace(eng.ex, numerics="f32",
                               products=dataclasses.replace(eng.ex.products, fused_route=on))
      T = len(prompt)
      lowered = engine.prefill_fn.lower(
          eng.weights, jax.eval_shape(lambda: eng.new_cache(1)),
          jnp.zeros((1, T), jnp.int32), jnp.zeros((1, T), jnp.int32), jnp.ones((1, T), bool),
          jnp.zeros((1,), jnp.int32), cfg=eng.cfg, ex=ex, kv_len=eng.kv_len(T))
      assert ("jaxvt_moe_route" in _targets(lowered)) == on
      runs[on] = _greedy(eng, ex, prompt, 8)
  (toks, want), (got_toks, got) = runs[False], runs[True]
  assert got_toks == toks
  np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max(), rtol=0)
