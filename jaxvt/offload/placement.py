"""The edge between the pure planner and a run: device facts, rates, the plan and its checks.

`plan_for_engine` turns a model's unit sizes, `--offload-gb` (GiB or "auto"), `--device-gb` and
`--force` into a `Placed` the loader follows; `Placed.plan_text` is `python -m jaxvt.run --plan`.
Everything here reads the device or /proc; the decisions themselves are jaxvt.offload.plan,
.memory and .cost, which are pure.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from jaxvt.errors import JaxvtError
from jaxvt.model.config import ModelConfig
from jaxvt.offload import cost, memory, probe, report
from jaxvt.offload.expert_cache import CachePlan, cache_plan
from jaxvt.offload.plan import DEVICE, GiB, HOST, Plan, Policy, ceil_gib, plan


@dataclasses.dataclass
class Placed:
  """A checked plan and what it was checked against."""
  plan: Plan
  facts: memory.DeviceFacts
  breakdown: memory.Breakdown
  rates: cost.Rates
  prediction: cost.Prediction
  safe_budget: int | None
  reason: str  # how the budget was chosen
  devices: int = 1  # > 1: a mesh; the plan, its budget and its bytes are per device
  cfg: ModelConfig | None = None  # what the plan was checked for (one device's, on a mesh)
  shape: memory.RunShape | None = None
  expert_cache: CachePlan | None = None  # the device expert cache, in breakdown.expert_cache

  def with_expert_cache(self, gb: float | str | None = "auto", policy: str = "lru",
                        force: bool = False, free: int | None = None) -> "Placed":
    """Gives the device expert cache `gb` GiB (None or "auto": what the plan leaves free beyond
    the slack, or `free` bytes where given; 0: no cache) and returns self. The cache holds
    host-tier routed experts, so a plan without any, or on a mesh, gets none (an explicit size
    there is a JaxvtError); on the CPU backend, whose device memory is the host tier's own RAM,
    only an explicit size makes one."""
    self.breakdown = dataclasses.replace(self.breakdown, expert_cache=0)
    self.expert_cache = None
    auto = gb is None or gb == "auto"
    want = 0 if auto else int(float(gb) * GiB)
    if not auto and want < 0:
      raise JaxvtError(f"--expert-cache-gb {gb} must be 0 or more (0: no expert cache)")
    if not auto and want == 0:
      return self
    free = max(0, self.breakdown.free if free is None else min(free, self.breakdown.free))
    if auto and self.facts.host_memory:
      return self
    if self.devices > 1:
      if auto:
        return self
      raise JaxvtError("the expert cache runs on one device; pass --expert-cache-gb 0 with "
                       "--mesh")
    if not auto and want > free and not force:
      raise JaxvtError(f"--expert-cache-gb {float(gb):g} does not fit: {free / GiB:.2f} GiB is "
                       "free beside the plan; lower it or raise --offload-gb")
    cfg = self.cfg
    cp = cache_plan(self.plan, cfg.n_experts if cfg else 0, free if auto else want, policy,
                    cfg.n_experts_used if cfg else 1)
    if cp is None and not auto and self.plan.host_bytes:
      raise JaxvtError(f"--expert-cache-gb {float(gb):g} holds fewer experts a layer than a "
                       "token routes; raise it, or pass 0")
    if cp is not None:
      self.expert_cache = cp
      self.breakdown = dataclasses.replace(self.breakdown, expert_cache=cp.nbytes)
    if self.cfg is not None and self.shape is not None:
      self.prediction = cost.predict(self.plan, self.rates, self.cfg, self.shape, cache=cp)
    return self

  def recheck(self, workspace_bytes: int, force: bool = False) -> None:
    """Checks the plan again with XLA's compiled workspace in place of the estimate (raises
    JaxvtError, naming the smallest safe budget, when the headroom falls under the slack and
    not `force`); the breakdown then says "XLA memory analysis"."""
    bd = memory.check(self.plan, self.facts, self.cfg, self.shape, workspace_bytes, force=force)
    cp = self.expert_cache
    self.breakdown = dataclasses.replace(bd, expert_cache=cp.nbytes if cp else 0)

  def settle(self, workspace_of: Callable[[Plan], int | None], *, auto: bool,
             force: bool = False, tries: int = 4) -> None:
    """Checks the plan with XLA's workspace of its own program in place of the estimate.

    `workspace_of(plan)`: XLA's memory analysis of the largest prefill program `plan`'s
    weights give (engine.xla_workspace_bytes; None where XLA gives none). Which weights live
    where changes the program, so a budget is only known to fit once its own program is
    analysed. With `auto` the budget is chosen again from XLA's figure until the chosen
    budget's own program fits. A refused budget (not `force`) raises JaxvtError naming the
    smallest budget, as a user would pass it, whose own program fits; the breakdown then says
    "XLA memory analysis". Raises JaxvtError when `tries` rounds do not settle."""
    seen: dict[tuple[str, ...], int | None] = {}

    def ws(p: Plan) -> int | None:
      if p.kinds not in seen:
        seen[p.kinds] = workspace_of(p)
      return seen[p.kinds]

    def breakdown(p: Plan, w: int | None) -> memory.Breakdown:
      return memory.plan_breakdown(p, self.facts, self.cfg, self.shape, w)

    w = ws(self.plan)
    if w is None:
      return
    bd = breakdown(self.plan, w)
    if not auto and (bd.fits or force):
      self.breakdown = bd
      return
    for _ in range(tries):
      if auto:  # raises JaxvtError when no budget is safe
        ab = cost.auto_budget(self.plan, self.facts, self.rates, self.cfg, self.shape, w)
        candidate = ab.plan
      else:
        safe = memory.smallest_safe_budget(self.plan, self.facts, self.cfg, self.shape, w)
        if safe is None:
          raise JaxvtError(memory.unsafe_message(self.plan, bd, None))
        shown = ceil_gib(safe)  # the budget the message names, placed as --offload-gb places it
        candidate = self.plan.rebudget(int(round(shown * GiB)))
      w_c = ws(candidate)
      bd_c = breakdown(candidate, w_c)
      if bd_c.fits and not auto:
        raise JaxvtError(memory.unsafe_message(self.plan, bd, shown))
      if bd_c.fits:
        self.plan, self.breakdown, self.prediction = candidate, bd_c, ab.prediction
        self.reason = ab.reason + " (workspace from XLA's memory analysis)"
        self.safe_budget = memory.smallest_safe_budget(candidate, self.facts, self.cfg,
                                                       self.shape, w_c)
        return
      w = w if w_c is None else w_c
    raise JaxvtError(f"the offload budget did not settle in {tries} rounds of XLA's memory "
                     "analysis (each larger budget's program needed more workspace); pass a "
                     "larger --offload-gb, or --force")

  def placement(self, name: str, layer: int | None) -> str:
    return self.plan.placement.get((name, layer), DEVICE)

  @property
  def host_bytes(self) -> int:
    return self.plan.host_bytes

  def report(self) -> str:
    """A few lines for the run log: what went where, and the device-memory headroom."""
    p, bd = self.plan, self.breakdown
    n_host = sum(1 for k in p.kinds if k == HOST)
    each = f" per device ({self.devices} devices)" if self.devices > 1 else ""
    lines = [f"placement: {self.reason}{each}",
             f"  device: {p.device_bytes / GiB:.2f} GiB of weights ({len(p.kinds) - n_host} "
             f"tensors); host tier: {p.host_bytes / GiB:.2f} GiB ({n_host} tensors), "
             f"{p.host_read_bytes / 1e6:.1f} MB read per token"]
    roles = {}
    for (role, kind), (n, b) in p.totals().items():
      if kind == HOST and n:
        roles[role.value] = (n, b)
    if roles:
      lines.append("  in the host tier: " + ", ".join(
          f"{r} {n} ({b / GiB:.2f} GiB)" for r, (n, b) in roles.items()))
    lines.append(f"  device memory: {bd.capacity / GiB:.2f} GiB ({self.facts.source}), "
                 f"headroom {bd.headroom / GiB:.2f} GiB, slack {bd.slack / GiB:.2f} GiB")
    if self.expert_cache is not None:
      lines.append("  " + self.expert_cache.describe())
    return "\n".join(lines)

  def full_report(self) -> str:
    return report.format_plan(self.plan, self.breakdown, self.facts, self.prediction,
                              self.rates, self.safe_budget)

  def plan_text(self, mesh: str | None = None) -> str:
    """`--plan`'s text after its model line: how the budget was chosen, the full report, and
    an UNSAFE line when the headroom is below the slack."""
    each = (f"per device (--mesh {mesh}: {self.devices} devices): the budget, the weights and "
            "the memory below are each device's\n" if self.devices > 1 else "")
    text = f"{self.reason}\n{each}" + self.full_report()
    if self.expert_cache is not None:
      text += self.expert_cache.describe() + "\n"
    bd = self.breakdown
    if bd.headroom < bd.slack:
      text += (f"UNSAFE: headroom {bd.headroom / GiB:.2f} GiB is below the slack; "
               + (f"the smallest safe budget by the workspace estimate is "
                  f"{ceil_gib(self.safe_budget):.1f} GiB\n" if self.safe_budget is not None
                  else "no budget is safe on this device\n"))
    return text


def _facts(device, device_gb: float | None) -> memory.DeviceFacts:
  platform = probe.platform_of(device)
  if device_gb is None and platform == "cpu":
    avail = memory.read_mem_available()
    if avail is None:
      raise JaxvtError("cannot read available memory for the CPU device; pass --device-gb N")
    return memory.DeviceFacts(avail, "cpu", str(device.device_kind), memory.CPU_SOURCE)
  return probe.device_facts(device, device_gb)


def plan_for_engine(cfg: ModelConfig, decls, units, *, offload_gb: float | str = 0.0,
                    device_gb: float | None = None, force: bool = False, device=None,
                    max_context: int = 2048, kernels: bool = True,
                    policy: Policy = Policy(), host_copies=None, devices: int = 1,
                    prefill_chunk: int | None = None,
                    workspace_of: Callable[[Plan], int | None] | None = None,
                    expert_cache_gb: float | str | None = "auto",
                    expert_cache_policy: str = "lru") -> Placed:
  """Plans `units` (jaxvt.model.declare.UnitBytes) for `device`; raises JaxvtError for unsafe
  plans.

  On a mesh (`devices` > 1) `units`, `cfg` and the budgets are one device's (its shards, its
  KV heads; jaxvt.model.sharding): the same plan holds for every device. `host_copies` maps a
  unit to the pinned copies the host needs (one per distinct shard; a replicated weight is one
  buffer every device reads), so the host-RAM check counts the whole host tier.
  `prefill_chunk`: tokens per prefill call (None or more than max_context: max_context), the
  workspace planned for; the engine runs prompts in chunks of the plan's shape.prefill_chunk.

  `workspace_of(plan)` (engine.plan_workspace_bytes; None: the estimate decides): where memory
  is planned tight (weights offloaded, --device-gb, or less free memory than the workspace
  estimate), XLA's analysis of each candidate plan's own program replaces the estimate and
  decides, `auto` included (Placed.settle); the estimate's verdict is then provisional.
  `expert_cache_gb` / `expert_cache_policy`: the device expert cache (Placed.with_expert_cache)."""
  device = device or jax.devices()[0]
  sizes = {(u.name, u.layer): u.nbytes for u in units}
  facts = _facts(device, device_gb)
  rates = probe.load_rates(device)
  shape = memory.RunShape(batch=policy.batch, max_context=max_context,
                          prefill_chunk=min(prefill_chunk or max_context, max_context),
                          kv_elem_bytes=4)
  base = plan(cfg, decls, sizes, 1 << 62, policy)  # re-budgeted below; holds any forced units
  auto = offload_gb == "auto"
  if auto:
    try:
      ab = cost.auto_budget(base, facts, rates, cfg, shape)
      placed, reason = ab.plan, ab.reason
    except JaxvtError:
      if workspace_of is None:
        raise
      # no budget is safe by the estimate: XLA's analysis decides, from everything offloaded
      placed, reason = base.rebudget(base.max_useful_budget), "--offload-gb auto"
  else:
    placed = base.rebudget(int(round(float(offload_gb) * GiB)))
    reason = (f"--offload-gb {float(offload_gb):g}" if offload_gb else
              "nothing offloaded (--offload-gb 0)")

  def need_kernels(p: Plan) -> None:
    if p.host_bytes and not kernels:
      raise JaxvtError("this plan puts weights in the host tier, which needs jaxvt's FFI "
                       f"kernels, but none are built for the {device.platform} backend; "
                       "reinstall jaxvt (pip install .) or pass --offload-gb 0")

  need_kernels(placed)
  est = memory.plan_breakdown(placed, facts, cfg, shape)
  tight = workspace_of is not None and bool(placed.host_bytes or device_gb is not None or
                                            est.free < est.workspace)
  bd = memory.check(placed, facts, cfg, shape, force=force or tight)
  safe = memory.smallest_safe_budget(base, facts, cfg, shape)
  pred = cost.predict(placed, rates, cfg, shape)
  out = Placed(placed, facts, bd, rates, pred, safe, reason, devices, cfg, shape)
  if tight:
    out.settle(workspace_of, auto=auto, force=force)
  need_kernels(out.plan)
  out.with_expert_cache(expert_cache_gb if kernels else 0, expert_cache_policy, force)
  host_total = out.plan.host_bytes if host_copies is None else sum(
      u.nbytes * host_copies.get(u.unit, 1) for u, k in zip(out.plan.units, out.plan.kinds)
      if k == HOST)
  memory.host_memory_check(host_total, memory.read_mem_available())
  return out
