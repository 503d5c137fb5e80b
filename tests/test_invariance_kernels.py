"""Each CPU op's arithmetic of a row does not depend on how many rows share its call: a row
computed alone gives the bits it gets inside a batch (decode rows) or a prefill of many query
tokens, for the matrix products (every format, both contracts), the routed experts, RMSNorm,
SwiGLU, RoPE and attention as the model calls it (jaxvt.model.layers.attend: under the default
"ggml" numerics every query row takes one recipe; under "llamacpp" a call of one query token
takes llama.cpp's decode products, which add in another order: the cause of answers that
changed with a prefix-cache hit, shown here as a difference in bits)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import ffi
from jaxvt.ffi import ops, steps
from jaxvt.model import deltanet, layers
from jaxvt.model.layers import Exec
from test_ffi_cases import ALL, NAMES, Q4_K, Q6_K, Q8_0, make_stack, rng  # noqa: F401

pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt's extension not built")

COUNTS = (1, 2, 3, 8, 17)


def _alone_equals_batched(fn, x: np.ndarray) -> None:
  """fn(x[i:i+1]) == fn(x[:n])[i] bit for bit for every row i of every prefix length n."""
  alone = [np.asarray(fn(x[i:i + 1]))[0] for i in range(max(COUNTS))]
  for n in COUNTS:
    batch = np.asarray(fn(x[:n]))
    for i in range(n):
      np.testing.assert_array_equal(batch[i], alone[i], err_msg=f"row {i} of {n}")


@pytest.mark.parametrize("fmt", ALL, ids=NAMES.get)
def test_matmul_row_alone_equals_row_in_batch(fmt, rng):
  """The CPU's integer products ("ggml", "q8"). The "f32" contract's CPU kernel (not a CPU
  default) gives a lone row two alternating accumulators and a row of a group of 4 one, so it
  is not invariant (docs/NUMERICS.md)."""
  s = make_stack(rng, [fmt], 64, 512)
  x = (rng.standard_normal((max(COUNTS), 512)) * 3).astype(np.float32)
  fn = jax.jit(lambda x: ops.qmatmul(x, s.w, 0, "ggml"))
  _alone_equals_batched(fn, x)


def test_routed_experts_token_alone_equals_token_among_many(rng):
  E, k, d, ffn = 6, 2, 256, 256
  wg = make_stack(rng, [Q4_K], ffn, d, experts=E)
  wu = make_stack(rng, [Q8_0], ffn, d, experts=E)
  wd = make_stack(rng, [Q6_K], d, ffn, experts=E)
  T = max(COUNTS)
  x = rng.standard_normal((T, d)).astype(np.float32)
  ids = rng.integers(0, E, (T, k)).astype(np.int32)
  gate = rng.uniform(0, 1, (T, k)).astype(np.float32)
  fn = jax.jit(functools.partial(ops.moe_experts, mode="ggml"))
  for n in COUNTS:
    batch = np.asarray(fn(x[:n], wg.w, wu.w, wd.w, 0, ids[:n], gate[:n]))
    for i in range(n):
      alone = np.asarray(fn(x[i:i + 1], wg.w, wu.w, wd.w, 0, ids[i:i + 1], gate[i:i + 1]))
      np.testing.assert_array_equal(batch[i], alone[0], err_msg=f"token {i} of {n}")


def test_norm_swiglu_rope_rows(rng):
  T, d = max(COUNTS), 96
  x = (rng.standard_normal((T, d)) * 50).astype(np.float32)
  u = rng.standard_normal((T, d)).astype(np.float32)
  w = rng.standard_normal(d).astype(np.float32)
  _alone_equals_batched(jax.jit(lambda x: steps.rms_norm(x, w, 1e-5)), x)
  gu = np.stack([x, u], axis=1)  # [T, 2, d]: a row's gate and up together
  _alone_equals_batched(jax.jit(lambda gu: steps.swiglu(gu[:, 0], gu[:, 1])), gu)
  pos = np.arange(T, dtype=np.int32) * 37
  h = x.reshape(T, 3, 32)
  rope = jax.jit(lambda h, p: steps.rope(h[None], p[None], 32, 10000.0, True)[0])
  for n in COUNTS:
    batch = np.asarray(rope(h[:n], pos[:n]))
    for i in range(n):
      np.testing.assert_array_equal(batch[i], np.asarray(rope(h[i:i + 1], pos[i:i + 1]))[0])


def _attend_fn(numerics: str, kv_len: int):
  ex = Exec(kernels=True, numerics=numerics)

  @jax.jit
  def run(q, k, v, kc, vc, positions, n_query):
    o, _, _ = layers.attend(q, k, v, None, None, kc, vc, jnp.int32(0), positions, kv_len=kv_len,
                            theta=10000.0, rope_dim=32, interleaved=False, eps=1e-5, gate=False,
                            qk_norm=False, ex=ex, n_query=n_query)
    return o

  return run


def _attention_case(rng, T: int = 40, H: int = 4, K: int = 2, D: int = 64, S: int = 256):
  """A prompt of T tokens in one row: q [1, T, H*D], k/v [1, T, K*D], an empty f16 cache."""
  q = rng.standard_normal((1, T, H * D)).astype(np.float32)
  k = rng.standard_normal((1, T, K * D)).astype(np.float32)
  v = rng.standard_normal((1, T, K * D)).astype(np.float32)
  kc = np.zeros((1, 1, S, K, D), np.float16)
  return q, k, v, kc, kc.copy()


def _last_token_two_ways(numerics: str, case, T: int):
  """(the last query token's output in one prefill of T tokens, the same token run alone after
  the first T - 1 were prefilled: a prefix-cache hit's one-token prefill)."""
  q, k, v, kc, vc = map(jnp.asarray, case)
  run = _attend_fn(numerics, 256)
  pos = np.arange(T, dtype=np.int32)[None]
  whole = np.asarray(run(q, k, v, kc, vc, pos, np.array([T], np.int32)))[0, -1]
  # the cache after T - 1 tokens holds their K/V rows (written by attend); then the last alone
  ex = Exec(kernels=True, numerics=numerics)
  _, kc1, vc1 = layers.attend(q[:, :-1], k[:, :-1], v[:, :-1], None, None, kc, vc, jnp.int32(0),
                              pos[:, :-1], kv_len=256, theta=10000.0, rope_dim=32,
                              interleaved=False, eps=1e-5, gate=False, qk_norm=False, ex=ex,
                              n_query=np.array([T - 1], np.int32))
  one = np.asarray(run(q[:, -1:], k[:, -1:], v[:, -1:], kc1, vc1, pos[:, -1:],
                       np.array([1], np.int32)))[0, 0]
  return whole, one


def test_attention_prefix_hit_token_equals_its_prefill_row(rng):
  """Default numerics: the last prompt token computed alone (after a prefix hit) gives the
  bits it gets inside the whole prompt's prefill, and a decode row alone the bits it gets in a
  batch of rows at other positions."""
  T = 40
  whole, one = _last_token_two_ways("ggml", _attention_case(rng, T), T)
  np.testing.assert_array_equal(one, whole)


def test_llamacpp_numerics_is_not_invariant(rng):
  """What the default fixes: llama.cpp's recipe choice gives the same token other bits when it
  is prefilled alone (seen in max |d| of ~1e-7 relative; the model turns that into a different
  greedy token at near ties)."""
  T = 40
  whole, one = _last_token_two_ways("llamacpp", _attention_case(rng, T), T)
  assert not np.array_equal(one, whole)
  np.testing.assert_allclose(one, whole, rtol=1e-3, atol=1e-3)


def test_attention_decode_row_alone_equals_row_in_batch(rng):
  B, H, K, D, S = 8, 4, 2, 64, 256
  kc = (rng.standard_normal((1, B, S, K, D)) * 0.5).astype(np.float16)
  vc = (rng.standard_normal((1, B, S, K, D)) * 0.5).astype(np.float16)
  q = rng.standard_normal((B, 1, H * D)).astype(np.float32)
  k = rng.standard_normal((B, 1, K * D)).astype(np.float32)
  v = rng.standard_normal((B, 1, K * D)).astype(np.float32)
  pos = rng.integers(1, 200, (B, 1)).astype(np.int32)
  kc, vc = jnp.asarray(kc), jnp.asarray(vc)
  run = _attend_fn("ggml", S)
  ones = np.ones(B, np.int32)
  for n in (1, 2, 4, 8):
    batch = np.asarray(run(q[:n], k[:n], v[:n], kc[:, :n], vc[:, :n], pos[:n], ones[:n]))
    for i in range(n):
      s = slice(i, i + 1)
      alone = np.asarray(run(q[s], k[s], v[s], kc[:, s], vc[:, s], pos[s], ones[s]))
      np.testing.assert_array_equal(batch[i], alone[0], err_msg=f"row {i} of {n}")


def _gdn_case(rng, b: int, t: int, nk: int = 2, nv: int = 4, dk: int = 16, dv: int = 16, K: int = 4):
  conv_dim = 2 * nk * dk + nv * dv
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  seq = (f(b, t, conv_dim), f(b, t, nv * dv), f(b, t, nv), f(b, t, nv))  # mixed, z, beta, alpha
  params = (-np.abs(f(nv)), f(nv), f(conv_dim, K) * 0.5, f(dv))  # a, dt_bias, conv_w, norm_w
  states = (f(b, K - 1, conv_dim), f(b, nv, dk, dv) * 0.1)
  return seq, params, states


_gdn = jax.jit(lambda seq, params, states, valid: deltanet.gdn_mix(
    *seq, *params, *states, valid, 1e-6, "tiled", chunked=False))


def test_gdn_prefill_equals_pieces_decode_and_batch(rng):
  """A DeltaNet mixer under the CPU's rule (the recurrence for every token count): one prefill
  of 40 tokens, the same tokens in pieces (a prefix hit at any position) and one token at a time
  (decode) agree to float32 rounding (the same operations per token; XLA:CPU's code for the
  jnp steps around the recurrence still depends on the token count and the batch, an ulp here
  and there: not bitwise, docs/NUMERICS.md), and so does a row alone against the row in a batch
  of 3."""
  seq, params, states = _gdn_case(rng, 3, 40)
  valid = np.ones((3, 40), bool)
  y, conv, ssm = map(np.asarray, _gdn(seq, params, states, valid))
  for cuts in ([17], [1, 2, 39], list(range(1, 40))):
    st, ys = states, []
    for a, z in zip([0] + cuts, cuts + [40]):
      yp, *st = _gdn(tuple(x[:, a:z] for x in seq), params, tuple(st), valid[:, a:z])
      ys.append(np.asarray(yp))
    np.testing.assert_allclose(np.concatenate(ys, axis=1), y, rtol=1e-6, atol=1e-6,
                               err_msg=str(cuts))
    np.testing.assert_allclose(np.asarray(st[1]), ssm, rtol=1e-6, atol=1e-6, err_msg=str(cuts))
  alone = _gdn(tuple(x[1:2] for x in seq), params, tuple(x[1:2] for x in states), valid[1:2])
  np.testing.assert_allclose(np.asarray(alone[0])[0], y[1], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(alone[2])[0], ssm[1], rtol=1e-6, atol=1e-6)
