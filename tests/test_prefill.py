"""Prefill on CPU: chunked prompts, and the per-product kernel rule (jaxvt.ffi.tuning.Products) of GPU prefill.

Chunks: Engine.prefill runs a prompt in calls of at most `prefill_chunk` tokens; the logits and
greedy tokens equal one pass (the default model, and a Qwen3.5-MoE fixture whose DeltaNet state
and KV cache carry across chunks), and the chunk the planner budgeted (RunShape.prefill_chunk) is
the one that runs and the one XLA's memory analysis compiles.

Products: the rule picks matvec / tiled / staged per dense product and matvec / grouped for the
routed experts from rows, tier and bytes; a 16-row prompt stages nothing; the GPU rule's model
(run here on the CPU kernels, which implement every path) agrees with the f32 matvec model.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvt
from jaxvt import engine, ffi, model_fns
from jaxvt import synth
from jaxvt.ffi.tuning import GPU_PRODUCTS, Products
from jaxvt.model.presets import qwen36_35b_a3b_config
from jaxvt.qweight import QMeta

pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")


def test_prefill_chunks():
  pc = engine.prefill_chunks
  assert pc(12, 0, 2048, 2048) == [(0, 12, 16)]
  assert pc(45, 0, 16, 128) == [(0, 16, 16), (16, 16, 16), (32, 13, 16)]
  assert pc(5000, 0, 2048, 8192) == [(0, 2048, 2048), (2048, 2048, 2048), (4096, 904, 1024)]
  # never a program past max_context, nor longer than the chunk
  assert pc(10, 118, 16, 128) == [(0, 10, 10)]
  assert pc(40, 0, 24, 64) == [(0, 24, 24), (24, 16, 16)]
  for n, start, c, ctx in [(1, 0, 1, 8), (300, 17, 100, 512), (8192, 0, 2048, 8192)]:
    runs = pc(n, start, c, ctx)
    assert sum(m for _, m, _ in runs) == n and all(m <= T <= c for _, m, T in runs)
    assert all(start + off + T <= ctx for off, _, T in runs)


class _Spy:
  """Stands in for engine.prefill_fn and records the program length of each call and lowering."""

  def __init__(self, real):
    self.real, self.ran, self.lowered = real, [], []

  def __call__(self, *args, **kw):
    self.ran.append(args[2].shape[1])
    return self.real(*args, **kw)

  def lower(self, *args, **kw):
    self.lowered.append(args[2].shape[1])
    return self.real.lower(*args, **kw)

  def compile(self, *args, **kw):
    return self.real.compile(*args, **kw)

  def file_key(self, *args, **kw):
    return None  # no kept memory analysis: the check lowers, and the spy sees its length


def _compare_chunked(eng, prompt: list[int], chunk: int, spy: _Spy, gen: int = 0):
  """One pass against chunks of `chunk`: logits within float32 noise, the same greedy token after
  the prompt, and (gen > 0) the same `gen` greedy tokens."""
  one = eng.prefill_chunk
  logits_one, _ = eng.prefill(prompt)
  tokens_one = eng.generate(prompt, max_tokens=gen).tokens if gen else []
  spy.ran.clear()
  eng.prefill_chunk = chunk
  logits_chunked, _ = eng.prefill(prompt)
  assert spy.ran and max(spy.ran) <= chunk and len(spy.ran) == -(-len(prompt) // chunk)
  tokens_chunked = eng.generate(prompt, max_tokens=gen).tokens if gen else []
  eng.prefill_chunk = one
  a, b = np.asarray(logits_one), np.asarray(logits_chunked)
  np.testing.assert_allclose(b, a, atol=1e-4 * np.abs(a).max(), rtol=0)
  assert np.argmax(a) == np.argmax(b) and tokens_chunked == tokens_one


def test_chunked_prefill_on_the_default_model(monkeypatch):
  spy = _Spy(engine.prefill_fn)
  monkeypatch.setattr(engine.runtime, "prefill_fn", spy)  # what Engine runs
  monkeypatch.setattr(model_fns, "prefill_fn", spy)  # what xla_workspace_bytes lowers
  # device_gb makes load re-check the plan with XLA's analysis of the largest prefill program.
  with jaxvt.load(max_context=128, prefill_chunk=16, device_gb=8) as eng:
    assert eng.prefill_chunk == eng.plan.shape.prefill_chunk == 16
    assert spy.lowered == [16] and eng.memory.workspace_source == "XLA memory analysis"
    prompt = eng.tokenizer.encode("The capital of France is Paris, and the capital of Italy is "
                                  "Rome. The capital of Spain is Madrid, the capital of Portugal "
                                  "is Lisbon, and the capital of Germany is")
    assert len(prompt) > 32
    spy.ran.clear()
    eng.prefill(prompt)
    assert spy.ran == [16] * (len(prompt) // 16) + [16] * (len(prompt) % 16 > 0)
    eng.prefill_chunk = 128
    _compare_chunked(eng, prompt, 16, spy, gen=8)


def test_planned_chunk_is_capped_and_budgeted():
  with jaxvt.load(max_context=64, prefill_chunk=4096) as eng:
    assert eng.prefill_chunk == eng.plan.shape.prefill_chunk == 64
  with pytest.raises(jaxvt.JaxvtError, match="prefill chunk"):
    jaxvt.load(max_context=64, prefill_chunk=0)


@pytest.fixture(scope="module")
def qwen35moe(tmp_path_factory):
  cfg = synth.tiny_config("qwen35moe", d_model=256, expert_ffn_dim=256, shared_ffn_dim=256)
  path = str(tmp_path_factory.mktemp("prefill") / "qwen35moe.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=5)
  return path


def test_chunked_prefill_carries_deltanet_state(qwen35moe, monkeypatch):
  """Chunks of 16 (DeltaNet's chunked form runs 64-token chunks: a 16-token call is one partial
  chunk whose state the next call continues) against one pass of 45 tokens."""
  spy = _Spy(engine.prefill_fn)
  monkeypatch.setattr(engine.runtime, "prefill_fn", spy)
  prompt = [int(t) for t in np.random.default_rng(1).integers(3, 300, 45)]
  with jaxvt.load(qwen35moe, max_context=128) as eng:
    _compare_chunked(eng, prompt, 16, spy)


def test_products_rule():
  dense = QMeta(rows=2048, cols=4096, experts=0, formats=(12,), n_layers=4)
  host = dataclasses.replace(dense, host_layers=(1,))
  head = QMeta(rows=248320, cols=2048, experts=0, formats=(14,), n_layers=1)
  p = GPU_PRODUCTS
  assert Products().dense(512, dense) == "matvec" and Products().experts(4096) == "matvec"
  assert p.dense(1, dense) == "matvec" and p.dense(p.stage_rows - 1, dense) == "matvec"
  assert p.dense(p.stage_rows, dense) == "staged" and p.dense(4096, dense) == "staged"
  for n in (1, p.tiled_rows, p.stage_rows - 1, p.stage_rows, 4096):  # the tier changes nothing
    assert p.dense(n, host) == p.dense(n, dense)
  # A matrix whose bf16 copy (970 MiB) is over stage_max_bytes takes the tile kernel instead.
  assert p.dense(p.tiled_rows - 1, head) == "matvec" and p.dense(p.tiled_rows, head) == "tiled"
  assert p.experts(p.grouped_slots - 1) == "matvec" and p.experts(p.grouped_slots) == "grouped"
  # A 12-token prompt (a 16-row program) dequantizes no routed-expert stack of the 35B model (the
  # bulk of its bytes), in either tier: the experts' paths never stage.
  cfg = qwen36_35b_a3b_config(n_nextn=0)
  assert p.experts(16 * cfg.n_experts_used) == "matvec"
  rule = Products(tiled_rows=8, stage_rows=16, grouped_slots=64)
  assert rule.dense(8, dense) == "tiled" and rule.dense(15, dense) == "tiled"


def _targets(lowered) -> set[str]:
  """The jaxvt custom calls of a lowered program."""
  text = lowered.as_text()
  return set(re.findall(r"custom_call @(jaxvt_\w+)", text)) | set(
      re.findall(r"custom_call_target\s*=\s*\"(jaxvt_\w+)\"", text))


def test_gpu_rules_in_the_model_on_cpu_kernels(qwen35moe):
  """The GPU's rule (GPU_PRODUCTS) and the tile / grouped paths it can take, run on the CPU kernels
  in f32 at 16 rows: each program holds the custom calls its rule names (staged dense layers,
  tiled dense layers, per-slot or grouped experts), and its logits agree with the f32 matvec
  model to bf16 roundings."""
  with jaxvt.load(qwen35moe, max_context=256) as eng:
    T = 16
    slots = T * eng.cfg.n_experts_used
    f32 = dataclasses.replace(eng.ex, numerics="f32", products=Products())
    cache = jax.eval_shape(lambda: eng.new_cache(1))
    toks = jnp.asarray(np.random.default_rng(2).integers(3, 300, (1, T)), jnp.int32)
    args = (toks, jnp.arange(T, dtype=jnp.int32)[None], jnp.ones((1, T), bool),
            jnp.asarray([T - 1], jnp.int32))

    def logits(ex):
      c = eng.new_cache(1)
      return np.asarray(engine.prefill_fn(eng.weights, c, *args, cfg=eng.cfg, ex=ex, kv_len=T)[0])

    want = logits(f32)
    tiles = Products(tiled_rows=8, grouped_slots=slots)
    for rule in (GPU_PRODUCTS, tiles):
      ex = dataclasses.replace(eng.ex, numerics="f32", products=rule)
      names = _targets(engine.prefill_fn.lower(eng.weights, cache, *args, cfg=eng.cfg, ex=ex,
                                               kv_len=T))
      staged = bool(rule.stage_rows) and T >= rule.stage_rows
      tiled = not staged and bool(rule.tiled_rows) and T >= rule.tiled_rows
      grouped = rule.experts(slots) == "grouped"
      assert ("jaxvt_qdequant" in names) == staged
      assert ("jaxvt_qmatmul_grouped" in names) == (tiled or grouped)
      assert ("jaxvt_qmatmul_experts" in names) == (not grouped)
      got = logits(ex)
      np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(), rtol=0)


def test_products_probe_runs(monkeypatch, tmp_path):
  """`python -m benchmarks.tier --products` on tiny shapes (the GPU run times the 35B ones): a
  table cell for every path and row count, and where each path starts to win."""
  import types
  from benchmarks import products, report
  monkeypatch.setattr(products, "SHAPES", [(64, 256)])
  monkeypatch.setattr(products, "FORMATS", (12,))
  monkeypatch.setattr(products, "ROWS", (40,))
  monkeypatch.setattr(products, "TIERS", ("host",))
  monkeypatch.setattr(products, "EXPERTS", 4)
  monkeypatch.setattr(products, "TOP_K", 2)
  monkeypatch.setattr(products, "EXPERT_MATS", [(12, 32, 256, False), (14, 32, 256, True)])
  out = tmp_path / "B.md"
  real = report.write_section
  monkeypatch.setattr(report, "write_section", lambda name, body: real(name, body, str(out)))
  body = products.main(types.SimpleNamespace(products="all"))
  assert "<!-- bench:products-cpu -->" in out.read_text()
  rows = [l for l in body.splitlines() if l.startswith("| device |") or l.startswith("| host |")]
  assert len(rows) == 2 * (1 + 2)  # dense + experts tables, then the summary
  assert all(len(re.findall(r"\d+\.\d{3} / \d+\.\d{3} / \d+\.\d{3}", l)) == 1 for l in rows[:3])
  monkeypatch.setattr(products, "ROWS", (1, 40))
  assert products._wins({"a": [3.0, 1.0], "b": [2.0, 2.0]}, "a", ("b",)) == 40
  assert products._wins({"a": [1.0, 3.0], "b": [2.0, 2.0]}, "a", ("b",)) is None
