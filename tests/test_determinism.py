"""Deterministic numerics: jaxvt's programs compile with chosen XLA options (jaxvt.programs), and
tokens and logits agree across processes and offload budgets (CPU here; the GPU run of the same
comparison is tests/test_determinism_gpu.py)."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest

import jaxvt
from jaxvt import ffi, programs
from benchmarks import determinism
from jaxvt.model.layers import Exec
from jaxvt.sampling import SamplingParams


def test_the_options_are_known_to_this_jaxlib():
  """The GPU option names are XLA DebugOptions fields: the CPU compiler accepts them (and
  ignores them); a renamed field would fail here, as a misspelt one does."""
  f = jax.jit(lambda x: x @ x, compiler_options=programs.compiler_options(True))
  assert float(f(jnp.ones((4, 4))).sum()) == 64.0
  bad = jax.jit(lambda x: x + 1, compiler_options={"xla_gpu_no_such_option": True})
  with pytest.raises(Exception, match="No such compile option"):
    bad(jnp.ones(2))
  assert programs.compiler_options(False) is None
  g = jax.jit(lambda x: x @ x, compiler_options=programs.compiler_options(True, True))
  assert float(g(jnp.ones((4, 4))).sum()) == 64.0
  assert programs.compiler_options(False, True) == programs.CONCURRENT_OPTIONS


@pytest.mark.parametrize("options,good,bad", [
    ("DETERMINISTIC_OPTIONS", Exec(deterministic=False), Exec(deterministic=True)),
    ("DETERMINISTIC_OPTIONS", Exec(deterministic=False), Exec()),  # deterministic by default
    ("CONCURRENT_OPTIONS", Exec(deterministic=False), Exec(deterministic=False, concurrent=True)),
])
def test_program_compiles_with_the_options_its_ex_asks_for(monkeypatch, options, good, bad):
  """A Program passes the deterministic (concurrent) options only to an `ex` asking for them:
  with an option XLA rejects in the set, that call fails (called or compiled) and the other one
  compiles."""
  monkeypatch.setattr(programs, options, {"xla_gpu_no_such_option": 1})

  @programs.jit(static_argnames=("ex",))
  def f(x, *, ex):
    return x * 2

  assert float(f(jnp.ones(2), ex=good).sum()) == 4.0
  with pytest.raises(Exception, match="No such compile option"):
    f(jnp.ones(2), ex=bad)
  with pytest.raises(Exception, match="No such compile option"):
    f.lower(jnp.ones(2), ex=bad).compile()


def test_env_flag():
  assert programs.env_flag({}, "X") is True
  assert programs.env_flag({"X": ""}, "X") is True
  for off in ("0", "false", "No", " off "):
    assert programs.env_flag({"X": off}, "X") is False
  assert programs.env_flag({"X": "1"}, "X", default=False) is True


def test_first_difference_finds_each_kind():
  a = dict(tokens=[[1, 2, 3], [4, 5]], logits=[["a", "b"], ["c"]], sampled=[7, 8])
  assert determinism.first_difference(a, a) is None
  b = dict(a, tokens=[[1, 2, 3], [4, 6]])
  assert determinism.first_difference(a, b) == "tokens of prompt 1 differ at step 1"
  b = dict(a, logits=[["a", "x"], ["c"]])
  assert determinism.first_difference(a, b) == "logits of prompt 0 differ at step 1"
  b = dict(a, sampled=[7, 9])
  assert determinism.first_difference(a, b) == "sampled tokens differ at step 1"


needs_ext = pytest.mark.skipif(not ffi.available("cpu"), reason="the jaxvt extension is not built")


@needs_ext
def test_seeded_sampling_is_reproducible_and_deterministic_off_runs():
  with jaxvt.load(max_context=256) as eng:
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    a = eng.generate("The capital of France is", max_tokens=12, sampling=p, seed=5).tokens
    assert eng.generate("The capital of France is", max_tokens=12, sampling=p, seed=5).tokens == a
    assert eng.generate("The capital of France is", max_tokens=12, sampling=p,
                        seed=6).tokens != a  # the seed matters
    off = dataclasses.replace(eng, ex=dataclasses.replace(eng.ex, deterministic=False),
                              warmed=set())
    g = off.generate("The capital of France is", max_tokens=8)
    assert g.stats.compile_seconds > 0  # its own programs (XLA's defaults) were compiled
    assert g.tokens == eng.generate("The capital of France is", max_tokens=8).tokens  # CPU


@needs_ext
def test_processes_and_budgets_agree():
  """Two processes, each compiling its own programs: nothing offloaded, and `auto` on a
  0.66 GiB device (part of the weights in the host tier): the same greedy and sampled tokens,
  and bit-equal logits digests. (The CPU compiles one way every time; the GPU test also runs
  the first configuration twice.)"""
  args = types.SimpleNamespace(model=None, configs="0,auto@0.66", tokens=12, max_context=2048,
                               nondeterministic=False, temperature=0.8, seed=7,
                               repeat_first=False)
  runs, diffs = determinism.compare(args)
  assert not diffs, diffs
  assert [r["host_gib"] > 0 for r in runs] == [False, True]
  assert len(runs[0]["logits"][0]) == determinism.LOGIT_STEPS + 1


def test_exec_for_schedules_decode_concurrently_on_one_gpu():
  """One GPU: decode compiles under XLA's concurrent command-buffer scheduling, with the inline
  expert fetch; a mesh of several devices and the CPU keep XLA's default; prefill's programs
  never take it (model_fns.prefill_fn)."""
  import types
  from jaxvt import engine, model_fns
  one = engine.exec_for("cuda", True, None)
  assert one.concurrent and one.products.predict_inline and one.products.predict_after_host
  assert not engine.exec_for("cuda", True, types.SimpleNamespace(size=2)).concurrent
  assert not engine.exec_for("cpu", True, None).concurrent
  assert not engine.exec_for("cuda", False, None).concurrent
  assert model_fns.decode_fn._mode({"ex": one}) == (True, True)
  assert model_fns.decode_loop_fn._mode({"ex": one}) == (True, True)
  assert model_fns.prefill_fn._mode({"ex": one}) == (True, False)


def test_gpu_products_scale_the_prediction_per_layer():
  """GPU_PRODUCTS predicts 2 experts at 8 blocks for a layer holding all three routed stacks in
  the host tier and scales per layer (predict_scale 3: down stacks alone get 6); a decode fetch
  is given as many ids as any layer can copy (at most 8); the CPU predicts nothing."""
  from jaxvt import engine
  from jaxvt.ffi.tuning import CPU_PRODUCTS, GPU_PRODUCTS, Products
  g = GPU_PRODUCTS
  assert (g.predict_after_host, g.predict_after_device, g.predict_blocks) == (2, 2, 8)
  assert g.predict_scale == 3 and g.predicted_ids() == 6 and g.prefetch_rings == 2
  assert dataclasses.replace(g, predict_after_device=3).predicted_ids() == 8
  assert dataclasses.replace(g, predict_scale=0).predicted_ids() == 2
  from jaxvt.offload import cost
  # the engine's row: the table's, with the short-call crossover of the platform's rates
  assert engine.exec_for("cuda", True, None).products == dataclasses.replace(
      g, routed_per_expert=cost.routed_crossover(cost.DEFAULT_RATES["cuda"]))
  assert engine.exec_for("cpu", True, None).products == CPU_PRODUCTS
  assert engine.exec_for("cpu", False, None).products == Products()  # no kernels: no fused step
