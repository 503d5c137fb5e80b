"""The fused Gated DeltaNet decode step (jaxvt.ffi.gdn.gdn_step) against its jnp reference
(jaxvt.model.deltanet.gdn_step_ref, the model's own functions), and in the model: a decode under a
rule with gdn_fused against the jnp path. tests/test_gdn_step_gpu.py reruns the op's tests on a GPU
(the `device` fixture)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvt
from jaxvt import engine, ffi, synth
from jaxvt.errors import JaxvtError
from jaxvt.ffi import gdn
from jaxvt.model import deltanet
from jaxvt.model.deltanet import gdn_step_ref
from jaxvt.ffi.tuning import CPU_PRODUCTS, GPU_PRODUCTS, Products

from test_ffi_cases import (assert_rel, assert_written_in_place, chained_steps, decode_text,
                            kernel_and_reference, prefill_text)
from test_ffi_cases import device  # noqa: F401  (the shared fixture: the CPU)
from test_qwen_fixtures import MOE8, synth_file

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


def make_inputs(rng, nk, nv, dk, dv, K, b, valid=None, L=3, layer=None):
  """Random operands of gdn_step on stacks of L layers (a in [-e, -1] as ssm_a = -exp(A_log) is);
  `layer` random in [0, L) unless given."""
  conv_dim = 2 * nk * dk + nv * dv
  n = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(np.float32)
  valid = np.ones(b, bool) if valid is None else np.asarray(valid, bool)
  layer = int(rng.integers(0, L)) if layer is None else layer
  return dict(mixed=n(b, conv_dim), z=n(b, nv * dv), beta_raw=n(b, nv), alpha_raw=n(b, nv),
              a=-np.exp(rng.uniform(0, 1, (L, nv))).astype(np.float32), dt_bias=n(L, nv),
              conv_w=n(L, conv_dim, K, scale=0.5), norm_w=(1 + n(L, dv, scale=0.1)),
              conv_state=n(L, b, K - 1, conv_dim), ssm_state=n(L, b, nv, dk, dv, scale=0.3),
              valid=valid, layer=np.int32(layer))


def _fns(device, order):
  """(the kernel on `device`, the reference on the CPU), each taking numpy operands; the
  kernel's state stacks donated."""
  return kernel_and_reference(device, functools.partial(gdn.gdn_step, eps=EPS, order=order),
                              functools.partial(gdn_step_ref, eps=EPS, order=order),
                              ("conv_state", "ssm_state"))


def assert_close(got, want, what):
  assert_rel(got, want, what, TOL)


def assert_step(got, want, x, what):
  """y and the chosen layer's states close to the reference; the other layers bit for bit."""
  yk, ck, sk = map(np.asarray, got)
  yr, cr, sr = map(np.asarray, want)
  l = int(np.clip(x["layer"], 0, len(x["ssm_state"]) - 1))
  assert_close(yk, yr, f"y, {what}")
  assert_close(ck[l], cr[l], f"conv state, {what}")
  assert_close(sk[l], sr[l], f"ssm state, {what}")
  for name, k, old in (("conv", ck, x["conv_state"]), ("ssm", sk, x["ssm_state"])):
    others = [i for i in range(len(old)) if i != l]
    np.testing.assert_array_equal(k[others], old[others], err_msg=f"{name} other layers, {what}")


@pytest.mark.parametrize("nk,nv,dk,dv,K,order,b", SHAPES)
def test_step_matches_reference_over_chained_steps(nk, nv, dk, dv, K, order, b, device):
  """Four decode steps, each on a random layer of the stacks, each kernel's state stacks fed to
  its next step (and the reference's to its): y and the layer's states agree every step, the
  other layers come back bit for bit."""
  rng = np.random.default_rng(nk * 1000 + nv * 100 + dk + dv + K)
  kern, ref = _fns(device, order)
  first = make_inputs(rng, nk, nv, dk, dv, K, b)
  for step, xk, got, want in chained_steps(kern, ref, first,
                                           lambda step: make_inputs(rng, nk, nv, dk, dv, K, b),
                                           ("conv_state", "ssm_state")):
    assert_step(got, want, xk, f"step {step}")
    # the chain: every layer the kernel touched stays close to the reference's
    assert_close(got[1], want[1], f"conv stack, step {step}")
    assert_close(got[2], want[2], f"ssm stack, step {step}")


@pytest.mark.parametrize("layer", [-3, 0, 2, 7])
def test_layer_index_is_clamped(layer, device):
  """An index outside the stacks reads and writes the nearest layer (as the reference's clamp),
  never outside the buffers."""
  rng = np.random.default_rng(11)
  kern, ref = _fns(device, "tiled")
  x = make_inputs(rng, 2, 4, 16, 16, 4, 2, layer=layer)
  assert_step(kern(**dict(x)), ref(**x), x, f"layer {layer}")


