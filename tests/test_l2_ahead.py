"""Weights asked into the GPU's L2 cache ahead of their readers (jaxvt.ffi.l2.ahead, the custom
call jaxvt_l2_ahead; Products.l2_ahead): x comes back bit for bit, whatever the stacks (formats,
unaligned device slots, host-tier layers, experts, routed ids out of range or negative), and
the products that read the prefetched stacks afterwards give what they give without it (their
float64 references). The decoder with l2_ahead on computes the same logits bit for bit with the
calls in its program. On the CPU the call copies nothing but x; tests/test_l2_ahead_gpu.py runs
these on a GPU, where the prefetch launches run.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import engine as engine_mod, model_fns, synth
from jaxvt.errors import JaxvtError
from jaxvt.ffi import l2, ops
from jaxvt.ffi.tuning import Products
from jaxvt.model import decoder
from jaxvt.model.layers import Exec
from test_ffi_cases import Q4_K, Q6_K, Q8_0, assert_close, make_stack, matmul_ref, put
from test_ffi_cases import device, rng, tier  # noqa: F401,E402  (the shared fixtures: the CPU)
from test_add_norm import _prompt_logits  # noqa: E402  (a prompt's logits under an Exec)


def _stacks(rng, tier, device):
  """A dense stack (mixed formats, a host-tier layer) and an experts stack."""
  dense = make_stack(rng, [Q4_K, Q6_K, Q8_0], 40, 256, host=(1,), tier=tier)
  experts = make_stack(rng, [Q6_K, Q4_K], 24, 256, experts=5)
  return put(dense.w, device), dense, put(experts.w, device), experts


@pytest.mark.parametrize("layer", [0, 1, 2, 7])
def test_x_comes_back_and_the_products_are_unchanged(device, rng, tier, layer):
  """x passes through (its bits, its shape); the product of a prefetched layer, read after the
  call, matches float64 numpy; a layer index past the stack is clamped as the products clamp it."""
  wd, dense, _, _ = _stacks(rng, tier, device)
  x = put(rng.standard_normal((3, 256)).astype(np.float32), device)
  y = jax.jit(lambda x, l: l2.ahead(x, [(wd, l)]))(x, jnp.int32(layer))
  assert y.shape == x.shape and y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  got = np.asarray(jax.jit(lambda x, l: ops.qmatmul(l2.ahead(x, [(wd, l)]), wd, l))(
      x, jnp.int32(layer)))
  l = min(layer, 2)
  assert_close(got, matmul_ref(np.asarray(x), dense.mats[l][0], dense.fmts[l],
                               dense.raws[l].reshape(40, -1)))


def test_routed_ids_come_back_and_the_experts_are_unchanged(device, rng, tier):
  """Routed: x is the ids (repeated, out of range, negative), returned as they are; the experts
  products after the call match float64 numpy."""
  _, _, we, experts = _stacks(rng, tier, device)
  ids = put(np.array([[4, 0, 9], [-1, 4, 2]], np.int32), device)
  x = put(rng.standard_normal((2, 256)).astype(np.float32), device)

  @jax.jit
  def run(x, ids, l):
    got = l2.ahead(ids, [(we, l), (we, l)], routed=True)
    return got, ops.qmatmul_experts(x, we, l, got)

  got_ids, y = run(x, ids, jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids))
  y = np.asarray(y).reshape(2, 3, 24)
  for t in range(2):
    for s, e in enumerate(np.asarray(ids)[t]):
      if e < 0:
        np.testing.assert_array_equal(y[t, s], 0)
        continue
      mat = experts.mats[1][min(e, 4)]
      raw = experts.raws[1].reshape(5, 24, -1)[min(e, 4)]
      assert_close(y[t, s][None], matmul_ref(np.asarray(x)[t:t + 1], mat, experts.fmts[1], raw))


def test_more_stacks_than_a_launch_takes(device, rng, tier):
  """Over MAX_STACKS stacks take more than one call; None entries are skipped; none at all is
  no call."""
  wd, _, we, _ = _stacks(rng, tier, device)
  x = put(rng.standard_normal((1, 256)).astype(np.float32), device)
  pairs = [(wd, jnp.int32(i % 3)) for i in range(l2.MAX_STACKS)] + [None, (we, jnp.int32(0))]
  fn = jax.jit(lambda x: l2.ahead(x, pairs))
  np.testing.assert_array_equal(np.asarray(fn(x)), np.asarray(x))
  assert re.findall(r"custom_call @jaxvt_l2_ahead", fn.lower(x).as_text()) == [
      "custom_call @jaxvt_l2_ahead"] * 2
  assert l2.ahead(x, [None]) is x


def test_bad_operands_are_refused(device, rng, tier):
  wd, _, we, _ = _stacks(rng, tier, device)
  x = jnp.zeros((1, 256), jnp.float32)
  with pytest.raises(JaxvtError, match="routed ids must be integers"):
    l2.ahead(x, [(we, 0)], routed=True)
  with pytest.raises(JaxvtError, match="every stack must have them"):
    l2.ahead(jnp.zeros((1, 2), jnp.int32), [(wd, 0)], routed=True)
  with pytest.raises(JaxvtError, match="integer scalar"):
    l2.ahead(x, [(wd, jnp.zeros((2,), jnp.int32))])


# ---- the decoder with l2_ahead ------------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen35moe"])
def tiny(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("l2") / f"{request.param}.gguf")
  synth.write_model(path, synth.tiny_config(request.param), "q4_k_m", seed=29)
  with engine_mod.load(path, max_context=64) as eng:
    yield eng


def _calls(eng, ex: Exec, T: int) -> int:
  """jaxvt_l2_ahead calls in the StableHLO of a T-token prefill under `ex` (lowered only)."""
  fn = jax.jit(functools.partial(model_fns._forward, cfg=eng.cfg, ex=ex, kv_len=64))
  text = fn.lower(eng.weights, eng.new_cache(1), jnp.zeros((1, T), jnp.int32),
                  jnp.arange(T, dtype=jnp.int32)[None], valid=jnp.ones((1, T), bool),
                  logits_at=jnp.asarray([T - 1], jnp.int32)).as_text()
  return len(re.findall(r"custom_call @jaxvt_l2_ahead", text))


@pytest.mark.parametrize("lead", [1, 2])
@pytest.mark.parametrize("T", [1, 9])
def test_the_decoder_with_l2_ahead(tiny, T, lead):
  """The same prompt's logits with l2_ahead on (each block's stacks as it starts, or a block
  ahead) and off, bit for bit; on, the scanned period's body holds two calls a layer (one at
  each block boundary) and, in a MoE, one more for its routed experts."""
  eng = tiny
  ids = np.random.default_rng(3).integers(5, eng.cfg.vocab_size, T).tolist()
  row = lambda n: dataclasses.replace(eng.ex, products=dataclasses.replace(eng.ex.products,
                                                                           l2_ahead=n))
  ex_off, ex_on = row(0), row(lead)
  per = len(decoder.layer_period(eng.cfg))
  assert _calls(eng, ex_on, T) == per * (3 if eng.cfg.is_moe else 2)
  assert _calls(eng, ex_off, T) == 0
  off, on = _prompt_logits(eng, ex_off, ids), _prompt_logits(eng, ex_on, ids)
  assert np.isfinite(on).all()
  np.testing.assert_array_equal(on, off)
