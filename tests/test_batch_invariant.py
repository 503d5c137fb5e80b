"""The batch-invariant tuning row (--batch-invariant, jaxvt.load(batch_invariant=True);
jaxvt.ffi.tuning.GPU_INVARIANT_PRODUCTS): which kernel each product takes at 1, 16, 64 and 512
rows, the programs it compiles (no XLA dot, no staged or grouped kernel, the fused steps at every
length), and the GPU row's code run on the CPU's kernels under the GPU's "q8" arithmetic: a
prompt's logits are the same bits prefilled cold, in pieces, token by token and after a
prefix-cache hit, and 8 requests served together get their solo tokens, on a tiny dense file and
a tiny hybrid (DeltaNet + MoE) file. The default GPU row on the same files gives other bits
(the control). On the CPU the switch is accepted and changes nothing (the CPU's own row already
is invariant: tests/test_invariance.py).

tests/test_batch_invariance_gpu.py reruns the engine tests on a GPU with the switch on."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt import SamplingParams, engine as engine_mod, ffi, model_fns, run, synth
from jaxvt.ffi import attn, ops
from jaxvt.ffi.backend import KERNELS
from jaxvt.ffi.tuning import (CPU_PRODUCTS, GPU_INVARIANT_PRODUCTS, GPU_PRODUCTS,
                              INVARIANT_ATTN_CHUNK, Products)
from jaxvt.model.layers import Exec
from jaxvt.offload import cost
from jaxvt.qweight import QMeta
from test_ffi_cases import device  # noqa: F401  (the shared fixture: the CPU)
from test_invariance import SEEDED, _serve

pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")

ROWS = (1, 16, 64, 512)
CONTEXT = 4096  # the synthetic files' trained context: programs up to kv_len 4096


def _meta(rows: int, cols: int) -> QMeta:
  return QMeta(rows=rows, cols=cols, experts=0, formats=(8,), n_layers=1)


# ---- which path each product takes -----------------------------------------------------------

@pytest.mark.parametrize("n", ROWS)
def test_every_product_takes_decodes_path_at_any_rows(n):
  """Under the invariant row, x of n rows takes what a decode row takes: the matvec kernels for
  dense matrices (however large; the default row stages from 16 rows and tiles from 32 where the
  bf16 copy is over 512 MiB), the per-slot experts kernel for n tokens of 8 slots over 256
  experts (the default row: grouped from 256 slots past its short calls), the fused DeltaNet and attention steps
  token by token (the default row: the chunked form and the jnp attention from 2 tokens), the
  attention step's split fixed."""
  inv, gpu = cost.products_for("cuda", True), cost.products_for("cuda")
  ex_inv, ex_gpu = Exec(kernels=True, numerics="q8", products=inv), Exec(
      kernels=True, numerics="q8", products=gpu)
  small, huge = _meta(2048, 2048), _meta(151936, 4096)  # a layer; a head over 512 MiB in bf16
  for meta in (small, huge):
    assert inv.dense(n, meta) == "matvec"
  assert inv.experts(n * 8, 256) == "matvec"
  assert inv.gdn_chunked_rows == 0 and KERNELS.fused("gdn", ex_inv, tokens=n)
  assert KERNELS.fused("attn", ex_inv, tokens=n)
  assert KERNELS.attn_split(ex_inv) == INVARIANT_ATTN_CHUNK
  assert inv.ordered_sums
  # the default row: the same as decode at one row, another path from 16 on
  assert gpu.dense(n, small) == ("matvec" if n < 16 else "staged")
  assert gpu.dense(n, huge) == ("matvec" if n < 32 else "tiled")
  per_slot = n * 8 < 256 or gpu.routed(n * 8, 256)  # few slots: the expert cache's calls
  assert gpu.experts(n * 8, 256) == ("matvec" if per_slot else "grouped")
  assert per_slot or n == 512
  assert KERNELS.fused("attn", ex_gpu, tokens=n) == (n == 1)
  assert KERNELS.attn_split(ex_gpu) is None
  assert (n >= gpu.gdn_chunked_rows) == (n > 1)