@pytest.mark.parametrize("order", ["tiled", "grouped"])
def test_invalid_row_keeps_its_states(order, device):
  """valid = False: that row's states come back bit for bit (beta = g = 0), the other row's move;
  y matches the reference on both rows."""
  rng = np.random.default_rng(7)
  kern, ref = _fns(device, order)
  x = make_inputs(rng, 2, 4, 16, 24, 4, 2, valid=[True, False], layer=1)
  got = kern(**dict(x))
  assert_step(got, ref(**x), x, "invalid row")
  ck, sk = np.asarray(got[1])[1], np.asarray(got[2])[1]
  np.testing.assert_array_equal(ck[1], x["conv_state"][1, 1])
  np.testing.assert_array_equal(sk[1], x["ssm_state"][1, 1])
  assert not np.allclose(ck[0], x["conv_state"][1, 0])
  assert not np.allclose(sk[0], x["ssm_state"][1, 0])


def test_value_order_matters_and_results_repeat(device):
  """The order attribute reaches the kernel (tiled and grouped differ where nv > nk), and a
  second call gives the same bits."""
  rng = np.random.default_rng(3)
  x = make_inputs(rng, 2, 8, 16, 16, 4, 2)
  tiled, _ = _fns(device, "tiled")
  grouped, ref_grouped = _fns(device, "grouped")
  a, b = np.asarray(tiled(**dict(x))[0]), np.asarray(grouped(**dict(x))[0])
  assert np.abs(a - b).max() > 100 * TOL * np.abs(b).max()
  assert_close(b, ref_grouped(**x)[0], "grouped y")
  for got, again in zip(grouped(**dict(x)), grouped(**dict(x))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))


def test_not_donated_leaves_operands(device):
  """Without donation XLA copies the stacks before the in-place call: the caller's arrays keep
  their values, the results hold the step."""
  rng = np.random.default_rng(5)
  x = make_inputs(rng, 2, 4, 16, 16, 4, 1)
  xd = jax.device_put(x, device)
  before = [np.asarray(xd[k]).copy() for k in ("conv_state", "ssm_state")]
  got = jax.jit(lambda x: gdn.gdn_step(**x, eps=EPS))(xd)
  for k, b in zip(("conv_state", "ssm_state"), before):
    np.testing.assert_array_equal(np.asarray(xd[k]), b)
  _, ref = _fns(device, "tiled")
  assert_step(got, ref(**x), x, "not donated")


def test_shape_errors():
  x = make_inputs(np.random.default_rng(0), 2, 4, 16, 16, 4, 1)
  with pytest.raises(JaxvtError, match="do not fit"):
    gdn.gdn_step(**{**x, "mixed": x["mixed"][:, 1:]}, eps=EPS)
  with pytest.raises(JaxvtError, match="do not fit"):
    gdn.gdn_step(**{**x, "valid": np.ones(2, bool)}, eps=EPS)
  with pytest.raises(JaxvtError, match="do not fit"):
    gdn.gdn_step(**{**x, "a": x["a"][:2]}, eps=EPS)
  with pytest.raises(JaxvtError, match="do not fit"):
    gdn.gdn_step(**{**x, "layer": np.zeros(1, np.int32)}, eps=EPS)
  with pytest.raises(JaxvtError, match="must be"):
    gdn.gdn_step(**{**x, "ssm_state": x["ssm_state"][0]}, eps=EPS)
  with pytest.raises(JaxvtError, match="value order"):
    gdn.gdn_step(**x, eps=EPS, order="interleaved")
  big = make_inputs(np.random.default_rng(0), 1, 1, 264, 8, 2, 1)
  with pytest.raises(JaxvtError, match="at most 256"):
    gdn.gdn_step(**big, eps=EPS)


# ---- in the model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen35moe(tmp_path_factory):
  # 8 layers: two periods, so the decode program's layer scan stays a loop
  return synth_file(tmp_path_factory.mktemp("gdn"), "qwen35moe", "q4_k_m", 5, **MOE8)[1]


def test_fused_decode_in_the_model(qwen35moe):
  """The tiny Qwen3.5-MoE model decodes 8 greedy tokens after a prompt with the engine's rule
  (on the CPU, CPU_PRODUCTS) once with gdn_fused and once without: logits close, the same
  tokens; only the fused decode program holds jaxvt_gdn_step; a prefill holds it under the
  CPU's rule (token by token) and not under one that takes the chunked form at its length."""
  assert GPU_PRODUCTS.gdn_fused and CPU_PRODUCTS.gdn_fused and not Products().gdn_fused
  assert CPU_PRODUCTS.gdn_chunked_rows == 0 and GPU_PRODUCTS.gdn_chunked_rows <= 16
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

    spec = jax.eval_shape(lambda: eng.new_cache(1))
    lower = lambda ex: decode_text(eng, spec, ex, tok0, pos0, eng.kv_len(pos0 + 1))
    assert "jaxvt_gdn_step" in lower(fused) and "jaxvt_gdn_step" not in lower(plain)
    rows = lambda n: dataclasses.replace(fused, products=dataclasses.replace(
        fused.products, gdn_chunked_rows=n))
    assert "jaxvt_gdn_step" in prefill_text(eng, spec, rows(0), 16)  # the CPU's row
    assert "jaxvt_gdn_step" not in prefill_text(eng, spec, rows(GPU_PRODUCTS.gdn_chunked_rows), 16)


