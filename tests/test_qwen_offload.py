"""Qwen3.5-MoE and Qwen3-MoE through the engine with experts in the host tier (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxvt
from jaxvt import ffi
from jaxvt import synth
from jaxvt.model.declare import Role
from jaxvt.qweight import HOST_BIT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")


@pytest.fixture(scope="module", params=["qwen35moe", "qwen3moe"])
def model_file(request, tmp_path_factory):
  arch = request.param
  cfg = synth.tiny_config(arch, d_model=256, expert_ffn_dim=256, shared_ffn_dim=256
                          if arch == "qwen35moe" else 0, n_layers=8 if arch == "qwen35moe" else 4)
  path = str(tmp_path_factory.mktemp(arch) / f"{arch}.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=3)
  return arch, path


def test_greedy_identical_with_experts_in_host_tier(model_file):
  arch, path = model_file
  prompt = [5, 17, 42, 99, 7, 3, 250, 11]
  with jaxvt.load(path, max_context=128) as dev:
    want = dev.generate(prompt, max_tokens=12).tokens
    total = dev.plan.plan.total_bytes
  with jaxvt.load(path, max_context=128, offload_gb=64) as off:
    p = off.plan.plan
    assert p.host_bytes > 0.5 * total
    roles = {role for (role, kind), (n, _) in p.totals().items() if kind == "host" and n}
    assert Role.ROUTED_EXPERTS in roles
    assert not roles & {Role.NORM, Role.ROUTER, Role.SMALL}
    w = off.weights["moe.w_gate"]
    assert all(int(f) & HOST_BIT for f in w.fmts)
    got = off.generate(prompt, max_tokens=12).tokens
  assert got == want
  # a partial budget (some layers' experts only) gives the same tokens too
  with jaxvt.load(path, max_context=128, offload_gb=p.host_bytes / 3 / (1 << 30)) as part:
    assert 0 < part.plan.plan.host_bytes < p.host_bytes
    assert part.generate(prompt, max_tokens=12).tokens == want


def test_plan_accounts_for_deltanet_state_and_attention_kv(model_file):
  """The planner reserves KV cache for attention layers only, and GDN state for DeltaNet ones."""
  from jaxvt.gguf.reader import open_gguf
  from jaxvt.model.config import from_gguf_metadata
  from jaxvt.model.declare import declare
  from jaxvt.offload import placement
  from jaxvt import loader
  arch, path = model_file
  gf = open_gguf(path)
  cfg = from_gguf_metadata(gf.metadata)
  decls = declare(cfg)
  placed = placement.plan_for_engine(cfg, decls, loader.unit_bytes(gf, cfg.arch, decls),
                                     device_gb=4, max_context=128)
  bd = placed.breakdown
  n_attn, n_gdn = len(cfg.attention_layers), len(cfg.deltanet_layers)
  assert bd.kv_cache == n_attn * 128 * cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim) * 4
  conv = 2 * cfg.ssm_k_heads * cfg.ssm_k_dim + cfg.ssm_v_heads * cfg.ssm_v_dim
  state = n_gdn * 4 * ((cfg.ssm_conv_kernel - 1) * conv
                       + cfg.ssm_v_heads * cfg.ssm_k_dim * cfg.ssm_v_dim)
  assert bd.state == state
  assert (state > 0) == (arch == "qwen35moe") and n_attn < cfg.n_layers or arch == "qwen3moe"
  # and it matches what the engine really allocates
  from jaxvt.model.decoder import cache_bytes
  assert cache_bytes(cfg, 1, 128) == bd.kv_cache + bd.state


def test_weightless_plan_of_the_real_size_model():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "jaxvt.run", "--model", "qwen3.6-35b-a3b", "--plan",
                        "--device-gb", "16", "--offload-gb", "auto", "--max-context", "4096"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
  assert out.returncode == 0, out.stderr
  text = out.stdout
  assert "weightless; 40 layers" in text and "18.48 GiB of weights" in text
  assert "routed_experts" in text and "safe offload budgets" in text
  assert "--offload-gb auto:" in text


def test_jax_pinned_host_arm_same_tokens(model_file):
  """The offload benchmark's JAX pinned_host arm (benchmarks.arms: each layer's experts copied
  to the device per use), composed from the public steps, computes the same function."""
  from benchmarks import arms
  from benchmarks.offload import Session
  arch, path = model_file
  prompt = [5, 17, 42, 99]
  s = Session(path, len(prompt), 6, None)
  with arms.no_stops(jaxvt.load(path, max_context=s.max_context)) as dev:
    want = dev.generate(prompt, max_tokens=6).tokens
  arm = s.engine(64.0, host_kind="jax_pinned", pattern=("exps",))
  w = arm.weights["moe.w_up"]
  assert isinstance(w, arms.PinnedQWeight) and w.data.sharding.memory_kind == "pinned_host"
  assert arm.host_tier is None and arm.plan.plan.host_bytes > 0
  assert arm.generate(prompt, max_tokens=6).tokens == want
