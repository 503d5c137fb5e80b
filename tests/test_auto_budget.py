"""`--offload-gb auto` is safe by XLA's memory analysis, not only by the workspace estimate.

The planner's workspace figure starts as an analytic estimate; where memory is tight, XLA's
analysis of each candidate plan's own compiled prefill replaces it (Placed.settle). These tests
put a stub in the seam (`plan_for_engine(workspace_of=...)`) where the two disagree, in either
direction and depending on the budget, and check that auto's budget and every "smallest safe
budget" the messages name fit by the workspace of their own program. The end-to-end tests do
the same with the real model and XLA's real analysis (inflated, to disagree with the estimate).
"""

from __future__ import annotations

import re

import jax
import pytest

import jaxvt
from jaxvt import engine as engine_mod
from jaxvt import ffi, loader
from jaxvt.errors import JaxvtError
from jaxvt.model.declare import UnitBytes
from jaxvt.offload import memory as M
from jaxvt.offload import placement
from jaxvt.offload.plan import GiB
from test_plan_fixtures import model

CONTEXTS = (512, 2048, 8192, 32768)


@pytest.fixture(autouse=True)
def _host_ram_unknown(monkeypatch):
  """The 35B-shaped plans pin up to 18 GiB; the host-RAM check is another test's subject."""
  monkeypatch.setattr(M, "host_memory_check", lambda *a, **k: None)


def _units(name: str):
  cfg, decls, sizes = model(name)
  return cfg, decls, [UnitBytes(n, l, b, -1) for (n, l), b in sizes.items()]


def _plan(workspace_of, offload_gb="auto", device_gb=16.0, max_context=2048, force=False):
  cfg, decls, units = _units("qwen36_35b")
  return placement.plan_for_engine(cfg, decls, units, offload_gb=offload_gb, device_gb=device_gb,
                                   max_context=max_context, force=force, device=jax.devices()[0],
                                   workspace_of=workspace_of)


def _estimate(p: placement.Placed) -> int:
  return M.estimate_workspace_bytes(p.cfg, p.shape)


def _fits_own(p: placement.Placed, ws) -> bool:
  return M.plan_breakdown(p.plan, p.facts, p.cfg, p.shape, ws(p.plan)).fits


class Stub:
  """XLA's workspace as a function of the plan: the estimate + `extra_gib` + `per_host` times
  the host-tier bytes (a program whose workspace grows as weights leave the device)."""

  def __init__(self, extra_gib: float, per_host: float = 0.0, max_context: int = 2048):
    shape = M.RunShape(max_context=max_context, prefill_chunk=max_context, kv_elem_bytes=4)
    self.base = M.estimate_workspace_bytes(model("qwen36_35b")[0], shape) + int(extra_gib * GiB)
    self.per_host, self.calls = per_host, []

  def __call__(self, plan) -> int:
    self.calls.append(plan.budget_bytes)
    return self.base + int(self.per_host * plan.host_bytes)


_stub = Stub


def test_auto_chosen_by_the_estimate_would_be_refused_by_xla():
  """The measured failure: auto picked a budget from the estimate that XLA's larger workspace
  refused. With XLA's figure deciding, auto's budget fits by its own program's workspace."""
  ws = _stub(0.3)
  est_only = _plan(None)
  assert not M.plan_breakdown(est_only.plan, est_only.facts, est_only.cfg, est_only.shape,
                              ws(est_only.plan)).fits
  p = _plan(ws)
  assert p.plan.budget_bytes > est_only.plan.budget_bytes
  assert _fits_own(p, ws) and p.breakdown.fits
  assert p.breakdown.workspace_source == "XLA memory analysis"
  assert "XLA's memory analysis" in p.reason


def test_auto_smaller_workspace_offloads_less():
  """The other direction (XLA below the estimate, as on CPU): auto takes the smaller budget."""
  ws = _stub(-0.1)
  est_only = _plan(None)
  p = _plan(ws)
  assert p.plan.budget_bytes < est_only.plan.budget_bytes and _fits_own(p, ws)


def test_auto_settles_when_the_workspace_grows_with_the_budget():
  ws = _stub(0.3, per_host=0.05)
  p = _plan(ws)
  assert _fits_own(p, ws)
  assert len(set(ws.calls)) >= 3  # estimate's plan, then at least two re-chosen budgets


