"""Cost model: predicted milliseconds per decode step for a plan, and `--offload-gb auto`.

  ms/step = device bytes read / device read rate            (resident weights, KV cache, state)
          + host bytes read / host tier's GEMV read rate     (host-tier weights, read in place)
          + matrix kernel calls x launch_us                  (a matvec's fixed cost)
          + layers x XLA_OPS_PER_LAYER x op_us               (norms, RoPE, routing, recurrences)
          + step_ms                                          (the host's part of a token)

The host rate is the rate our matrix kernels reach reading weights from the host tier, never the
streaming or DMA number: a streaming read of host memory can run ~3x faster than a matrix product
reading it (docs/BENCHMARKS.md, "Measurements behind the defaults"), and a budget sized from it
would be that much too optimistic. Rates come from the probe's cache
(jaxvt.offload.probe.load_rates) or the platform defaults below, and say which in `source`.
"""

from __future__ import annotations

import dataclasses
import math

from jaxvt.errors import JaxvtError
from jaxvt.ffi import tuning
from jaxvt.model.config import ModelConfig
from jaxvt.model.declare import Role
from jaxvt.offload import memory
from jaxvt.offload.plan import GiB, HOST, Plan, ceil_gib, gib_text

# Device work per layer that is not a weight read: XLA's kernels after fusion (norms, RoPE,
# attention core or the DeltaNet recurrence, routing's sort and softmax, residual adds), counted
# with `python -m benchmarks.profile` in a Qwen3.6-35B-A3B-shaped decode step (the XLA kernels
# besides jaxvt's matrix calls, per layer).
XLA_OPS_PER_LAYER = 25
# `auto_budget` takes a budget above the smallest safe one only for at least this predicted gain.
AUTO_MIN_GAIN = 0.01


@dataclasses.dataclass(frozen=True)
class Rates:
  """Read rates (GB/s, 1e9 bytes) and fixed costs of one device."""
  platform: str
  device_read_gbps: float  # our matrix kernels reading quantized weights from device memory
  host_read_gbps: float  # the same kernels reading the host tier in place (GEMV rate)
  launch_us: float  # fixed cost of one matrix kernel call (the probe's small-call time)
  dma_h2d_gbps: float | None = None  # informational: pinned host -> device copy
  zero_copy_gbps: float | None = None  # informational: streaming read of host memory
  managed_migrates: bool | None = None  # None: not measured; placement never relies on it
  source: str = ""
  op_us: float = 1.65  # one of XLA's small fused kernels (the same profile, on average)
  step_ms: float = 0.0  # host work per generated token not overlapped with the device

  def __post_init__(self):
    if not (self.device_read_gbps > 0 and self.host_read_gbps > 0 and self.launch_us >= 0):
      raise JaxvtError(f"rates must be positive (device {self.device_read_gbps}, host "
                       f"{self.host_read_gbps} GB/s); re-run python -m jaxvt.offload.probe")


# Platform defaults, used until the probe has measured the device (and said so in `source`).
# Where each number was measured: docs/BENCHMARKS.md, "Measurements behind the defaults".
DEFAULT_RATES: dict[str, Rates] = {
    # An H200, fitted to decode of the Qwen3.6-35B-A3B-shaped file at four budgets (all in HBM,
    # auto, 7 GiB, every routed expert in the host tier: tests/reference/decode_rates.json):
    # weights read from HBM at 2 TB/s, the host tier's routed experts at 50 GB/s (the link), and
    # a step's fixed cost of 2.8 ms (decode runs 16 steps a program, in XLA's command buffers: a
    # matrix call 2 us, one of XLA's small kernels 1 us, 0.9 ms the rest). DMA and streaming
    # reads are informational; managed memory migrates.
    "cuda": Rates("cuda", 2000.0, 50.0, 2.0, 54.9, 50.6, True,
                  "default for cuda: an H200's figures, not this device", op_us=1.0,
                  step_ms=0.9),
    # An RX 9060 XT (gfx1200): a GEMM from host memory, the streaming read, GDDR6 at ~80%.
    "rocm": Rates("rocm", 250.0, 8.0, 8.0, None, 23.0, False,
                  "default for rocm: an RX 9060 XT's figures, not this device"),
    # CPU: both tiers are host DRAM; fitted to decode on a 2-core x86-64 machine (the default
    # model and a small MoE file: tests/reference/decode_rates.json).
    "cpu": Rates("cpu", 9.0, 9.0, 1.0, None, None, None,
                 "default for cpu: a 2-core machine's figures, both tiers in host DRAM",
                 op_us=0.12, step_ms=0.8),
}


