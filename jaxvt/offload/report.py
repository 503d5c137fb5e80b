"""The `--plan` report: placement by role and tier, device memory, predicted speed, safe budgets.

Pure and deterministic: the same plan, facts and rates give the same text byte for byte.
"""

from __future__ import annotations

from jaxvt.model.declare import Role
from jaxvt.offload.cost import Prediction, Rates
from jaxvt.offload.memory import Breakdown, DeviceFacts
from jaxvt.offload.plan import DEVICE, GiB, HOST, Plan, ceil_gib, gib_text


def _gib(n: int) -> str:
  return f"{n / GiB:.2f}"


def placement_table(plan: Plan) -> list[str]:
  totals = plan.totals()
  roles = [r for r in Role if (r, DEVICE) in totals]
  lines = [f"{'role':<16}{'device':>8}{'GiB':>8}{'host':>8}{'GiB':>8}"]
  for r in roles:
    (dn, db), (hn, hb) = totals[(r, DEVICE)], totals[(r, HOST)]
    lines.append(f"{r.value:<16}{dn:>8}{_gib(db):>8}{hn:>8}{_gib(hb):>8}")
  dn = sum(totals[(r, DEVICE)][0] for r in roles)
  hn = sum(totals[(r, HOST)][0] for r in roles)
  lines.append(f"{'total':<16}{dn:>8}{_gib(plan.device_bytes):>8}{hn:>8}"
               f"{_gib(plan.host_bytes):>8}")
  return lines


def memory_lines(bd: Breakdown, facts: DeviceFacts) -> list[str]:
  rows = [("weights", bd.weights, ""), ("KV cache", bd.kv_cache, ""),
          ("DeltaNet state", bd.state, ""), ("workspace", bd.workspace, f"({bd.workspace_source})"),
          *([("expert cache", bd.expert_cache, "")] if bd.expert_cache else []),
          ("slack", bd.slack, ""), ("free", bd.free, "" if bd.fits else "(SHORT: below slack)")]
  out = [f"device memory: {_gib(bd.capacity)} GiB ({facts.source})"]
  for name, n, note in rows:
    out.append(f"  {name:<16}{_gib(n):>8} GiB {note}".rstrip())
  return out


def format_plan(plan: Plan, bd: Breakdown, facts: DeviceFacts, pred: Prediction, rates: Rates,
                safe_budget: int | None) -> str:
  """The whole `--plan` text, ending in a newline."""
  lines = [f"offload plan: budget {gib_text(plan.budget_bytes)} GiB, batch {plan.policy.batch}, "
           f"{len(plan.units)} tensors, {_gib(plan.total_bytes)} GiB of weights"]
  if plan.policy.overrides:
    pats = ", ".join(f"{o.pattern}={o.kind}" for o in plan.policy.overrides)
    lines.append(f"overrides ({_gib(plan.forced_host_bytes)} GiB forced to host): {pats}")
  lines += placement_table(plan)
  lines.append("")
  lines += memory_lines(bd, facts)
  lines.append("")
  lines.append(f"predicted {pred.tokens_per_s:.1f} tok/s at context {pred.context_pos}: "
               f"{pred.ms_per_step:.2f} ms/step = device {pred.device_ms:.2f} "
               f"({pred.device_read_bytes / 1e9:.3f} GB) + host {pred.host_ms:.2f} "
               f"({pred.host_read_bytes / 1e9:.3f} GB) + fixed {pred.fixed_ms:.2f} "
               f"({pred.kernel_calls} calls)")
  lines.append(f"rates behind the prediction: device {rates.device_read_gbps:g} GB/s, host tier "
               f"{rates.host_read_gbps:g} GB/s, launch {rates.launch_us:g} us; {rates.source}")
  if safe_budget is None:
    lines.append("safe offload budgets: none (the device is short even with everything "
                 "offloadable in the host tier)")
  else:
    lines.append(f"safe offload budgets: {ceil_gib(safe_budget):.1f} to "
                 f"{ceil_gib(plan.max_useful_budget):.1f} GiB (more moves nothing)")
  if bd.workspace_source == "estimate":
    lines.append("(with the workspace estimated: a run replaces the estimate by XLA's analysis "
                 "of the compiled program where memory is tight, and may choose or name "
                 "another budget)")
  return "\n".join(lines) + "\n"