def test_auto_that_never_settles_is_an_error():
  ws = _stub(0.3, per_host=0.8)  # every GiB offloaded costs 0.8 GiB of workspace
  with pytest.raises(JaxvtError, match="did not settle"):
    _plan(ws)


@pytest.mark.parametrize("max_context", CONTEXTS)
@pytest.mark.parametrize("extra", [-0.05, 0.3, 1.0])
def test_auto_is_safe_at_every_context(max_context, extra):
  ws = _stub(extra, per_host=0.02, max_context=max_context)
  try:
    p = _plan(ws, max_context=max_context)
  except JaxvtError as e:  # only when nothing fits even with everything offloaded
    assert "no budget is safe" in str(e), str(e)
    p = _plan(None, offload_gb=1e4, max_context=max_context, force=True)
    assert not M.plan_breakdown(p.plan, p.facts, p.cfg, p.shape, ws(p.plan)).fits
    return
  assert _fits_own(p, ws)


@pytest.mark.parametrize("per_host", [0.0, 0.05])
def test_refusal_names_a_budget_whose_own_program_fits(per_host):
  ws = _stub(0.3, per_host)
  with pytest.raises(JaxvtError) as e:
    _plan(ws, offload_gb=1.0)
  msg = str(e.value)
  assert msg.startswith("offload budget 1 GiB leaves ")
  named = float(re.search(r"the smallest safe budget is ([0-9.]+) GiB", msg).group(1))
  p = _plan(ws, offload_gb=named)  # the named budget, passed as a user would: accepted
  assert _fits_own(p, ws)
  p = _plan(ws, offload_gb=1.0, force=True)  # --force runs it, the breakdown says short
  assert not p.breakdown.fits and p.breakdown.workspace_source == "XLA memory analysis"


# ---- the real model and XLA's real analysis -------------------------------------------------

needs_ext = pytest.mark.skipif(not ffi.available("cpu"), reason="the jaxvt extension is not built")


@needs_ext
def test_abstract_weights_give_the_loaded_program():
  """The workspace planned from the weights' shapes alone equals that of the loaded weights."""
  with jaxvt.load(max_context=512, offload_gb=0.05) as eng:
    assert eng.plan.host_bytes > 0
    real = jax.tree.map(lambda a: (a.shape, a.dtype), eng.weights)
    m = loader.open_model(eng.path)
    abstract = loader.abstract_weights(m, eng.plan.placement)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == real
    planned = engine_mod.plan_workspace_bytes(m, eng.plan.placement, eng.ex, eng.max_context,
                                              eng.prefill_chunk)
    assert planned == engine_mod.xla_workspace_bytes(eng) == eng.memory.workspace


@needs_ext
def test_auto_with_xla_above_the_estimate_end_to_end(monkeypatch):
  """The default model with XLA's real analysis inflated above the estimate: the budget the
  estimate alone picks is refused by it, and load's auto budget fits and runs."""
  with jaxvt.load(max_context=2048) as eng:
    bd = eng.plan.breakdown  # the estimate's breakdown, nothing offloaded
    weights = eng.plan.plan.total_bytes
    real = engine_mod.xla_workspace_bytes(eng)
    tokens = eng.generate("The capital of France is", max_tokens=6).tokens
  extra = bd.workspace - real + int(0.03 * GiB)  # XLA's figure: the estimate + 0.03 GiB
  cap = bd.kv_cache + bd.state + bd.workspace + M.SLACK_MIN_BYTES + int(0.6 * weights)
  orig = engine_mod.plan_workspace_bytes
  monkeypatch.setattr(engine_mod.steps, "plan_workspace_bytes", lambda *a: orig(*a) + extra)
  with jaxvt.load(max_context=2048, offload_gb="auto", device_gb=cap / GiB) as eng:
    assert eng.memory.workspace_source == "XLA memory analysis" and eng.memory.fits
    chosen = eng.plan.plan
    assert eng.generate("The capital of France is", max_tokens=6).tokens == tokens
  p_est = engine_mod.plan(loader.open_model(eng.path), offload_gb="auto", device_gb=cap / GiB,
                          max_context=2048)
  assert p_est.plan.host_bytes < chosen.host_bytes  # the estimate alone keeps more on device