def default_rates(platform: str) -> Rates:
  key = {"gpu": "cuda"}.get(platform.lower(), platform.lower())
  if key not in DEFAULT_RATES:
    raise JaxvtError(f"no default rates for platform '{platform}'; run python -m "
                     "jaxvt.offload.probe on it")
  return DEFAULT_RATES[key]


# Short calls through the expert cache (Products.routed_per_expert). A call of S routed slots
# over a layer of E experts of B bytes each, with a cache hitting a share h of them:
#   streamed (the grouped kernel, or the layer copied whole): each distinct expert the call
#     routes to crosses the bus once:   D(S) B / host,   D(S) = E (1 - (1 - 1/E)^S) ~ E (1 - e^-r)
#   routed (the per-slot kernels through the cache): the distinct experts it misses cross the bus
#     once, and every slot reads its expert from device memory:   (1 - h) D(S) B / host + S B / dev
# routed <= streamed  <=>  h D(S) / host >= S / dev  <=>  (1 - e^-r) / r >= host / (h dev),
# r = S / E: B cancels, and E to the exponential's approximation, so the crossover is a number of
# routed slots per expert that holds for any model. The hit rate it is computed for: the least a
# cache of the smallest share a plan gives one hits on real routing (an LRU of 6% of a layer's
# experts hit 37% on traces of Qwen3-30B-A3B; larger caches hit more, 74-96%), so the routed
# path is chosen only where it wins on real routing at any cache size.
ROUTED_HIT_RATE = 0.37


def routed_crossover(rates: Rates, hit_rate: float = ROUTED_HIT_RATE) -> float:
  """Routed slots per expert (T k / E) up to which a call reads its routed experts through the
  expert cache, per slot, for less than streaming each distinct one (the formula above, solved
  for r by bisection); 0 where the routed path never wins (the host tier no slower than the
  device, as on the CPU, or no hits)."""
  if not 0 < hit_rate <= 1:
    raise ValueError(f"hit rate {hit_rate} is not in (0, 1]")
  c = rates.host_read_gbps / (hit_rate * rates.device_read_gbps)
  if c >= 1:
    return 0.0
  f = lambda r: -math.expm1(-r) / r
  lo, hi = 1e-9, 1.0
  while f(hi) > c:
    hi *= 2
  for _ in range(100):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if f(mid) > c else (lo, mid)
  return lo


def products_for(platform: str, batch_invariant: bool = False) -> tuning.Products:
  """The platform's tuning row (jaxvt.ffi.tuning.products_for; `batch_invariant`: its row in
  which a row's arithmetic never depends on the other rows of its program) with its short-call
  crossover (Products.routed_per_expert) from the platform's default rates: the measured
  figures, fixed per platform so the kernels a call takes (and so its bits) do not depend on
  this machine's probe."""
  row = tuning.products_for(platform, batch_invariant)
  key = {"gpu": "cuda"}.get(platform.lower(), platform.lower())
  if key not in DEFAULT_RATES:
    return row
  return dataclasses.replace(row, routed_per_expert=routed_crossover(DEFAULT_RATES[key]))


def routed_tokens(products: tuning.Products, cfg: ModelConfig) -> int:
  """The most tokens a call of `cfg`'s model reads through the expert cache under `products`
  (0: none, or not a MoE model)."""
  if not cfg.is_moe:
    return 0
  k = cfg.n_experts_used
  return max((t for t in range(1, tuning.ROUTED_SLOTS_MAX // k + 1)
              if products.routed(t * k, cfg.n_experts)), default=0)


@dataclasses.dataclass(frozen=True)
class Prediction:
  batch: int
  context_pos: int
  device_read_bytes: int  # weights + KV cache + recurrent state, per step
  host_read_bytes: int
  kernel_calls: int
  device_ms: float
  host_ms: float
  fixed_ms: float

  @property
  def ms_per_step(self) -> float:
    return self.device_ms + self.host_ms + self.fixed_ms

  @property
  def tokens_per_s(self) -> float:
    return 1000.0 * self.batch / self.ms_per_step


def kernel_calls(plan: Plan, cfg: ModelConfig) -> int:
  """Matrix kernel calls per decode step: one per matrix unit (routed gate, up and down are a
  call each)."""
  return sum(1 for u in plan.units if u.role not in (Role.NORM, Role.SMALL))


def state_read_bytes(cfg: ModelConfig, shape: memory.RunShape, context_pos: int) -> int:
  """KV cache read at position `context_pos` plus DeltaNet state read and written, per step."""
  kv = (len(cfg.attention_layers) * cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim) *
        context_pos * shape.batch * shape.kv_elem_bytes)
  return kv + 2 * memory.recurrent_state_bytes(cfg, shape)


