"""Device-memory planner: what the device must hold besides weights, and the cliff guard.

Device memory splits into resident weights (the plan's device-tier units), the KV cache of the
attention layers, the recurrent state of the Gated-DeltaNet layers, the compiled program's
workspace (XLA temporaries), allocator slack, and what is left free. A plan is safe when the
headroom (capacity minus weights, KV/state and workspace) is at least the slack; `check` refuses
any other plan unless forced.

Slack default: max(0.5 GiB, 3% of capacity). The allocator needs memory beyond XLA's analysis of
a program for fragmentation: 0.2-0.45 GiB for a 0.75 GiB program in a 16 GiB pool (docs/
BENCHMARKS.md, "Measurements behind the defaults"); 0.5 GiB covers the upper end. Fragmentation
grows with the pool and its buffers, so large devices keep 3% (on 16 GiB the two agree, 0.48 vs
0.5). llama.cpp's `--fit` keeps a flat 1 GiB per device. Short of it, a GPU may fail with
RESOURCE_EXHAUSTED or, on ROCm, run several times slower instead of failing.

Pure functions; the only side-effecting edge is `read_mem_available` (reads /proc/meminfo).
Device facts from a live JAX device come from jaxvt.offload.probe.device_facts.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jaxvt.errors import JaxvtError
from jaxvt.model.config import ModelConfig
from jaxvt.offload.plan import GiB, Plan, ceil_gib, gib_text

SLACK_MIN_BYTES = GiB // 2
CPU_SOURCE = "MemAvailable (CPU)"  # DeviceFacts.source of the CPU backend without --device-gb
SLACK_FRACTION = 0.03
# Host RAM to leave free after pinning the host tier: the Python process, the JAX runtime and the
# loader's upload buffers. Pinned pages cannot be swapped or reclaimed, so running out invokes the OOM
# killer; the page cache of the memory-mapped GGUF is reclaimable and is part of MemAvailable.
HOST_MARGIN_BYTES = 2 * GiB


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  """What the planner needs to know about the device."""
  capacity_bytes: int  # memory XLA may allocate on the device (its pool: bytes_limit)
  platform: str = "cpu"  # "cpu" | "cuda" | "rocm"
  device_kind: str = ""
  source: str = "given"  # where capacity_bytes came from, for the report
  slack_bytes: int | None = None  # None: max(0.5 GiB, 3% of capacity)

  def __post_init__(self):
    if self.capacity_bytes <= 0:
      raise JaxvtError(f"device capacity {self.capacity_bytes / GiB:.2f} GiB must be positive; "
                       "pass --device-gb N")

  @property
  def host_memory(self) -> bool:
    """Whether this "device" is the host's own memory (the CPU backend, sized from
    MemAvailable): a second copy of host-tier weights there gains nothing."""
    return self.platform == "cpu" and self.source == CPU_SOURCE

  @property
  def slack(self) -> int:
    if self.slack_bytes is not None:
      return self.slack_bytes
    return max(SLACK_MIN_BYTES, int(SLACK_FRACTION * self.capacity_bytes))

  @classmethod
  def from_gb(cls, gb: float, platform: str = "cpu", device_kind: str = "") -> "DeviceFacts":
    """From `--device-gb N` (GiB)."""
    if not gb > 0:
      raise JaxvtError(f"--device-gb {gb} must be positive")
    return cls(int(gb * GiB), platform, device_kind, f"--device-gb {gb:g}")

  @classmethod
  def from_memory_stats(cls, stats: Mapping[str, int] | None, platform: str, device_kind: str,
                        device_gb: float | None = None) -> "DeviceFacts":
    """From `device.memory_stats()`; `device_gb` (--device-gb) wins and is needed without stats."""
    if device_gb is not None:
      return cls.from_gb(device_gb, platform, device_kind)
    if not stats or "bytes_limit" not in stats:
      raise JaxvtError(f"the {platform} device reports no memory limit; pass --device-gb N")
    return cls(int(stats["bytes_limit"]), platform, device_kind, "bytes_limit of the device")


@dataclasses.dataclass(frozen=True)
class RunShape:
  """What a run keeps beside the weights."""
  batch: int = 1  # sequences
  max_context: int = 4096  # tokens of KV cache per sequence
  prefill_chunk: int = 512  # tokens per sequence in one prefill call
  kv_elem_bytes: int = 2  # bf16 KV cache
  state_elem_bytes: int = 4  # fp32 DeltaNet conv and recurrent state
  act_elem_bytes: int = 4  # fp32 activations

  def __post_init__(self):
    if min(self.batch, self.max_context, self.prefill_chunk) < 1:
      raise JaxvtError("batch, context and prefill chunk must each be at least 1")


def kv_cache_bytes(cfg: ModelConfig, shape: RunShape) -> int:
  """K and V for every attention layer: n_kv * (head_dim + v_head_dim) * context * batch."""
  per_layer = cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim) * shape.max_context * shape.batch
  return len(cfg.attention_layers) * per_layer * shape.kv_elem_bytes


def recurrent_state_bytes(cfg: ModelConfig, shape: RunShape) -> int:
  """Per DeltaNet layer and sequence: conv state (kernel-1) x conv_dim, recurrent n_v x dk x dv."""
  if not cfg.deltanet_layers:
    return 0
  conv = (cfg.ssm_conv_kernel - 1) * cfg.conv_dim
  rec = cfg.ssm_v_heads * cfg.ssm_k_dim * cfg.ssm_v_dim
  return len(cfg.deltanet_layers) * (conv + rec) * shape.batch * shape.state_elem_bytes


def estimate_workspace_bytes(cfg: ModelConfig, shape: RunShape) -> int:
  """An analytic bound on the prefill program's temporaries, for planning before compiling.

  T = batch * prefill_chunk tokens. Logits at each row's last position only (jaxvt's prefill
  returns no others: batch * vocab); the residual stream
  and its normed copies (6 * T * d); and the largest layer body's temporaries, reused across the
  scan: attention (q/k/v, gate, output and the T x context score matrix per head), DeltaNet
  (projections, per-64-token-chunk states), FFN (gate/up products; the MoE router logits and the
  k routed experts' intermediates). `jaxvt.load` replaces it with XLA's memory analysis of the
  compiled prefill (engine.xla_workspace_bytes) where the plan offloads or --device-gb is given.
  """
  a = shape.act_elem_bytes
  b, t_seq = shape.batch, shape.prefill_chunk
  t = b * t_seq
  d = cfg.d_model
  logits = b * cfg.vocab_size * a
  stream = 6 * t * d * a
  bodies = [0]
  if cfg.attention_layers:
    proj = t * (cfg.q_rows + cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim) + cfg.n_heads *
                cfg.v_head_dim)
    scores = b * cfg.n_heads * t_seq * shape.max_context
    bodies.append((proj + scores) * a)
  if cfg.deltanet_layers:
    nv, dk, dv = cfg.ssm_v_heads, cfg.ssm_k_dim, cfg.ssm_v_dim
    proj = t * (2 * cfg.conv_dim + 2 * cfg.ssm_inner_dim + 2 * nv)
    chunks = -(-t_seq // 64)
    states = b * chunks * nv * dk * dv + b * nv * t_seq * 64
    bodies.append((proj + states) * a)
  if cfg.is_moe:
    ffn = t * (cfg.n_experts + cfg.n_experts_used * (3 * cfg.expert_ffn_dim + d) +
               3 * cfg.shared_ffn_dim)
  else:
    ffn = t * 3 * cfg.ffn_dim
  bodies.append(ffn * a)
  return logits + stream + max(bodies)


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """Device memory in bytes; `weights + kv_cache + state + workspace + expert_cache + slack +
  free == capacity`."""
  capacity: int
  weights: int
  kv_cache: int
  state: int
  workspace: int
  slack: int
  workspace_source: str  # "XLA memory analysis" | "estimate"
  expert_cache: int = 0  # the device expert cache (jaxvt.offload.expert_cache): what was free

  @property
  def headroom(self) -> int:
    """Capacity minus everything allocated (may be negative)."""
    return (self.capacity - self.weights - self.kv_cache - self.state - self.workspace
            - self.expert_cache)

  @property
  def free(self) -> int:
    return self.headroom - self.slack

  @property
  def fits(self) -> bool:
    return self.headroom >= self.slack


def breakdown(device_weight_bytes: int, facts: DeviceFacts, cfg: ModelConfig, shape: RunShape,
              workspace_bytes: int | None = None) -> Breakdown:
  """The device-memory breakdown for `device_weight_bytes` of resident weights.

  `workspace_bytes`: XLA's compiled memory analysis (temporaries + outputs not aliased to
  inputs) when the engine has compiled the program; None uses `estimate_workspace_bytes`.
  """
  if workspace_bytes is None:
    ws, src = estimate_workspace_bytes(cfg, shape), "estimate"
  else:
    ws, src = int(workspace_bytes), "XLA memory analysis"
  return Breakdown(facts.capacity_bytes, int(device_weight_bytes), kv_cache_bytes(cfg, shape),
                   recurrent_state_bytes(cfg, shape), ws, facts.slack, src)


def plan_breakdown(plan: Plan, facts: DeviceFacts, cfg: ModelConfig, shape: RunShape,
                   workspace_bytes: int | None = None) -> Breakdown:
  return breakdown(plan.device_bytes, facts, cfg, shape, workspace_bytes)


def smallest_safe_budget(plan: Plan, facts: DeviceFacts, cfg: ModelConfig, shape: RunShape,
                         workspace_bytes: int | None = None) -> int | None:
  """The smallest offload budget (bytes) whose plan leaves the slack intact; None if none does.

  Device weights fall as the budget grows (the plan holds the bytes of a growing prefix of one
  order), so the answer is the first of `plan.steps()` that fits; every larger budget fits too.
  Overrides stay honoured: the answer is never below the bytes they force into the host tier.
  """
  base = breakdown(0, facts, cfg, shape, workspace_bytes)
  allowed = base.headroom - base.slack  # the most device weight bytes that fit
  device = plan.total_bytes - plan.forced_host_bytes
  for i, step in enumerate(plan.steps()):
    if i:
      device -= plan.units[plan.order[i - 1]].nbytes
    if device <= allowed:
      return step
  return None


def check(plan: Plan, facts: DeviceFacts, cfg: ModelConfig, shape: RunShape,
          workspace_bytes: int | None = None, *, force: bool = False) -> Breakdown:
  """The plan's breakdown; raises JaxvtError when headroom < slack (the cliff) unless `force`."""
  bd = plan_breakdown(plan, facts, cfg, shape, workspace_bytes)
  if bd.fits or force:
    return bd
  safe = smallest_safe_budget(plan, facts, cfg, shape, workspace_bytes)
  raise JaxvtError(unsafe_message(plan, bd, None if safe is None else ceil_gib(safe)))


