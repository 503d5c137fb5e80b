"""python -m benchmarks.turns on CPU: the measurements end to end on a tiny MoE file (its arms
and the expert cache's counters against the routed slots counted here), and the parent's flow
with a faked child (the options it passes parse, the section and its goal verdicts)."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

import jaxvt
from benchmarks import turns
from jaxvt import ffi
from jaxvt.ffi.tuning import Products

needs_ext = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
  from jaxvt import synth
  cfg = synth.tiny_config("qwen35moe", d_model=256, expert_ffn_dim=256, shared_ffn_dim=256,
                          n_layers=4, n_experts=32, n_experts_used=2)
  path = str(tmp_path_factory.mktemp("turns") / "qwen35moe.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=5)
  return path


@needs_ext
def test_the_arms_on_a_tiny_file(moe_file):
  """Under a GPU-like rule (short calls routed, longer ones streamed through rings), the routed
  arm's 3-token turn counts its tokens' routed slots in every cached layer and the streamed
  arm's none; each batch step counts its rows' slots, and fills no more than it misses."""
  with jaxvt.load(moe_file, max_context=64, offload_gb=64, expert_cache_gb=0.05) as eng:
    cfg, n = eng.cfg, len(eng.plan.expert_cache.layers)
    rule = Products(prefetch_per_expert=1, routed_per_expert=16 * cfg.n_experts_used
                    / cfg.n_experts)
    eng = dataclasses.replace(eng, ex=dataclasses.replace(eng.ex, products=rule))
    out = turns.measure(eng, conversation=12, turn=3, rows=3, steps=4, prompt=5, repeats=1)
    k = cfg.n_experts_used
    routed, streamed = out["turn"]["routed"][0], out["turn"]["streamed"][0]
    assert routed["turn_hits"] + routed["turn_misses"] == 3 * k * n
    assert streamed["turn_hits"] + streamed["turn_misses"] == 0
    for b in (1, 3):
      r = out["batch"][b][0]
      assert r["steps"] == 4 and r["hits"] + r["misses"] == b * k * n * 4
      assert r["fills"] <= r["misses"] and r["fill_bytes"] <= r["miss_bytes"]
    s = turns.summary(out, 3)
    assert s["routed"]["ratio"] == pytest.approx(routed["turn_s"] / routed["fresh_s"])
    assert s["rows_ratio"] == pytest.approx(s["rows_3"]["tok_s"] / s["rows_1"]["tok_s"])


def test_the_parent_runs_the_child_and_writes_the_section(monkeypatch):
  seen = {}
  summary = {"routed": dict(turn_s=0.02, fresh_s=0.4, ratio=0.05, hits=30, misses=10, fills=6,
                            fill_bytes=6e6),
             "streamed": dict(turn_s=0.2, fresh_s=0.4, ratio=0.5),
             "rows_1": dict(tok_s=100.0, misses=2, fills=2, miss_bytes=2e6, fill_bytes=2e6),
             "rows_8": dict(tok_s=250.0, misses=16, fills=9, miss_bytes=16e6, fill_bytes=9e6),
             "rows_ratio": 2.5}

  def fake_run(cmd, env, **_):
    seen["cmd"], seen["env"] = cmd, env
    res = dict(summary=summary, machine="test", routed_per_expert=14.8, cache="expert cache: x")
    return types.SimpleNamespace(returncode=0, stdout="noise\nRESULT " + json.dumps(res) + "\n")

  monkeypatch.setattr(turns, "pool_fraction", lambda gb: "0.115")
  monkeypatch.setattr(turns.subprocess, "run", fake_run)
  args = turns.parser().parse_args(["--model", "/nonexistent.gguf", "--budget", "5",
                                    "--repeats", "2"])
  text = turns.main(args)
  child = turns.parser().parse_args(seen["cmd"][3:])
  assert child.child == 1 and child.model == "/nonexistent.gguf" and child.budget == "5"
  assert child.repeats == 2 and not child.write
  assert seen["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.115"
  assert "| routed | 0.020 | 0.400 | 0.050 |" in text
  assert "next turn <= 0.25x a fresh prompt (routed): 0.050, met" in text
  assert "8 rows >= 3.0x one row: 2.500, missed" in text