def test_the_invariant_row_moves_host_tier_weights_as_the_default_row():
  """Only the arithmetic's fields differ from the default GPU row: what moves host-tier weights
  (rings, prediction, the expert cache's crossover) is the same."""
  inv, gpu = cost.products_for("gpu", True), cost.products_for("gpu")
  arithmetic = {"tiled_rows", "stage_rows", "stage_max_bytes", "grouped_slots",
                "gdn_chunked_rows", "attn_steps", "attn_chunk", "ordered_sums"}
  for f in dataclasses.fields(Products):
    if f.name not in arithmetic:
      assert getattr(inv, f.name) == getattr(gpu, f.name), f.name
  assert inv == dataclasses.replace(GPU_INVARIANT_PRODUCTS, routed_per_expert=gpu.routed_per_expert)


def test_the_switch_is_a_no_op_on_the_cpu(tmp_path, capsys):
  """On the CPU the switch is accepted and changes nothing: the same tuning row and Exec, and
  jaxvt.run prints the same tokens with --batch-invariant as without."""
  for kernels in (True, False):
    assert (engine_mod.exec_for("cpu", kernels, None, batch_invariant=True)
            == engine_mod.exec_for("cpu", kernels, None))
  assert cost.products_for("cpu", True) == cost.products_for("cpu") == CPU_PRODUCTS
  path = str(tmp_path / "llama.gguf")
  synth.write_model(path, synth.tiny_config("llama"), "q8_0", seed=14)
  with engine_mod.load(path, max_context=64, batch_invariant=True) as eng:
    assert eng.ex == engine_mod.exec_for("cpu", True, eng.ex.par)
  outs = []
  for extra in ((), ("--batch-invariant",)):
    rc = run.main(["jaxvt.run", "--model", path, "--max-tokens", "12", "--max-context", "64",
                   "--nochat", *extra, "The capital of France is"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    outs.append(out)
  assert outs[0] == outs[1] and outs[0].strip()


# ---- the programs the invariant row compiles -------------------------------------------------

def _program_text(eng, ex: Exec, T: int, kv_len: int) -> str:
  """The StableHLO of a prefill of T tokens at kv_len under `ex` (lowered, not compiled)."""
  cache = eng.new_cache(1)
  fn = jax.jit(functools.partial(model_fns._forward, cfg=eng.cfg, ex=ex, kv_len=kv_len))
  toks = jnp.zeros((1, T), jnp.int32)
  pos = jnp.arange(T, dtype=jnp.int32)[None]
  return fn.lower(eng.weights, cache, toks, pos, valid=jnp.ones((1, T), bool),
                  logits_at=jnp.asarray([T - 1], jnp.int32)).as_text()


def _targets(text: str) -> set[str]:
  return set(re.findall(r"custom_call @(\w+)", text))


def _float_reductions(text: str) -> list[str]:
  """The program's reductions over floating-point values (XLA orders their sums by the
  shapes)."""
  return [l for l in text.splitlines() if "stablehlo.reduce(" in l and re.search(r"x[bf]\d+>", l)]


def _splits(text: str) -> set[int]:
  """The `chunk` attribute of every jaxvt_attn_step call in the program."""
  calls = [l for l in text.splitlines() if "custom_call @jaxvt_attn_step" in l]
  return {int(m) for l in calls for m in re.findall(r"chunk = (\d+)", l)}


@pytest.mark.parametrize("T", ROWS)
def test_the_invariant_program_has_no_dot_and_takes_the_decode_kernels(hybrid_inv, T):
  """A prefill of T tokens under the invariant row holds no XLA dot (whose algorithm XLA picks
  by the shapes) and no floating-point reduction, no staged (qdequant) or grouped kernel, and
  takes the matvec, per-slot experts, fused DeltaNet and attention step kernels, the
  attention's split 64 at kv_len 256 and 1024 alike. The default GPU row's program at 64 tokens
  holds dots, reductions and stages (the control)."""
  eng = hybrid_inv
  kv = max(256, T)
  text = _program_text(eng, eng.ex, T, kv)
  got = _targets(text)
  assert "dot_general" not in text
  assert {"jaxvt_qmatmul_q8", "jaxvt_attn_step", "jaxvt_gdn_step"} <= got, got
  assert any(t.startswith("jaxvt_qmatmul_experts") for t in got), got
  assert not {"jaxvt_qdequant", "jaxvt_qmatmul_grouped"} & got, got
  assert not _float_reductions(text)  # RMSNorm's and the gate's sums are the kernels'
  assert _splits(text) == {INVARIANT_ATTN_CHUNK}
  if T == 1:  # the split does not follow the kv bucket
    assert _splits(_program_text(eng, eng.ex, 1, 1024)) == {INVARIANT_ATTN_CHUNK}
  if T == 64:
    default = dataclasses.replace(eng.ex, products=cost.products_for("cuda"))
    text = _program_text(eng, default, T, kv)
    assert "dot_general" in text and "jaxvt_qdequant" in _targets(text)
    assert _float_reductions(text)
    assert "jaxvt_attn_step" not in _targets(text)


def test_the_default_rows_decode_split_follows_the_kv_bucket(hybrid_inv):
  """The control for the fixed split: the default row's decode program at kv_len 256 and 4096
  splits its positions in 16s and 32s (attn.chunk), so a row's sums change with the longest row
  beside it."""
  default = dataclasses.replace(hybrid_inv.ex, products=cost.products_for("cuda"))
  assert _splits(_program_text(hybrid_inv, default, 1, 256)) == {16}
  assert _splits(_program_text(hybrid_inv, default, 1, 4096)) == {32}


# ---- the pieces of the invariant arithmetic --------------------------------------------------

def test_attention_step_with_a_fixed_split_ignores_kv_len_and_other_rows(device):
  """A row of the fused attention step gives the same bits alone at kv_len 256 and beside a
  row at position 3000 in a program of kv_len 4096 when the split is fixed; with the split the
  kv_len picks (16 against 32 positions) the bits differ (the control)."""
  rng = np.random.default_rng(5)
  H, K, D, S = 4, 2, 64, 4096
  q = rng.standard_normal((2, H * D)).astype(np.float32)
  k = rng.standard_normal((2, K * D)).astype(np.float32)
  v = rng.standard_normal((2, K * D)).astype(np.float32)
  kc = rng.standard_normal((1, 2, S, K, D)).astype(np.float32)
  vc = rng.standard_normal((1, 2, S, K, D)).astype(np.float32)
  put = lambda a: jax.device_put(a, device)
  kw = dict(theta=1e4, rope_dim=D, interleaved=False, eps=1e-6, gate=False, qk_norm=False)

  def step(rows, positions, kv_len, split):
    f = jax.jit(lambda *a: attn.attn_step(*a, kv_len=kv_len, split=split, **kw)[0])
    return np.asarray(f(put(q[rows]), put(k[rows]), put(v[rows]), None, None, put(kc[:, rows]),
                        put(vc[:, rows]), jnp.int32(0), put(np.asarray(positions, np.int32))))

  alone = step([0], [200], 256, 64)
  assert np.isfinite(alone).all()
  np.testing.assert_array_equal(step([0, 1], [200, 3000], 4096, 64)[:1], alone)
  by_kv = [step([0], [200], n, None) for n in (256, 4096)]
  assert not np.array_equal(by_kv[0], by_kv[1])
  np.testing.assert_allclose(by_kv[1], alone, rtol=1e-5, atol=1e-5)


def test_invariant_norm_and_gate_are_right_and_a_rows_bits_do_not_depend_on_T(device):
  """The invariant row's RMSNorm (its sum of squares by the matvec kernel, 1 / sqrt in
  correctly rounded steps) and the shared expert's gate (rowdot) against numpy float64, and a
  row's bits alone, among 8 and among 512 rows."""
  from jaxvt.model.layers import rms_norm
  ex = Exec(kernels=True, numerics="q8", products=GPU_INVARIANT_PRODUCTS)
  rng = np.random.default_rng(9)
  x = rng.standard_normal((512, 2048)).astype(np.float32)
  w = rng.standard_normal(2048).astype(np.float32)
  put = lambda a: jax.device_put(a, device)
  norm = jax.jit(lambda x, w: rms_norm(x, w, 1e-6, ex))
  gate = jax.jit(lambda x, w: KERNELS.rowdot(x, w, ex))
  x64 = x.astype(np.float64)
  want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6) * w
  for fn, ref in ((norm, want), (gate, x64 @ w.astype(np.float64))):
    full = np.asarray(fn(put(x[None]), put(w)))[0]
    np.testing.assert_allclose(full, ref, rtol=2e-5, atol=2e-5)
    for i in (0, 7, 300, 511):
      np.testing.assert_array_equal(np.asarray(fn(put(x[None, i:i + 1]), put(w)))[0, 0], full[i])
      np.testing.assert_array_equal(np.asarray(fn(put(x[i:i + 8, None]), put(w)))[0, 0], full[i])


def test_ordered_combine_is_the_weighted_sum_and_a_tokens_bits_do_not_depend_on_T():
  """ops.combine(ordered=True) against numpy float64, and token 0's row alone equals its row
  among 64 tokens."""
  rng = np.random.default_rng(8)
  w = rng.random((64, 8)).astype(np.float32)
  d = rng.standard_normal((64, 8, 96)).astype(np.float32)
  f = jax.jit(lambda w, d: ops.combine(w, d, ordered=True))
  got = np.asarray(f(w, d))
  want = np.einsum("tk,tkd->td", w.astype(np.float64), d.astype(np.float64))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for t in (0, 37):
    np.testing.assert_array_equal(np.asarray(f(w[t:t + 1], d[t:t + 1]))[0], got[t])


# ---- the engine: the GPU row's code on the CPU's kernels -------------------------------------

def _invariant_on_cpu(path: str) -> engine_mod.Engine:
  """An engine of `path` on the CPU computing as the GPU's invariant row does: its tuning row
  and the GPU's "q8" arithmetic (float32 KV cache, jnp norms and gates, the fused steps)."""
  eng = engine_mod.load(path, max_context=CONTEXT)
  eng.ex = dataclasses.replace(eng.ex, numerics="q8", products=cost.products_for("cuda", True))
  return eng


def dense_file(directory) -> str:
  path = str(directory / "qwen3.gguf")
  synth.write_model(path, synth.tiny_config("qwen3", context_length=4096), "q8_0", seed=21)
  return path


def hybrid_file(directory) -> str:
  path = str(directory / "qwen35moe.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe", context_length=4096), "q8_0", seed=12)
  return path