def unsafe_message(plan: Plan, bd: Breakdown, safe_gib: float | None) -> str:
  """The one line refusing `plan` (breakdown `bd`), naming `safe_gib`, the smallest budget that
  is safe as a user would pass it (None: no budget is safe)."""
  head = (f"offload budget {gib_text(plan.budget_bytes)} GiB leaves {bd.headroom / GiB:.2f} GiB "
          f"device headroom, below the {bd.slack / GiB:.2f} GiB slack")
  if safe_gib is not None:
    return f"{head}; the smallest safe budget is {safe_gib:g} GiB (or pass --force)"
  need = (bd.capacity - bd.headroom - bd.weights + (plan.total_bytes - plan.max_useful_budget) +
          bd.slack)
  return (f"{head}; no budget is safe: with every offloadable weight in the host tier the device "
          f"still needs {need / GiB:.2f} of {gib_text(bd.capacity)} GiB; lower --max-context (or "
          "pass --force)")


def host_memory_check(host_bytes: int, available_host_bytes: int | None,
                      margin_bytes: int = HOST_MARGIN_BYTES) -> None:
  """Refuses a host tier that would leave less than `margin_bytes` of host RAM available.

  Call before anything is allocated; `available_host_bytes` from `read_mem_available()` (None:
  unknown, nothing checked).
  """
  if available_host_bytes is None or host_bytes <= 0:
    return
  if host_bytes + margin_bytes > available_host_bytes:
    most = max(0, available_host_bytes - margin_bytes)
    raise JaxvtError(f"the host tier needs {host_bytes / GiB:.1f} GiB of pinned host memory but "
                     f"only {available_host_bytes / GiB:.1f} GiB is available and "
                     f"{margin_bytes / GiB:.1f} GiB must stay free; lower --offload-gb to at most "
                     f"{int(most * 10 // GiB) / 10:.1f} or free host memory")


