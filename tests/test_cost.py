"""Cost model and `--offload-gb auto`."""

import pytest
from hypothesis import given, settings, strategies as st

from jaxvt.errors import JaxvtError
from jaxvt.offload import cost as C
from jaxvt.offload import memory as M
from jaxvt.offload.plan import GiB
from test_plan_fixtures import base_plan, model


def test_predict_arithmetic():
  cfg, _, _ = model("qwen36_35b")
  p = base_plan("qwen36_35b").rebudget(6 * GiB)
  r = C.Rates("cuda", device_read_gbps=1000.0, host_read_gbps=50.0, launch_us=2.0)
  shape = M.RunShape(max_context=4096)
  pred = C.predict(p, r, cfg, shape, context_pos=100)
  dev = p.device_read_bytes + C.state_read_bytes(cfg, shape, 100)
  assert pred.device_read_bytes == dev
  assert pred.host_read_bytes == p.host_read_bytes
  assert pred.device_ms == pytest.approx(dev / 1e9 / 1000 * 1e3)
  assert pred.host_ms == pytest.approx(p.host_read_bytes / 1e9 / 50 * 1e3)
  assert pred.fixed_ms == pytest.approx(
      (C.kernel_calls(p, cfg) * 2.0 + cfg.n_layers * C.XLA_OPS_PER_LAYER * r.op_us) / 1000)
  r3 = C.Rates("cuda", device_read_gbps=1000.0, host_read_gbps=50.0, launch_us=2.0, step_ms=3.0)
  assert C.predict(p, r3, cfg, shape, context_pos=100).fixed_ms == pytest.approx(pred.fixed_ms + 3)
  assert pred.tokens_per_s == pytest.approx(1000 / pred.ms_per_step)
  assert C.predict(p, r, cfg, shape).context_pos == 2048


def test_kernel_calls_and_state_reads():
  cfg, _, _ = model("smollm2_135m")
  p = base_plan("smollm2_135m")
  # 7 matrices per layer + the (tied) embedding
  assert C.kernel_calls(p, cfg) == 30 * 7 + 1
  big, _, _ = model("qwen36_35b")
  # 4 matrices per attention layer, 5 per DeltaNet layer; per layer a router, the routed gate,
  # up and down calls and 3 shared-expert matrices; embedding and head (471 matrix kernels per
  # step in the H200 trace of this model: 351 qmatmul + 120 qmatmul_experts)
  q = base_plan("qwen36_35b")
  assert C.kernel_calls(q, big) == 10 * 4 + 30 * 5 + 40 * 7 + 2
  shape = M.RunShape()
  assert (C.state_read_bytes(big, shape, 10) - C.state_read_bytes(big, shape, 0) ==
          10 * 10 * 2 * 2 * 256 * 2)


def test_default_rates_use_gemv_not_streaming():
  for plat in ("cuda", "rocm"):
    r = C.default_rates(plat)
    assert r.host_read_gbps < r.zero_copy_gbps
    assert r.source.startswith("default")
  assert C.default_rates("rocm").host_read_gbps == 8.0  # the GEMM rate, not the 23 GB/s stream
  assert C.default_rates("rocm").managed_migrates is False
  assert C.default_rates("gpu") == C.default_rates("cuda")
  with pytest.raises(JaxvtError, match="no default rates"):
    C.default_rates("tpu")
  with pytest.raises(JaxvtError, match="must be positive"):
    C.Rates("cuda", 0.0, 1.0, 1.0)


@settings(max_examples=50, deadline=None)
@given(st.floats(0, 1), st.floats(0, 1), st.floats(1, 5000), st.floats(0.5, 1.0))
def test_slower_host_tier_means_more_budget_is_never_faster(f1, f2, dev_rate, ratio):
  cfg, _, _ = model("qwen36_35b")
  p = base_plan("qwen36_35b")
  r = C.Rates("cuda", dev_rate, dev_rate * ratio, 3.0)
  lo, hi = sorted((int(f1 * p.total_bytes), int(f2 * p.total_bytes)))
  a = C.predict(p.rebudget(lo), r, cfg)
  b = C.predict(p.rebudget(hi), r, cfg)
  assert a.ms_per_step <= b.ms_per_step * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["qwen36_35b", "smollm2_135m"]), st.floats(0.05, 40.0),
       st.sampled_from(["cuda", "rocm", "cpu"]))
def test_auto_budget_is_the_smallest_safe(name, cap_gb, plat):
  cfg, _, _ = model(name)
  p = base_plan(name)
  facts = M.DeviceFacts(int(cap_gb * GiB))
  shape = M.RunShape(max_context=2048)
  safe = M.smallest_safe_budget(p, facts, cfg, shape)
  if safe is None:
    with pytest.raises(JaxvtError, match="no budget is safe"):
      C.auto_budget(p, facts, C.default_rates(plat), cfg, shape)
    return
  a = C.auto_budget(p, facts, C.default_rates(plat), cfg, shape)
  assert a.budget_bytes == safe and a.plan.host_bytes <= safe
  assert M.plan_breakdown(a.plan, facts, cfg, shape).fits
  assert "\n" not in a.reason and a.reason.startswith("--offload-gb auto: ")
  if safe == 0:
    assert "nothing offloaded" in a.reason


def test_auto_budget_35b_16gib():
  cfg, _, _ = model("qwen36_35b")
  p = base_plan("qwen36_35b")
  a = C.auto_budget(p, M.DeviceFacts.from_gb(16, "cuda"), C.default_rates("cuda"), cfg)
  assert a.reason.startswith("--offload-gb auto: 3.4 GiB, the smallest budget that keeps the "
                             "0.50 GiB slack on this 16 GiB device; predicted ")
  fits = C.auto_budget(p, M.DeviceFacts.from_gb(40, "cuda"), C.default_rates("cuda"), cfg)
  assert fits.budget_bytes == 0 and "nothing offloaded" in fits.reason


def test_auto_budget_takes_more_only_for_a_real_gain():
  cfg, _, _ = model("qwen36_35b")
  p = base_plan("qwen36_35b")
  facts = M.DeviceFacts.from_gb(16, "cuda")
  safe = M.smallest_safe_budget(p, facts, cfg, M.RunShape())
  # A (hypothetical) host tier faster than the device: everything goes.
  fast = C.Rates("cuda", 100.0, 200.0, 1.0, source="test: made up")
  a = C.auto_budget(p, facts, fast, cfg)
  assert a.budget_bytes == p.max_useful_budget > safe
  assert "predicted fastest" in a.reason
  # Equal rates tie: the smallest safe budget.
  same = C.Rates("cpu", 10.0, 10.0, 1.0)
  assert C.auto_budget(p, facts, same, cfg).budget_bytes == safe