@pytest.fixture(scope="module")
def dense_inv(tmp_path_factory):
  e = _invariant_on_cpu(dense_file(tmp_path_factory.mktemp("dense_inv")))
  yield e
  e.close()


@pytest.fixture(scope="module")
def hybrid_inv(tmp_path_factory):
  e = _invariant_on_cpu(hybrid_file(tmp_path_factory.mktemp("hybrid_inv")))
  yield e
  e.close()


# below 16 rows, between the default row's staged and tiled, past 64; past 1023 routed slots
# (the GPU's experts kernel then reads each routed expert once per 4 slots)
LENGTHS = (9, 23, 70, 600)


def _ids(eng, i: int, n: int | None = None) -> list[int]:
  n = n or 9 + 5 * i
  return np.random.default_rng(100 + i).integers(5, eng.cfg.vocab_size, n).tolist()


def cold_pieces_and_steps(eng, ids: list[int]):
  """(cold prefill logits, [logits of prefills in two pieces at 1, n/2, n-1], logits after the
  first token prefilled and the rest decoded one at a time)."""
  cold = np.asarray(eng.prefill(ids)[0])
  pieces = []
  for cut in (1, len(ids) // 2, len(ids) - 1):
    _, cache = eng.prefill(ids[:cut])
    pieces.append(np.asarray(eng.prefill(ids[cut:], cache, start=cut)[0]))
  logits, cache = eng.prefill(ids[:1])
  for i in range(1, len(ids)):
    logits, cache = eng.decode_step(cache, ids[i], i)
  return cold, pieces, np.asarray(logits)


@pytest.mark.parametrize("which", ["dense_inv", "hybrid_inv"])
def test_cold_prefill_pieces_and_token_by_token_give_the_same_bits(which, request):
  """A prompt of 9, 23, 70 or 600 tokens: its logits prefilled cold, from a prefix of 1, half
  or all but one of its tokens, and decoded token by token after its first, bit for bit."""
  eng = request.getfixturevalue(which)
  for n in LENGTHS:
    cold, pieces, steps = cold_pieces_and_steps(eng, _ids(eng, 0, n))
    assert np.isfinite(cold).all()
    for p in pieces:
      np.testing.assert_array_equal(p, cold, err_msg=f"{n} tokens, in pieces")
    np.testing.assert_array_equal(steps, cold, err_msg=f"{n} tokens, token by token")


def test_the_default_gpu_row_gives_other_bits_token_by_token(hybrid_inv):
  """The control: the default GPU row (staged products, chunked DeltaNet and jnp attention for a
  prefill) on the same file gives a cold prefill other logits than token-by-token decode."""
  eng = hybrid_inv
  inv = eng.ex
  try:
    eng.ex = dataclasses.replace(inv, products=cost.products_for("cuda"))
    cold, _, steps = cold_pieces_and_steps(eng, _ids(eng, 0, 40))
  finally:
    eng.ex = inv
  assert not np.array_equal(cold, steps)


@pytest.mark.parametrize("which", ["dense_inv", "hybrid_inv"])
def test_exact_repeat_and_next_turn_through_the_prefix_cache(which, request):
  """The same request twice at temperature 0 (on the dense file the second from the prefix
  cache, its last token prefilled alone; a DeltaNet state is kept only at snapshots, none of
  which this short prompt has before its end) gets the same tokens, and a next turn after a
  prefix hit equals it cold."""
  eng = request.getfixturevalue(which)
  ids = _ids(eng, 3, 30)
  (first,), (second,) = _serve(eng, [[ids], [ids]], max_tokens=24)
  assert first[1] == 0 and second[1] == (0 if eng.cfg.deltanet_layers else len(ids) - 1)
  assert second[0] == first[0]
  turn = ids + first[0][:-1] + _ids(eng, 5, 20)
  (_, (hit,)) = _serve(eng, [[ids], [turn]], max_tokens=16)
  ((cold,),) = _serve(eng, [[turn]], max_tokens=16, prefix=False)
  assert hit[1] > len(ids) // 2 and hit[0] == cold[0]


@pytest.mark.parametrize("which", ["dense_inv", "hybrid_inv"])
def test_eight_concurrent_requests_get_their_solo_tokens(which, request):
  """8 requests of 9 to 79 tokens served together (prefill and decode batches of 8 down to 1)
  against each alone; greedy and seeded."""
  eng = request.getfixturevalue(which)
  prompts = [_ids(eng, i, 9 + 10 * i) for i in range(8)]
  for kw in ({}, SEEDED):
    solo = [_serve(eng, [[p]], max_tokens=16, prefix=False, **kw)[0][0][0] for p in prompts]
    (together,) = _serve(eng, [prompts], max_tokens=16, **kw)
    assert [t for t, _ in together] == solo, kw


@pytest.mark.parametrize("which", ["dense_inv", "hybrid_inv"])
def test_generate_and_server_give_the_same_tokens(which, request):
  """Engine.generate (jaxvt.run's and the Python API's path) and the server's slots: the same
  greedy tokens and, for a seeded sampled request, the same draws."""
  eng = request.getfixturevalue(which)
  ids = _ids(eng, 4, 40)
  for kw in ({}, SEEDED):
    kw = dict(kw)
    seed = kw.pop("seed", 0)
    gen = eng.generate(ids, max_tokens=20, sampling=SamplingParams(**kw), seed=seed)
    ((served, _),), = _serve(eng, [[ids]], max_tokens=20, seed=seed, **kw)
    assert gen.tokens == served[:len(gen.tokens)] and len(gen.tokens) == len(served), kw


def test_the_benchmarks_gpu_arm_refuses_the_cpu_in_one_line(capsys):
  """python -m benchmarks.invariance --gpu on a machine without a GPU: one line, exit 2,
  nothing loaded or written."""
  from benchmarks import invariance
  assert invariance.cli(["--gpu", "--write"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith("jaxvt: error: --gpu") and err.count("\n") == 1
