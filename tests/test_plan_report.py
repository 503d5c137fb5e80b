"""The --plan report: deterministic text with the table, breakdown, speed and budget range."""

from jaxvt.offload import cost as C
from jaxvt.offload import memory as M
from jaxvt.offload import plan as P
from jaxvt.offload import report as R
from jaxvt.offload.plan import GiB
from test_plan_fixtures import model


def render(budget_gib, device_gib=16.0, overrides=()):
  cfg, decls, sizes = model("qwen36_35b")
  p = P.plan(cfg, decls, sizes, int(budget_gib * GiB), P.Policy(overrides=overrides))
  facts = M.DeviceFacts.from_gb(device_gib, "cuda", "NVIDIA H200")
  shape = M.RunShape()
  rates = C.default_rates("cuda")
  bd = M.plan_breakdown(p, facts, cfg, shape)
  safe = M.smallest_safe_budget(p, facts, cfg, shape)
  return p, bd, R.format_plan(p, bd, facts, C.predict(p, rates, cfg, shape), rates, safe)


def test_report_is_deterministic_and_complete():
  p, bd, text = render(6.0)
  assert text == render(6.0)[2]
  lines = text.splitlines()
  assert lines[0] == "offload plan: budget 6 GiB, batch 1, 733 tensors, 18.48 GiB of weights"
  assert lines[1].split() == ["role", "device", "GiB", "host", "GiB"]
  assert "routed_experts        80   11.25      40    5.62" in lines
  total = next(l for l in lines if l.startswith("total"))
  assert total.split() == ["total", "692", f"{p.device_bytes / GiB:.2f}", "41",
                           f"{p.host_bytes / GiB:.2f}"]
  assert "device memory: 16.00 GiB (--device-gb 16)" in lines
  assert "  workspace           0.17 GiB (estimate)" in lines
  assert "  slack               0.50 GiB" in lines
  assert any(l.startswith("predicted ") and "tok/s at context 2048" in l for l in lines)
  assert lines[-2] == "safe offload budgets: 3.4 to 18.5 GiB (more moves nothing)"
  assert lines[-1].startswith("(with the workspace estimated")  # a run asks XLA
  assert "(with the workspace estimated" not in R.format_plan(
      p, M.plan_breakdown(p, M.DeviceFacts.from_gb(16.0), model("qwen36_35b")[0], M.RunShape(),
                          workspace_bytes=GiB), M.DeviceFacts.from_gb(16.0),
      C.predict(p, C.default_rates("cuda"), model("qwen36_35b")[0]), C.default_rates("cuda"), None)
  assert text.endswith("\n")


def test_report_marks_a_short_plan_and_overrides():
  _, bd, text = render(2.0, overrides=P.parse_overrides(["token_embd"]))
  assert not bd.fits
  assert "(SHORT: below slack)" in text
  assert "overrides (0.27 GiB forced to host): token_embd=host" in text
  _, _, none = render(2.0, device_gib=0.6)
  last = none.splitlines()
  assert last[-2].startswith("safe offload budgets: none")
  assert last[-1].startswith("(with the workspace estimated: a run replaces the estimate")