def predict(plan: Plan, rates: Rates, cfg: ModelConfig, shape: memory.RunShape = memory.RunShape(),
            context_pos: int | None = None, cache=None) -> Prediction:
  """Predicted decode-step time; `context_pos` defaults to half the context (a full run's mean).
  `cache` (expert_cache.CachePlan): the routed experts of its layers are read from the device
  at least as often as it holds them (slots / experts: uniform routing; routing that reuses
  experts hits more), and that share of their host reads becomes device reads."""
  pos = shape.max_context // 2 if context_pos is None else context_pos
  dev = plan.device_read_bytes + state_read_bytes(cfg, shape, pos)
  host = plan.host_read_bytes
  if cache is not None:
    share = cache.slots / cache.experts
    hits = round(share * sum(u.read_bytes for u, k in zip(plan.units, plan.kinds)
                             if k == HOST and u.role is Role.ROUTED_EXPERTS
                             and u.layer in cache.layers))
    dev, host = dev + hits, host - hits
  calls = kernel_calls(plan, cfg)
  fixed = (calls * rates.launch_us + cfg.n_layers * XLA_OPS_PER_LAYER * rates.op_us +
           rates.step_ms * 1000.0)
  return Prediction(plan.policy.batch, pos, dev, host, calls,
                    dev / rates.device_read_gbps / 1e6, host / rates.host_read_gbps / 1e6,
                    fixed / 1000.0)


@dataclasses.dataclass(frozen=True)
class AutoBudget:
  budget_bytes: int
  plan: Plan
  prediction: Prediction
  reason: str  # one line for the CLI


def auto_budget(plan: Plan, facts: memory.DeviceFacts, rates: Rates, cfg: ModelConfig,
                shape: memory.RunShape = memory.RunShape(), workspace_bytes: int | None = None,
                context_pos: int | None = None) -> AutoBudget:
  """`--offload-gb auto`: among the safe budgets, the one predicted fastest.

  Candidates are the budgets where the plan changes (`plan.steps()`) from the smallest safe one
  up. A larger budget wins only if predicted at least AUTO_MIN_GAIN faster than every smaller
  one (the model is not that precise; equal rates, as on CPU, tie). More budget only adds host
  reads, so while the host tier is slower than the device this is the smallest safe budget, and
  0 when the model fits: offload left on for a model that fits is the loss users report most
  (vLLM, 19x; ANCHORS.md).
  """
  safe = memory.smallest_safe_budget(plan, facts, cfg, shape, workspace_bytes)
  if safe is None:
    memory.check(plan.rebudget(plan.max_useful_budget), facts, cfg, shape, workspace_bytes)
    raise AssertionError("unreachable: check raises when no budget is safe")
  first = plan.rebudget(safe)
  pred = predict(first, rates, cfg, shape, context_pos)
  steps = plan.steps()
  k = steps.index(safe)  # units of the order in the host tier at the smallest safe budget
  best, best_ms = safe, pred.ms_per_step
  dev, host = pred.device_read_bytes, pred.host_read_bytes
  for i in range(k, len(plan.order)):
    r = plan.units[plan.order[i]].read_bytes
    dev, host = dev - r, host + r
    ms = dev / rates.device_read_gbps / 1e6 + host / rates.host_read_gbps / 1e6 + pred.fixed_ms
    if ms < best_ms * (1 - AUTO_MIN_GAIN):
      best, best_ms = steps[i + 1], ms
  if best != safe:
    first = plan.rebudget(best)
    pred = predict(first, rates, cfg, shape, context_pos)
  slack = (f"the {facts.slack / GiB:.2f} GiB slack on this {gib_text(facts.capacity_bytes)} GiB "
           "device")
  if not any(kind == HOST for kind in first.kinds):
    why = f"the model fits with {slack}; nothing offloaded"
  elif best == safe:
    why = f"the smallest budget that keeps {slack}"
  else:
    why = f"predicted fastest on these rates (the smallest safe, {ceil_gib(safe):.1f} GiB, is slower)"
  reason = (f"--offload-gb auto: {ceil_gib(best):.1f} GiB, {why}; predicted "
            f"{pred.tokens_per_s:.1f} tok/s (an estimate from rates {rates.source.split(':')[0]})")
  return AutoBudget(best, first, pred, reason)
