"""The host tier end to end on CPU: same tokens on both tiers, auto budgets, forced offload."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import jaxvt
from jaxvt import ffi
from jaxvt.qweight import HOST_BIT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "reference", "plan_default_model.txt")
pytestmark = pytest.mark.skipif(not ffi.available("cpu"),
                                reason="the jaxvt extension is not built (pip install -e .)")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]


def _host_layers(eng) -> int:
  return sum(len(w.meta.host_layers) for w in eng.weights.values() if hasattr(w, "meta"))


def test_greedy_tokens_identical_across_tiers():
  """Nothing offloaded vs every offloadable weight in the host tier: byte-identical tokens."""
  with jaxvt.load(max_context=256) as dev:
    assert _host_layers(dev) == 0
    base = [dev.generate(p, max_tokens=24).tokens for p in PROMPTS]
  with jaxvt.load(max_context=256, offload_gb=64) as off:
    n_host = _host_layers(off)
    plan = off.plan.plan
    assert plan.host_bytes > 0.6 * plan.total_bytes  # all but norms and the tied head
    assert n_host > 200
    # the weights really live in the host tier: their table entries are host addresses
    w = off.weights["ffn.w_down"]
    assert all(int(f) & HOST_BIT for f in w.fmts)
    assert w.data.size == 1
    got = [off.generate(p, max_tokens=24).tokens for p in PROMPTS]
  assert got == base


def test_partial_offload_same_tokens():
  with jaxvt.load(max_context=256, offload_gb=0.02) as part:
    assert 0 < part.plan.plan.host_bytes <= 0.02 * (1 << 30)
    got = part.generate(PROMPTS[0], max_tokens=16).tokens
  with jaxvt.load(max_context=256) as dev:
    assert got == dev.generate(PROMPTS[0], max_tokens=16).tokens


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jaxvt.run", *args], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=600)


# On a 0.66 GiB device the default model (2048 tokens of context) must offload: XLA's analysis of
# the prefill (~0.04 GiB) fits only once weights leave; the analytic estimate (0.18 GiB) would
# call every budget unsafe, so these runs also show XLA's figure deciding.
SMALL_GB = "0.66"


def test_cli_auto_with_small_device_forces_offload():
  p = _cli("--nochat", "--prompt", "The capital of France is", "--max-tokens", "8", "--device-gb",
           SMALL_GB, "--offload-gb", "auto")
  assert p.returncode == 0, p.stderr
  assert "--offload-gb auto" in p.stderr
  m = re.search(r"host tier: ([0-9.]+) GiB \((\d+) tensors\)", p.stderr)
  assert m and float(m.group(1)) > 0 and int(m.group(2)) > 0, p.stderr
  assert "Paris" in p.stdout


def test_cli_unsafe_budget_refused_then_forced():
  p = _cli("--max-tokens", "4", "--device-gb", SMALL_GB, "--offload-gb", "0")
  assert p.returncode == 2 and "smallest safe budget" in p.stderr, p.stderr
  assert "Traceback" not in p.stderr
  safe = re.search(r"the smallest safe budget is ([0-9.]+) GiB", p.stderr).group(1)
  p = _cli("--prompt", "Hi", "--max-tokens", "4", "--device-gb", SMALL_GB, "--offload-gb", "0",
           "--force")
  assert p.returncode == 0, p.stderr
  p = _cli("--prompt", "Hi", "--max-tokens", "4", "--device-gb", SMALL_GB, "--offload-gb", safe)
  assert p.returncode == 0, p.stderr  # the budget the message named runs


def test_plan_golden():
  """`--plan` for the default model on a fixed 0.78 GiB device is pinned (regenerate by
  running the command below and saving its stdout to tests/reference/plan_default_model.txt)."""
  p = _cli("--plan", "--device-gb", "0.78", "--offload-gb", "auto", "--max-context", "2048")
  assert p.returncode == 0, p.stderr
  text = re.sub(r"^model: .*\n", "", p.stdout)
  if os.environ.get("JAXVT_REGEN_GOLDEN"):
    with open(GOLDEN, "w") as f:
      f.write(text)
  with open(GOLDEN) as f:
    assert text == f.read()


def test_workspace_from_xla_memory_analysis():
  """With weights offloaded the plan is checked again with XLA's analysis of the compiled
  prefill; a workspace that leaves less than the slack is refused naming the smallest safe
  budget, and --force lets it run."""
  from jaxvt.engine import xla_workspace_bytes
  from jaxvt.errors import JaxvtError
  with jaxvt.load(max_context=512, offload_gb=0.05, device_gb=0.78) as eng:
    placed = eng.plan
    assert eng.memory.workspace_source == "XLA memory analysis"
    ws = xla_workspace_bytes(eng)
    assert eng.memory.workspace == ws > 0
    bd = eng.memory
    assert bd.weights + bd.kv_cache + bd.state + bd.workspace + bd.slack + bd.free == bd.capacity
    too_big = bd.headroom - bd.slack + bd.workspace + 1  # one byte over the slack
    with pytest.raises(JaxvtError, match="smallest safe"):
      placed.recheck(too_big)
    placed.recheck(too_big, force=True)
    assert placed.breakdown.workspace == too_big and not placed.breakdown.fits
