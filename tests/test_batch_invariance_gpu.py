"""Batch invariance of the GPU matvec kernels: a row's result does not depend on how many rows
share the launch (DESIGN: a row alone and the same row inside a batch of 8 give the same bits).
The dense kernels take one row a pass at batch 1 and several above it (kernels_gpu.cu,
plan_launch: 4 a pass, 16 in float32 above 4 rows); the routed experts' kernel serves each slot
alone. Each row's float32 order must be the same on every path, whatever the rows a pass.

The batch-invariant row (--batch-invariant; jaxvt.ffi.tuning.GPU_INVARIANT_PRODUCTS) takes those
kernels at any size: a dense row and a routed token among 512 keep their bits, the whole MoE
block's too (its k slots added in slot order), the fused attention step with a fixed split gives
a row the same bits at any kv_len beside any rows, and RMSNorm's and the shared expert gate's
sums, which the row takes from the matvec kernel, keep a row's bits at any rows. Then the engine with the switch on, on a tiny dense file and a tiny
hybrid (DeltaNet + MoE, routed experts in the host tier) file: a prompt's logits prefilled cold,
in pieces and token by token are the same bits, a prefix-cache hit and 8 concurrent requests
get their solo tokens, a short request beside a 2100-token one (the program's kv bucket 4096)
too, and its programs hold no XLA dot (tests/test_batch_invariant.py, the same tests on the
CPU's kernels). Run on a GPU host with `pytest -m gpu tests/test_batch_invariance_gpu.py`.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from gpu_cases import OK as _OK, REASON as _REASON
from test_ffi_cases import (BF16, F32, Q4_0, Q4_K, Q6_K, Q8_0, make_stack,  # noqa: F401
                            random_blocks)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]

from gpu_cases import device, tier  # noqa: E402,F401  (the GPU fixtures)


@pytest.fixture
def rng():
  return np.random.default_rng(43)


def put(a, device):
  return jax.device_put(a, device)


BATCHES = (1, 2, 3, 5, 8, 9, 16)


@pytest.mark.parametrize("mode", ["q8", "f32"])
@pytest.mark.parametrize("fmt,rows,cols", [(Q4_K, 70, 2048), (Q6_K, 33, 4096), (Q8_0, 96, 512),
                                           (Q4_0, 2048, 256), (BF16, 40, 2048), (F32, 24, 8192)])
def test_dense_row_alone_equals_the_row_in_a_batch(mode, fmt, rows, cols, rng, device, tier):
  """Every row of batches of 1-16 rows equals that row computed alone, bit for bit, from either
  tier (layer 0 device, layer 1 host: the same blocks)."""
  from jaxvt.ffi import ops
  raw = random_blocks(rng, fmt, rows, cols)
  s = make_stack(rng, [fmt, fmt], rows, cols, host=(1,), tier=tier, raws=[raw, raw])
  w = put(s.w, device)
  x = rng.standard_normal((max(BATCHES), cols)).astype(np.float32)
  f = jax.jit(lambda x, w, l: ops.qmatmul(x, w, l, mode))
  alone = np.stack([np.asarray(f(put(x[i:i + 1], device), w, 0))[0] for i in range(len(x))])
  assert np.isfinite(alone).all() and np.abs(alone).max() > 0
  for layer in (0, 1):
    for b in BATCHES:
      got = np.asarray(f(put(x[:b], device), w, layer))
      np.testing.assert_array_equal(got, alone[:b], err_msg=f"batch {b}, layer {layer}")


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_multi_row_alone_equals_the_row_in_a_batch(mode, rng, device):
  """The one-launch form of several matrices (router and shared expert's gate / up of the 35B
  shape, in their formats) keeps each row's bits at any batch."""
  from jaxvt.ffi import ops
  cols = 2048
  stacks = [make_stack(rng, [F32], 64, cols), make_stack(rng, [Q4_K], 128, cols),
            make_stack(rng, [Q6_K], 128, cols)]
  ws = [put(s.w, device) for s in stacks]
  x = rng.standard_normal((8, cols)).astype(np.float32)
  f = jax.jit(lambda x, ws: ops.qmatmul_multi(x, ws, 0, mode))
  alone = [np.concatenate([np.asarray(f(put(x[i:i + 1], device), ws)[j]) for i in range(8)])
           for j in range(len(ws))]
  for b in (2, 5, 8):
    got = f(put(x[:b], device), ws)
    for j in range(len(ws)):
      np.testing.assert_array_equal(np.asarray(got[j]), alone[j][:b], err_msg=f"matrix {j}, batch {b}")


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_experts_token_alone_equals_the_token_in_a_batch(mode, rng, device):
  """The routed experts (8 slots a token, experts of 512 x 2048 in Q4_K): a token's outputs are
  the same bits alone and among 8 tokens."""
  from jaxvt.ffi import ops
  e = make_stack(rng, [Q4_K], 512, 2048, experts=32)
  w = put(e.w, device)
  ids = np.stack([rng.choice(32, 8, replace=False) for _ in range(8)]).astype(np.int32)
  x = rng.standard_normal((8, 2048)).astype(np.float32)
  f = jax.jit(lambda x, w, i: ops.qmatmul_experts(x, w, 0, i, mode))
  alone = np.concatenate([np.asarray(f(put(x[t:t + 1], device), w, put(ids[t:t + 1], device)))
                          for t in range(8)])
  got = np.asarray(f(put(x, device), w, put(ids, device)))
  np.testing.assert_array_equal(got, alone)


