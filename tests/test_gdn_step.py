"""The fused Gated DeltaNet decode step (jaxvt.ffi.gdn.gdn_step) against its jnp reference
(jaxvt.model.deltanet.gdn_step_ref, the model's own functions), and in the model: a decode under a
rule with gdn_fused against the jnp path. tests/test_gdn_step_gpu.py reruns the op's tests on a GPU
(the `device` fixture)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvt
from jaxvt import engine, ffi, synth
from jaxvt.errors import JaxvtError
from jaxvt.ffi import gdn
from jaxvt.model.deltanet import gdn_step_ref
from jaxvt.model.layers import GPU_PRODUCTS, Products

pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")

# Relative to each output's largest magnitude: float32 sums of up to 256 terms in another order
# than XLA's, over a few chained steps, stay within a few hundred ulps (2^-23 = 1.2e-7).
TOL = 1e-5
EPS = 1e-6

# (nk, nv, dk, dv, K, order, b)
SHAPES = [
    (2, 2, 16, 16, 4, "tiled", 1),
    (2, 4, 16, 32, 4, "tiled", 2),
    (2, 4, 32, 16, 4, "grouped", 2),
    (1, 4, 8, 24, 3, "grouped", 1),
    (2, 8, 16, 16, 2, "tiled", 2),
    (3, 6, 40, 56, 4, "grouped", 2),
    (4, 8, 128, 128, 4, "tiled", 1),
    (2, 2, 256, 256, 4, "tiled", 1),
]


@pytest.fixture(scope="module")
def device():
  return jax.devices("cpu")[0]


def make_inputs(rng, nk, nv, dk, dv, K, b, valid=None):
  """Random operands of gdn_step; a in [-e, -1] as ssm_a = -exp(A_log) is."""
  conv_dim = 2 * nk * dk + nv * dv
  n = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(np.float32)
  valid = np.ones(b, bool) if valid is None else np.asarray(valid, bool)
  return dict(mixed=n(b, conv_dim), z=n(b, nv * dv), beta_raw=n(b, nv), alpha_raw=n(b, nv),
              a=-np.exp(rng.uniform(0, 1, nv)).astype(np.float32), dt_bias=n(nv),
              conv_w=n(conv_dim, K, scale=0.5), norm_w=(1 + n(dv, scale=0.1)),
              conv_state=n(b, K - 1, conv_dim), ssm_state=n(b, nv, dk, dv, scale=0.3), valid=valid)


def _fns(device, order):
  """(the kernel on `device`, the reference on the CPU backend), each taking numpy operands."""
  cpu = jax.devices("cpu")[0]
  kern = jax.jit(lambda x: gdn.gdn_step(**x, eps=EPS, order=order))
  ref = jax.jit(lambda x: gdn_step_ref(**x, eps=EPS, order=order))
  return (lambda **x: kern(jax.device_put(x, device))), (lambda **x: ref(jax.device_put(x, cpu)))


def assert_close(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, what
  err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
  assert err <= TOL, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("nk,nv,dk,dv,K,order,b", SHAPES)
def test_step_matches_reference_over_chained_steps(nk, nv, dk, dv, K, order, b, device):
  """Four decode steps, each kernel's states fed to its next step (and the reference's to its):
  y and both states agree every step."""
  rng = np.random.default_rng(nk * 1000 + nv * 100 + dk + dv + K)
  kern, ref = _fns(device, order)
  x = make_inputs(rng, nk, nv, dk, dv, K, b)
  sk = sr = (x["conv_state"], x["ssm_state"])
  for step in range(4):
    x = make_inputs(rng, nk, nv, dk, dv, K, b)
    yk, *sk = kern(**{**x, "conv_state": sk[0], "ssm_state": sk[1]})
    yr, *sr = ref(**{**x, "conv_state": sr[0], "ssm_state": sr[1]})
    assert_close(yk, yr, f"y, step {step}")
    assert_close(sk[0], sr[0], f"conv state, step {step}")
    assert_close(sk[1], sr[1], f"ssm state, step {step}")


@pytest.mark.parametrize("order", ["tiled", "grouped"])
def test_invalid_row_keeps_its_states(order, device):
  """valid = False: that row's states come back bit for bit (beta = g = 0), the other row's move;
  y matches the reference on both rows."""
  rng = np.random.default_rng(7)
  kern, ref = _fns(device, order)
  x = make_inputs(rng, 2, 4, 16, 24, 4, 2, valid=[True, False])
  yk, ck, sk = map(np.asarray, kern(**x))
  yr, cr, sr = ref(**x)
  assert_close(yk, yr, "y")
  assert_close(ck, cr, "conv state")
  assert_close(sk, sr, "ssm state")
  np.testing.assert_array_equal(ck[1], x["conv_state"][1])
  np.testing.assert_array_equal(sk[1], x["ssm_state"][1])
  assert not np.allclose(ck[0], x["conv_state"][0]) and not np.allclose(sk[0], x["ssm_state"][0])


def test_value_order_matters_and_results_repeat(device):
  """The order attribute reaches the kernel (tiled and grouped differ where nv > nk), and a
  second call gives the same bits."""
  rng = np.random.default_rng(3)
  x = make_inputs(rng, 2, 8, 16, 16, 4, 2)
  tiled, _ = _fns(device, "tiled")
  grouped, ref_grouped = _fns(device, "grouped")
  a, b = np.asarray(tiled(**x)[0]), np.asarray(grouped(**x)[0])
  assert np.abs(a - b).max() > 100 * TOL * np.abs(b).max()
  assert_close(b, ref_grouped(**x)[0], "grouped y")
  for got, again in zip(grouped(**x), grouped(**x)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))


def test_shape_errors():
  x = make_inputs(np.random.default_rng(0), 2, 4, 16, 16, 4, 1)
  with pytest.raises(JaxvtError, match="do not fit"):
    gdn.gdn_step(**{**x, "mixed": x["mixed"][:, 1:]}, eps=EPS)
  with pytest.raises(JaxvtError, match="do not fit"):
    gdn.gdn_step(**{**x, "valid": np.ones(2, bool)}, eps=EPS)
  with pytest.raises(JaxvtError, match="value order"):
    gdn.gdn_step(**x, eps=EPS, order="interleaved")
  big = make_inputs(np.random.default_rng(0), 1, 1, 264, 8, 2, 1)
  with pytest.raises(JaxvtError, match="at most 256"):
    gdn.gdn_step(**big, eps=EPS)


# ---- in the model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen35moe(tmp_path_factory):
  cfg = synth.tiny_config("qwen35moe", d_model=256, expert_ffn_dim=256, shared_ffn_dim=256)
  path = str(tmp_path_factory.mktemp("gdn") / "qwen35moe.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=5)
  return path


def test_fused_decode_in_the_model(qwen35moe):
  """The tiny Qwen3.5-MoE model decodes 8 greedy tokens after a prompt with the engine's rule
  (on the CPU, Products()) once with gdn_fused and once without (on the CPU its kernel stands in
  for the GPU's): logits close, the same tokens; only the fused decode program holds
  jaxvt_gdn_step, and prefill never does."""
  assert GPU_PRODUCTS.gdn_fused and not Products().gdn_fused
  with jaxvt.load(qwen35moe, max_context=64) as eng:
    rule = lambda on: dataclasses.replace(
        eng.ex, products=dataclasses.replace(eng.ex.products, gdn_fused=on))
    plain, fused = rule(False), rule(True)
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 300, 11)]
    _, cache = eng.prefill(prompt)
    copy = lambda c: jax.tree.map(jnp.copy, c)
    pos0, tok0 = len(prompt), prompt[-1]

    def decode(ex, cache, n=8):
      logits, toks, tok = [], [], tok0
      for i in range(n):
        lg, cache = engine.decode_fn(eng.weights, cache, jnp.asarray([[tok]], jnp.int32),
                                     jnp.asarray([[pos0 + i]], jnp.int32), cfg=eng.cfg, ex=ex,
                                     kv_len=eng.kv_len(pos0 + i + 1))
        logits.append(np.asarray(lg[0]))
        tok = int(np.argmax(logits[-1]))
        toks.append(tok)
      return np.stack(logits), toks

    want, want_toks = decode(plain, copy(cache))
    got, got_toks = decode(fused, copy(cache))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
    assert got_toks == want_toks

    args = (jnp.asarray([[tok0]], jnp.int32), jnp.asarray([[pos0]], jnp.int32))
    spec = jax.eval_shape(lambda: eng.new_cache(1))
    lower = lambda ex: engine.decode_fn.lower(eng.weights, spec, *args, cfg=eng.cfg, ex=ex,
                                              kv_len=eng.kv_len(pos0 + 1)).as_text()
    assert "jaxvt_gdn_step" in lower(fused) and "jaxvt_gdn_step" not in lower(plain)
    T = 16
    pre = (jnp.zeros((1, T), jnp.int32), jnp.arange(T, dtype=jnp.int32)[None],
           jnp.ones((1, T), bool), jnp.asarray([T - 1], jnp.int32))
    text = engine.prefill_fn.lower(eng.weights, spec, *pre, cfg=eng.cfg, ex=fused,
                                   kv_len=T).as_text()
    assert "jaxvt_gdn_step" not in text
