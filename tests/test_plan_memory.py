"""Device-memory planner: breakdown, smallest safe budget, the cliff guard, host RAM."""

import re

import pytest
from hypothesis import given, settings, strategies as st

from jaxvt.errors import JaxvtError
from jaxvt.offload import memory as M
from jaxvt.offload.plan import GiB
from test_plan_fixtures import base_plan, model

MiB = 1 << 20


def test_kv_and_state_bytes():
  cfg, _, _ = model("qwen36_35b")
  shape = M.RunShape(batch=1, max_context=4096)
  # 10 attention layers x K and V x 2 heads x 256 x 4096 tokens x bf16
  assert M.kv_cache_bytes(cfg, shape) == 10 * 2 * 2 * 256 * 4096 * 2 == 80 * MiB
  conv_dim = 2 * 16 * 128 + 32 * 128
  assert M.recurrent_state_bytes(cfg, shape) == 30 * ((4 - 1) * conv_dim + 32 * 128 * 128) * 4
  assert M.recurrent_state_bytes(cfg, M.RunShape(batch=3)) == 3 * M.recurrent_state_bytes(cfg, shape)
  small, _, _ = model("smollm2_135m")
  assert M.kv_cache_bytes(small, M.RunShape(batch=2, max_context=100)) == 30 * 3 * 128 * 100 * 2 * 2
  assert M.recurrent_state_bytes(small, shape) == 0


def test_workspace_estimate():
  cfg, _, _ = model("qwen36_35b")
  ws = M.estimate_workspace_bytes(cfg, M.RunShape(prefill_chunk=512))
  logits = 1 * 248320 * 4  # last-position logits only
  assert logits < ws < logits + GiB
  assert M.estimate_workspace_bytes(cfg, M.RunShape(prefill_chunk=1024)) > ws
  assert M.estimate_workspace_bytes(cfg, M.RunShape(batch=2)) > ws


def test_slack_default():
  assert M.DeviceFacts.from_gb(16).slack == GiB // 2
  assert M.DeviceFacts.from_gb(8).slack == GiB // 2
  big = M.DeviceFacts(141 * GiB)
  assert big.slack == int(0.03 * 141 * GiB)
  assert M.DeviceFacts(16 * GiB, slack_bytes=123).slack == 123


def test_device_facts_sources():
  f = M.DeviceFacts.from_memory_stats({"bytes_limit": 112 * GiB}, "cuda", "NVIDIA H200")
  assert f.capacity_bytes == 112 * GiB and f.source == "bytes_limit of the device"
  g = M.DeviceFacts.from_memory_stats({"bytes_limit": 112 * GiB}, "cuda", "H200", device_gb=16)
  assert g.capacity_bytes == 16 * GiB and g.source == "--device-gb 16"
  with pytest.raises(JaxvtError, match="pass --device-gb"):
    M.DeviceFacts.from_memory_stats(None, "cpu", "cpu")
  with pytest.raises(JaxvtError, match="must be positive"):
    M.DeviceFacts.from_gb(0)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["qwen36_35b", "smollm2_135m"]), st.floats(0.01, 30.0), st.floats(0, 1.0),
       st.one_of(st.none(), st.integers(0, 2 * GiB)), st.integers(1, 4), st.integers(1, 8192))
def test_breakdown_adds_up_and_guard_fires_exactly_below_slack(name, cap_gb, frac, ws, batch, ctx):
  cfg, _, _ = model(name)
  p = base_plan(name)
  p = p.rebudget(int(frac * p.total_bytes))
  facts = M.DeviceFacts(max(1, int(cap_gb * GiB)))
  shape = M.RunShape(batch=batch, max_context=ctx)
  bd = M.plan_breakdown(p, facts, cfg, shape, ws)
  assert bd.weights + bd.kv_cache + bd.state + bd.workspace + bd.slack + bd.free == bd.capacity
  assert bd.weights == p.device_bytes
  assert bd.workspace_source == ("estimate" if ws is None else "XLA memory analysis")
  if bd.headroom < bd.slack:
    with pytest.raises(JaxvtError) as e:
      M.check(p, facts, cfg, shape, ws)
    assert "\n" not in str(e.value) and "below the" in str(e.value) and "--force" in str(e.value)
  else:
    assert M.check(p, facts, cfg, shape, ws) == bd
  assert M.check(p, facts, cfg, shape, ws, force=True) == bd


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["qwen36_35b", "smollm2_135m"]), st.floats(0.01, 30.0),
       st.integers(0, GiB), st.floats(0, 1.0))
def test_smallest_safe_budget_is_minimal_and_all_larger_fit(name, cap_gb, ws, frac):
  cfg, _, _ = model(name)
  p = base_plan(name)
  facts = M.DeviceFacts(max(1, int(cap_gb * GiB)))
  shape = M.RunShape()
  safe = M.smallest_safe_budget(p, facts, cfg, shape, ws)
  if safe is None:
    assert not M.plan_breakdown(p.rebudget(p.max_useful_budget), facts, cfg, shape, ws).fits
    with pytest.raises(JaxvtError, match="no budget is safe"):
      M.check(p, facts, cfg, shape, ws)
    return
  assert M.plan_breakdown(p.rebudget(safe), facts, cfg, shape, ws).fits
  if safe > 0:
    assert not M.plan_breakdown(p.rebudget(safe - 1), facts, cfg, shape, ws).fits
  bigger = safe + int(frac * (p.max_useful_budget + GiB - safe))
  assert M.plan_breakdown(p.rebudget(bigger), facts, cfg, shape, ws).fits


def test_35b_on_16gib_message():
  cfg, _, _ = model("qwen36_35b")
  p = base_plan("qwen36_35b")
  facts = M.DeviceFacts.from_gb(16, "cuda", "NVIDIA H200")
  shape = M.RunShape()
  safe = M.smallest_safe_budget(p, facts, cfg, shape)
  assert 3.2 * GiB < safe < 3.5 * GiB
  with pytest.raises(JaxvtError) as e:
    M.check(p.rebudget(3 * GiB), facts, cfg, shape)
  assert re.fullmatch(r"offload budget 3 GiB leaves -?\d+\.\d\d GiB device headroom, below the "
                      r"0\.50 GiB slack; the smallest safe budget is 3\.4 GiB \(or pass --force\)",
                      str(e.value)), str(e.value)
  M.check(p.rebudget(int(3.4 * GiB)), facts, cfg, shape)  # the budget the message names is safe


def test_host_memory_check():
  M.host_memory_check(10 * GiB, 13 * GiB, 2 * GiB)
  M.host_memory_check(11 * GiB, 13 * GiB, 2 * GiB)  # exactly the margin left
  with pytest.raises(JaxvtError, match="at most 11.0"):
    M.host_memory_check(11 * GiB + 1, 13 * GiB, 2 * GiB)
  M.host_memory_check(100 * GiB, None)  # unknown: nothing to check
  M.host_memory_check(0, 0)


def test_read_mem_available(tmp_path):
  f = tmp_path / "meminfo"
  f.write_text("MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   24000000 kB\n")
  assert M.read_mem_available(str(f)) == 24000000 * 1024
  f.write_text("MemTotal: 1 kB\n")
  assert M.read_mem_available(str(f)) is None
  assert M.read_mem_available(str(tmp_path / "absent")) is None