# ---- the batch-invariant row's kernels at any size -------------------------------------------

LARGE = (17, 33, 64, 512)  # past the matvec kernel's 16 rows a pass; a prefill chunk
PICK = (0, 3, 16, 17, 63, 300, 511)  # rows computed alone


@pytest.mark.parametrize("mode", ["q8", "f32"])
@pytest.mark.parametrize("fmt,rows,cols", [(Q4_K, 70, 2048), (Q8_0, 96, 512), (F32, 24, 1024)])
def test_dense_row_alone_equals_the_row_among_512(mode, fmt, rows, cols, rng, device):
  """The invariant row's dense products: the matvec kernel at 17 to 512 rows gives each row
  its bits alone."""
  from jaxvt.ffi import ops
  w = put(make_stack(rng, [fmt], rows, cols).w, device)
  x = rng.standard_normal((max(LARGE), cols)).astype(np.float32)
  f = jax.jit(lambda x, w: ops.qmatmul(x, w, 0, mode))
  alone = {i: np.asarray(f(put(x[i:i + 1], device), w))[0] for i in PICK}
  for b in LARGE:
    got = np.asarray(f(put(x[:b], device), w))
    for i in (i for i in PICK if i < b):
      np.testing.assert_array_equal(got[i], alone[i], err_msg=f"row {i} of {b}")


def test_multi_row_alone_equals_the_row_among_64(rng, device):
  """The one-launch form (router and shared expert's gate / up) at 64 rows."""
  from jaxvt.ffi import ops
  cols = 2048
  ws = [put(make_stack(rng, [f], r, cols).w, device) for f, r in ((F32, 64), (Q4_K, 128))]
  x = rng.standard_normal((64, cols)).astype(np.float32)
  f = jax.jit(lambda x, ws: ops.qmatmul_multi(x, ws, 0, "q8"))
  got = f(put(x, device), ws)
  for i in (0, 17, 63):
    one = f(put(x[i:i + 1], device), ws)
    for j in range(len(ws)):
      np.testing.assert_array_equal(np.asarray(got[j])[i], np.asarray(one[j])[0])


@pytest.mark.parametrize("tokens", [64, 256])
def test_moe_block_token_alone_equals_the_token_among_many(tokens, rng, device):
  """The invariant row's routed experts: ops.moe_experts (gate and up in one launch, SwiGLU,
  down, the 8 slots added in slot order) gives a token its bits alone and among 64 tokens (512
  slots: the per-slot kernel, where the default row takes the grouped one) and 256 (2048 slots:
  past kExpertsSlotMax the kernel reads each routed expert once per 4 slots)."""
  from jaxvt.ffi import ops
  E, d, f_ = 32, 1024, 256
  wg, wu = (put(make_stack(rng, [Q4_K], f_, d, experts=E).w, device) for _ in range(2))
  wd = put(make_stack(rng, [Q4_K], d, f_, experts=E).w, device)
  ids = np.stack([rng.choice(E, 8, replace=False) for _ in range(tokens)]).astype(np.int32)
  wts = rng.random((tokens, 8)).astype(np.float32)
  x = rng.standard_normal((tokens, d)).astype(np.float32)
  f = jax.jit(lambda x, i, c, wg, wu, wd: ops.moe_experts(x, wg, wu, wd, 0, i, c, mode="q8",
                                                         ordered=True))
  got = np.asarray(f(put(x, device), put(ids, device), put(wts, device), wg, wu, wd))
  assert np.isfinite(got).all() and np.abs(got).max() > 0
  for t in (0, 9, tokens - 1):
    one = f(put(x[t:t + 1], device), put(ids[t:t + 1], device), put(wts[t:t + 1], device), wg,
            wu, wd)
    np.testing.assert_array_equal(np.asarray(one)[0], got[t], err_msg=f"token {t}")