def test_fused_decode_updates_the_stacks_in_place(qwen35moe):
  """The CPU-compiled decode program with gdn_fused writes the cache's state stacks only through
  jaxvt_gdn_step's aliased results: no copy, dynamic-update-slice or fusion producing a whole
  [n_gdn, ...] ssm or conv stack (the jnp path, and the op on per-layer slices, have them)."""
  with jaxvt.load(qwen35moe, max_context=64) as eng:
    spec = jax.eval_shape(lambda: eng.new_cache(1))
    rule = lambda on: dataclasses.replace(
        eng.ex, products=dataclasses.replace(eng.ex.products, gdn_fused=on))
    compiled = lambda on: decode_text(eng, spec, rule(on), 1, 3, eng.kv_len(4), True)
    assert_written_in_place(compiled(True), compiled(False), "jaxvt_gdn_step",
                            {name: spec[name].shape for name in ("ssm", "conv")})


def _steps_inputs(rng, b, t, nk=2, nv=4, dk=16, dv=32, K=4, L=3):
  n = lambda *s, scale=1.0: jnp.asarray((scale * rng.standard_normal(s)).astype(np.float32))
  cd = 2 * nk * dk + nv * dv
  seq = dict(mixed=n(b, t, cd), z=n(b, t, nv * dv), beta=n(b, t, nv), alpha=n(b, t, nv))
  stacks = (jnp.asarray(-np.exp(rng.uniform(0, 1, (L, nv))).astype(np.float32)), n(L, nv),
            n(L, cd, K, scale=0.5), 1 + n(L, dv, scale=0.1))
  states = (n(L, b, K - 1, cd), n(L, b, nv, dk, dv, scale=0.3))
  return seq, stacks, states


def _steps(seq, stacks, states, valid, cfg, gi=1):
  return deltanet.gdn_steps(seq["mixed"], seq["z"], seq["beta"], seq["alpha"], stacks, *states,
                            jnp.asarray(valid), jnp.int32(gi), cfg)


def test_steps_give_the_same_bits_however_the_tokens_are_scheduled():
  """The token-by-token fused mixer (deltanet.gdn_steps, the CPU's prefill and decode) gives a
  token the same bits whether its prompt came in one call, in two pieces or one token a call,
  and whether its row ran alone or beside other rows with padding; against the jnp recurrence
  (gdn_mix) within float32 rounding."""
  cfg = synth.tiny_config("qwen35moe")
  rng = np.random.default_rng(7)
  b, t = 3, 9
  seq, stacks, states = _steps_inputs(rng, b, t)
  valid = np.ones((b, t), bool)
  valid[2, 6:] = False  # a shorter row padded on the right
  y, conv, ssm = _steps(seq, stacks, states, valid, cfg)

  cut = lambda a, b0, b1, t0, t1: {k: v[b0:b1, t0:t1] for k, v in a.items()}
  alone = lambda r: tuple(s[:, r:r + 1] for s in states)
  for r in range(b):  # row r alone, in one call, in two pieces and token by token
    one = _steps(cut(seq, r, r + 1, 0, t), stacks, alone(r), valid[r:r + 1], cfg)
    np.testing.assert_array_equal(one[0], y[r:r + 1])
    for pieces in ((0, 4, t), tuple(range(t + 1))):
      st, ys = alone(r), []
      for t0, t1 in zip(pieces, pieces[1:]):
        y_p, *st = _steps(cut(seq, r, r + 1, t0, t1), stacks, st, valid[r:r + 1, t0:t1], cfg)
        ys.append(y_p)
      np.testing.assert_array_equal(jnp.concatenate(ys, axis=1), y[r:r + 1])
      np.testing.assert_array_equal(st[0], conv[:, r:r + 1])
      np.testing.assert_array_equal(st[1], ssm[:, r:r + 1])

  gi = 1
  want, wc, ws = deltanet.gdn_mix(seq["mixed"], seq["z"], seq["beta"], seq["alpha"],
                                  *(s[gi] for s in stacks), states[0][gi], states[1][gi],
                                  jnp.asarray(valid), EPS, "tiled", chunked=False)
  assert_rel(y[valid], want[valid], "y", TOL)  # (padding's y is undefined)
  assert_rel(ssm[gi], ws, "ssm state", TOL)
  assert_rel(conv[gi], wc, "conv state", TOL)
  np.testing.assert_array_equal(conv[0], states[0][0])  # other layers untouched