def read_mem_available(path: str = "/proc/meminfo") -> int | None:
  """MemAvailable in bytes from /proc/meminfo; None where there is no such file or line."""
  try:
    with open(path, encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          value, unit = line.split()[1:3]
          return int(value) * {"kB": 1024, "mB": 1 << 20, "gB": 1 << 30}.get(unit, 1)
  except (OSError, ValueError, IndexError):
    return None
  return None


@dataclasses.dataclass(frozen=True)
class ServeMemory:
  """How a server uses the device memory the plan leaves: `batch` sequences decoded together
  and `prefix_bytes` for the prefix cache's stored rows and recurrent-state snapshots."""
  batch: int
  prefix_bytes: int
  sequence_bytes: int  # one sequence's cache (K/V for the whole context, recurrent state)
  available: int  # what the batch and the prefix cache share

  @property
  def left(self) -> int:
    """What the batch and the prefix cache leave (the expert cache's to take)."""
    return max(0, self.available - self.batch * self.sequence_bytes - self.prefix_bytes)


def serve_memory(bd: Breakdown, sequence_bytes: int, max_batch: int | None = None,
                 prefix_bytes: int | None = None, batch_cap: int = 8,
                 prefix_cap_sequences: int = 16) -> ServeMemory:
  """The batch and prefix-cache bytes that fit beside the plan `bd` (which counted one
  sequence's cache, for prefill, and keeps its slack): a server holds the batch's cache of
  `batch` x `sequence_bytes`, the one b=1 cache a prefill fills, and the prefix cache.

  `max_batch` None: as many sequences as half of what is available holds, at most `batch_cap`
  and at least 1; `prefix_bytes` None: the rest, at most `prefix_cap_sequences` sequences' worth
  (a CPU's "device" is the host's memory: the store need not take all of it). A `max_batch` (or both together) that does not
  fit is a JaxvtError naming the figures and the fix."""
  if sequence_bytes <= 0:
    raise ValueError(f"sequence_bytes {sequence_bytes} must be positive")
  # The plan counted one sequence's K/V and state at its own estimate; the server's b=1 prefill
  # cache is `sequence_bytes` exactly.
  available = max(0, bd.free + bd.kv_cache + bd.state - sequence_bytes)
  if max_batch is None:
    batch = max(1, min(batch_cap, available // (2 * sequence_bytes)))
  else:
    batch = max_batch
  rest = available - batch * sequence_bytes
  if max_batch is not None and rest < 0:
    raise JaxvtError(
        f"--max-batch {max_batch} needs {batch * sequence_bytes / GiB:.2f} GiB of device memory "
        f"for its sequences' caches ({sequence_bytes / GiB:.3f} GiB each) and "
        f"{available / GiB:.2f} GiB is free beside the plan; lower --max-batch or --max-context, "
        "or raise --offload-gb")
  if prefix_bytes is None:
    prefix_bytes = max(0, min(rest, prefix_cap_sequences * sequence_bytes))
  elif prefix_bytes > max(0, rest):
    raise JaxvtError(
        f"--prefix-cache-gb {prefix_bytes / GiB:.2f} does not fit: {max(0, rest) / GiB:.2f} GiB "
        f"is free beside the plan and {batch} sequences; lower it or --max-batch, or raise "
        "--offload-gb")
  return ServeMemory(batch, int(prefix_bytes), int(sequence_bytes), int(available))