# ---- the engine with --batch-invariant (the same tests as on the CPU's kernels) --------------

from jaxvt import engine as engine_mod  # noqa: E402
from test_batch_invariant import (  # noqa: E402,F401  (the same tests on the GPU)
    CONTEXT, _ids, dense_file, hybrid_file,
    test_attention_step_with_a_fixed_split_ignores_kv_len_and_other_rows,
    test_invariant_norm_and_gate_are_right_and_a_rows_bits_do_not_depend_on_T,
    test_cold_prefill_pieces_and_token_by_token_give_the_same_bits,
    test_eight_concurrent_requests_get_their_solo_tokens,
    test_exact_repeat_and_next_turn_through_the_prefix_cache,
    test_generate_and_server_give_the_same_tokens,
    test_the_default_gpu_row_gives_other_bits_token_by_token,
    test_the_invariant_program_has_no_dot_and_takes_the_decode_kernels)
from test_invariance import _serve  # noqa: E402


def _switched_on(path: str, **kw):
  e = engine_mod.load(path, max_context=CONTEXT, batch_invariant=True, **kw)
  assert e.ex.numerics == "q8" and e.ex.products.attn_steps and not e.ex.products.stage_rows
  return e


@pytest.fixture(scope="module")
def dense_inv(tmp_path_factory):
  e = _switched_on(dense_file(tmp_path_factory.mktemp("dense_inv_gpu")))
  yield e
  e.close()


@pytest.fixture(scope="module")
def hybrid_inv(tmp_path_factory):  # the routed experts in the host tier, as a 35B on one card
  e = _switched_on(hybrid_file(tmp_path_factory.mktemp("hybrid_inv_gpu")), offload_gb=1.0,
                   offload_pattern=("exps",))
  assert e.plan.host_bytes > 0
  yield e
  e.close()


@pytest.mark.parametrize("which", ["dense_inv", "hybrid_inv"])
def test_a_short_request_beside_a_long_one_gets_its_solo_tokens(which, request):
  """Three short requests served beside one of 2100 tokens (their decode programs then read
  kv_len 4096, where the default row's attention splits its positions in 32s, not 16s) get the
  tokens each gets alone."""
  eng = request.getfixturevalue(which)
  shorts = [_ids(eng, i, 9 + 10 * i) for i in range(3)]
  solo = [_serve(eng, [[p]], max_tokens=16, prefix=False)[0][0][0] for p in shorts]
  (together,) = _serve(eng, [[_ids(eng, 7, 2100), *shorts]], max_tokens=16, prefix=False)
  assert [t for t, _ in together[1:]] == solo


def test_a_sampled_rows_token_and_sums_do_not_depend_on_the_other_rows(device):
  """Seeded sampling on the GPU (jaxvt.sampling.sample_rows): a row's nucleus sums and its token
  are the same bits alone and among 64 rows (test_sample_rows.py, on the device)."""
  from jaxvt.sampling import row_cumsum, row_softmax, sample_rows
  from test_sample_rows import nucleus_inputs
  args = [put(a, device) for a in nucleus_inputs(np.random.default_rng(5), 64, 248320)]
  many = np.asarray(sample_rows(*args))
  soft, cums = np.asarray(row_softmax(args[0])), np.asarray(row_cumsum(args[0]))
  for i in (0, 17, 63):
    one = [a[i:i + 1] for a in args]
    assert int(sample_rows(*one)[0]) == many[i]
    assert np.array_equal(np.asarray(row_softmax(one[0]))[0].view(np.uint32),
                          soft[i].view(np.uint32))
    assert np.array_equal(np.asarray(row_cumsum(one[0]))[0].view(np.uint32),
                          cums[i].view(np.uint32))
