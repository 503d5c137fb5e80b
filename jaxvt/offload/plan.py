"""Placement pass: every weight unit goes to the "device" tier or the pinned "host" tier.

A placement unit is `(canonical name, layer)` for a stacked weight and `(name, None)` for a global
one (see jaxvt.model.declare). Inputs: the declarations, each unit's bytes in its GGUF format
(`TensorBytes`; `estimate_bytes` gives them for weightless planning), the offload budget (the most
bytes the host tier may hold) and a `Policy`. Output: a frozen `Plan`.

Rule (decided here, tested as properties):

1. Units the user forces with an override (`--offload-pattern REGEX=host|device`, first match
   wins) go where they are told; forced host bytes count against the budget, and a budget below
   them is an error. NORM, ROUTER and SMALL units never leave the device, override or not.
2. The other offloadable units are sorted once, independently of the budget (the policy order
   below), and the host tier takes the longest *prefix* of that order that fits in what the
   forced units leave of the budget.
3. Under `Policy.layers="spread"` (the default) the rank the prefix ends in keeps the prefix's
   t whole layers and its part of one more, but on the layers spaced most evenly
   (`even_layers`, else another evenly spaced grid, `even_grids`) where those hold exactly the
   prefix's bytes (layers of unequal size: the first grid that does); else the prefix.

So a plan never exceeds its budget, and it is monotone: a larger budget gives a longer prefix,
never moving a unit back to the device ("first" and "last": the host set only grows; "spread":
the same bytes as the prefix, the same ranks and counts of whole layers, but *which* layers of
the last rank may change, which decode's cost does not depend on, see below). The prefix rule
can leave up to one unit's bytes of the budget unused (at most ~0.2 GiB for a Qwen3.6-35B-A3B
expert stack). "Skip a unit that does not fit and keep filling with later, smaller ones" fits
more exactly but is not monotone: with order A 3, B 5, C 2, a budget of 5 takes {A, C} and a
budget of 8 takes {A, B}, moving C back.

Policy order. Moving a unit of `b` bytes to the host tier costs, per decode step, its bytes read
per step times (1/host rate - 1/device rate); every unit pays the same rates, so the cost per
byte of device memory freed is the unit's *read fraction* (bytes read per step / bytes held).
At batch B: the token embedding reads B rows (B/vocab, ~4e-6 at batch 1); routed experts read
the experts the tokens chose (1 - (1 - k/E)^B, 1/32 for 8 of 256 at batch 1); everything else is
read whole (1). So the embedding goes first, then routed experts (their down stacks first, see
below); the rest all read fraction 1, and are ranked by how well their reads hide: large
dense-FFN matrices stream best; shared-expert and DeltaNet matrices are mid-sized; attention
matrices are small (per-call overhead dominates); the output head is last, a single large read
at the end of the step that nothing overlaps.
A tied embedding is also the output head (read whole every step), so it ranks as OUTPUT.
Within a rank: by layer, spread ("spread", the default): the order is spread_order's (the last
layer, then the middle of the widest gap left between the layers already taken and the step's
start), then rule 3 spaces the last rank's t whole layers evenly: t of n layers are
(i + 1) * n // t - 1 for i < t (40 layers, 8: 4, 9, ..., 39; 9: 3, 7, 12, 16, 21, 25, 30, 34, 39),
where a prefix of spread_order alone must split one gap unevenly (9: 4, 9, ..., 34, 37, 39);
8 whole layers and the gate and up of a ninth (LAYER_ORDER): the gate and up on 3, the whole ones
on 7, ..., 39.
The routed experts' down stacks (ROUTED_DOWN) rank before their gate and up stacks: a budget
first takes down stacks of about three times as many layers as it could take whole layers of,
each a third of the bytes, so a host-tier layer's likeliest experts are fewer bytes for decode to
copy ahead (Products.predict_scale sizes that copy by the stacks each layer holds: H200,
35B-shaped file, auto's 4.06 GiB: 171 tok/s as 27 layers' down stacks with 6 experts predicted,
160 as 9 whole layers with 2). Prefill's copies of adjacent host-tier layers take two rings in
turns (Products.prefetch_rings) and keep their lead (5139 against 5068 tok/s at 512 tokens, the
same bytes). Past the down stacks whole layers join them, and those get 2 predicted experts
again. LAYER_ORDER keeps each layer's routed experts together (llama.cpp's unit).
Prefill copies each host-tier expert layer to the device while the layers before it compute
(Products.prefetch_per_expert): a copy takes about three layers' compute on the H200, so the
copy of a host-tier layer with one device-tier layer before it waits. Within a layer,
declaration order, so each layer's gate and up (LAYER_ORDER: gate, up and down) move together.
Decode's per-step cost does not depend on which layers: the scan runs every layer through one
body and a layer's tier is data. `Policy.layers="first"` takes layers 0..N-1 (llama.cpp's
`--n-cpu-moe N` moves those, with LAYER_ORDER), "last" the last first.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from typing import Iterable, Mapping, Sequence

from jaxvt.errors import JaxvtError
from jaxvt.gguf.formats import F16, F32, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, row_bytes
from jaxvt.gguf.names import gguf_name
from jaxvt.model.config import ModelConfig
from jaxvt.model.declare import OFFLOADABLE, Role, WeightDecl

DEVICE = "device"
HOST = "host"
KINDS = (DEVICE, HOST)
GiB = 1 << 30

Unit = tuple[str, "int | None"]  # (canonical name, layer); layer None for a global tensor
TensorBytes = Mapping[Unit, int]  # unit -> bytes of that unit in its GGUF format

# Ranks of the default policy; equal ranks interleave by layer (see the module docstring). A rank
# names roles, or canonical names that rank apart from (before) the rest of their role.
ROUTED_DOWN = "moe.w_down"  # the routed experts' down stacks (jaxvt.model.declare)
DEFAULT_ORDER: tuple[tuple[Role | str, ...], ...] = (
    (Role.EMBEDDING,), (ROUTED_DOWN,), (Role.ROUTED_EXPERTS,), (Role.DENSE_FFN,),
    (Role.SHARED_EXPERT, Role.DELTANET), (Role.ATTENTION,), (Role.OUTPUT,))
# Each layer's routed experts move together (llama.cpp's unit).
LAYER_ORDER = tuple(r for r in DEFAULT_ORDER if r != (ROUTED_DOWN,))


# ----------------------------------------------------------------------------------------------
# Weightless sizes


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Formats by role (and by canonical name, which wins) for weightless byte estimates.

  Vectors (non-matrix declarations) are always F32. A matrix whose columns are not a multiple of
  its format's block falls back as llama.cpp's quantizer does, to a supported block-32 format
  (`fallbacks`), then to F16.
  """
  name: str
  roles: tuple[tuple[Role, int], ...]
  names: tuple[tuple[str, int], ...] = ()
  fallbacks: tuple[tuple[int, int], ...] = ((Q4_K, Q4_1), (Q5_K, Q8_0), (Q6_K, Q8_0))

  def type_of(self, decl: WeightDecl) -> int:
    if not decl.matrix:
      return F32
    by_name = dict(self.names)
    t = by_name.get(decl.name, dict(self.roles)[decl.role])
    cols = decl.shape[-1]
    for cand in (t, dict(self.fallbacks).get(t, F16), F16):
      try:
        row_bytes(cand, cols)
        return cand
      except JaxvtError:
        continue
    return F32


# Like llama.cpp's Q4_K_S: Q4_K nearly everywhere; attention V and DeltaNet/shared matrices get
# Q5_K, the output head Q6_K; routers stay F32 (llama.cpp never quantizes ffn_gate_inp).
Q4_K_S_LIKE = Recipe(
    name="Q4_K_S-like",
    roles=((Role.ROUTED_EXPERTS, Q4_K), (Role.SHARED_EXPERT, Q5_K), (Role.DENSE_FFN, Q4_K),
           (Role.DELTANET, Q5_K), (Role.ATTENTION, Q4_K), (Role.OUTPUT, Q6_K),
           (Role.EMBEDDING, Q4_K), (Role.ROUTER, F32), (Role.NORM, F32), (Role.SMALL, F32)),
    names=(("attn.wv", Q5_K),))


def decl_units(decl: WeightDecl) -> list[Unit]:
  return [(decl.name, None)] if decl.layers is None else [(decl.name, l) for l in decl.layers]


def estimate_bytes(decls: Sequence[WeightDecl], recipe: Recipe = Q4_K_S_LIKE) -> dict[Unit, int]:
  """Unit -> bytes for a model without its file."""
  out: dict[Unit, int] = {}
  for d in decls:
    t = recipe.type_of(d)
    rows = d.numel // d.shape[-1]
    nbytes = rows * row_bytes(t, d.shape[-1])
    for u in decl_units(d):
      out[u] = nbytes
  return out


# ----------------------------------------------------------------------------------------------
# Policy and overrides


@dataclasses.dataclass(frozen=True)
class Override:
  """A user-forced placement: units whose label or GGUF name `re.search`-matches go to `kind`."""
  pattern: str
  kind: str

  def __post_init__(self):
    if self.kind not in KINDS:
      raise JaxvtError(f"--offload-pattern '{self.pattern}={self.kind}': the kind must be "
                       "'host' or 'device'")
    try:
      re.compile(self.pattern)
    except re.error as e:
      raise JaxvtError(f"--offload-pattern '{self.pattern}': not a regular expression ({e})")

  def matches(self, labels: Iterable[str]) -> bool:
    rx = _compiled(self.pattern)
    return any(rx.search(s) for s in labels if s)


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern:
  return re.compile(pattern)


def parse_overrides(specs: Iterable[str]) -> tuple[Override, ...]:
  """`["exps=host", r"blk\\.3\\.=device", "attn"]` -> Overrides; a bare REGEX means host.

  Each spec is one `--offload-pattern` flag value; the kind follows the last '='. Commas are not
  separators (regexes use them), so give the flag once per pattern.
  """
  out = []
  for spec in specs:
    pat, sep, kind = spec.rpartition("=")
    if not sep or kind not in KINDS:
      pat, kind = spec, HOST
    if not pat:
      raise JaxvtError(f"--offload-pattern '{spec}': empty pattern; use REGEX=host|device")
    out.append(Override(pat, kind))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Policy:
  batch: int = 1  # sequences decoded per step (read fractions depend on it)
  order: tuple[tuple[Role | str, ...], ...] = DEFAULT_ORDER  # offload ranks, first first
  layers: str = "spread"  # within a rank: "spread" (rule 3), "first" (layer 0 first), "last"
  overrides: tuple[Override, ...] = ()

  def __post_init__(self):
    if self.batch < 1:
      raise JaxvtError(f"batch {self.batch} must be at least 1")
    if self.layers not in ("spread", "first", "last"):
      raise ValueError(f"Policy.layers must be 'spread', 'first' or 'last', not {self.layers!r}")
    ranked = [r for group in self.order for r in group if isinstance(r, Role)]
    if sorted(ranked) != sorted(OFFLOADABLE) or len(set(ranked)) != len(ranked):
      raise ValueError("Policy.order must rank every offloadable role exactly once")
    names = [r for group in self.order for r in group if not isinstance(r, Role)]
    if not all(isinstance(r, str) for r in names) or len(set(names)) != len(names):
      raise ValueError("Policy.order's other entries must be distinct canonical names")

  def rank(self, role: Role) -> int:
    for i, group in enumerate(self.order):
      if role in group:
        return i
    raise KeyError(role)

  def rank_of(self, u: "UnitInfo") -> int:
    """The unit's rank: its canonical name's where the order names it, else its role's."""
    for i, group in enumerate(self.order):  # names only: Role is a str enum, equal to its value
      if any(u.name == r for r in group if not isinstance(r, Role)):
        return i
    return self.rank(u.rank_role)


# ----------------------------------------------------------------------------------------------
# Units and reads


@dataclasses.dataclass(frozen=True)
class UnitInfo:
  name: str
  layer: int | None
  role: Role
  nbytes: int  # bytes held
  read_bytes: int  # bytes read per decode step (batch sequences, one token each)
  offloadable: bool
  rank_role: Role  # the role it ranks as (a tied embedding ranks as OUTPUT)
  label: str  # "blk.{layer}.{name}" or "{name}"

  @property
  def unit(self) -> Unit:
    return (self.name, self.layer)


def read_fraction(role: Role, cfg: ModelConfig, batch: int, tied: bool = False) -> float:
  """Bytes read per decode step of `batch` tokens / bytes held, for a unit of `role`."""
  if role is Role.ROUTED_EXPERTS and cfg.n_experts:
    return 1.0 - (1.0 - cfg.n_experts_used / cfg.n_experts) ** batch
  if role is Role.EMBEDDING:
    rows = min(batch, cfg.vocab_size) / cfg.vocab_size
    return 1.0 + rows if tied else rows
  return 1.0


def _gguf_name(arch: str, name: str, layer: int | None) -> str:
  """The unit's GGUF tensor name, or "" where the name table has none."""
  try:
    return gguf_name(arch, name, layer)
  except (JaxvtError, ValueError):
    return ""


def unit_infos(cfg: ModelConfig, decls: Sequence[WeightDecl], sizes: TensorBytes,
               batch: int = 1) -> tuple[UnitInfo, ...]:
  """One UnitInfo per unit of the declarations, in declaration order."""
  tied = cfg.tied_embeddings
  seen = set()
  out = []
  for d in decls:
    for u in decl_units(d):
      if u not in sizes:
        raise ValueError(f"no byte size for {u}")
      seen.add(u)
      nbytes = int(sizes[u])
      if nbytes < 0:
        raise ValueError(f"negative size for {u}")
      is_tied = d.role is Role.EMBEDDING and tied
      frac = read_fraction(d.role, cfg, batch, is_tied)
      out.append(UnitInfo(
          name=d.name, layer=u[1], role=d.role, nbytes=nbytes, read_bytes=round(nbytes * frac),
          offloadable=d.role in OFFLOADABLE,
          rank_role=Role.OUTPUT if is_tied else d.role,
          label=d.name if u[1] is None else f"blk.{u[1]}.{d.name}"))
  extra = set(sizes) - seen
  if extra:
    raise ValueError(f"sizes name undeclared units: {sorted(extra, key=str)[:3]}")
  return tuple(out)


def _forced(arch: str, infos: Sequence[UnitInfo],
            overrides: Sequence[Override]) -> tuple[str | None, ...]:
  """The kind each unit is forced to (first matching override), or None.

  A pattern is searched in the unit's label ("blk.3.moe.w_up") and its GGUF tensor name
  ("blk.3.ffn_up_exps.weight"), so llama.cpp-style patterns such as "exps" work.
  """
  forced: list[str | None] = [None] * len(infos)
  if not overrides:
    return tuple(forced)
  names = [(u.label, _gguf_name(arch, u.name, u.layer)) for u in infos]
  for ov in overrides:
    hit = False
    for i, u in enumerate(infos):
      if u.offloadable and ov.matches(names[i]):
        hit = True
        if forced[i] is None:
          forced[i] = ov.kind
    if not hit:
      raise JaxvtError(f"--offload-pattern '{ov.pattern}={ov.kind}' matches no offloadable weight "
                       "(norms, routers and small vectors always stay on the device); match "
                       "canonical labels like 'blk.3.moe.w_up' or GGUF names like "
                       "'blk.3.ffn_up_exps.weight'")
  return tuple(forced)


@functools.cache
def spread_order(n_layers: int) -> tuple[int, ...]:
  """Layers 0..n-1: the last, then each next the middle of the widest gap between layers already
  taken (the step's start, -1, bounds the first gap; ties: the later gap, so a short gap falls
  late, where its copy has had the longest lead). Every prefix of k layers is about evenly
  spaced: no gap wider than 2 n / k (see the module docstring)."""
  if n_layers < 1:
    return ()
  taken, gaps = [n_layers - 1], [(-1, n_layers - 1)]
  while len(taken) < n_layers:
    i = max(range(len(gaps)), key=lambda j: (gaps[j][1] - gaps[j][0], gaps[j][0]))
    a, b = gaps.pop(i)
    if b - a < 2:
      continue  # no layer strictly inside
    m = (a + b + 1) // 2
    taken.append(m)
    gaps += [(a, m), (m, b)]
  return tuple(taken)


def offload_order(infos: Sequence[UnitInfo], policy: Policy,
                  forced: Sequence[str | None]) -> tuple[int, ...]:
  """Indices of the units the budget fills, first offloaded first (budget-independent)."""
  n = 1 + max((u.layer for u in infos if u.layer is not None), default=0)
  pos = {"first": list(range(n)), "last": [-l for l in range(n)]}.get(policy.layers)
  if pos is None:
    pos = [0] * n
    for i, l in enumerate(spread_order(n)):
      pos[l] = i

  def key(i: int):
    u = infos[i]
    return (policy.rank_of(u), -1 - n if u.layer is None else pos[u.layer], i)

  return tuple(sorted((i for i, u in enumerate(infos) if u.offloadable and forced[i] is None),
                      key=key))


# ----------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class Plan:
  """Unit -> "device" | "host" with the inputs that produced it (for re-budgeting).

  `units`, `kinds` and `forced` are parallel, in declaration order; `order` indexes `units`:
  the automatic offload order. Byte totals are per decode step of `policy.batch` tokens.
  """
  budget_bytes: int
  policy: Policy
  units: tuple[UnitInfo, ...]
  kinds: tuple[str, ...]
  forced: tuple[str | None, ...]
  order: tuple[int, ...]

  @functools.cached_property
  def placement(self) -> Mapping[Unit, str]:
    return types.MappingProxyType({u.unit: k for u, k in zip(self.units, self.kinds)})

  def kind(self, unit: Unit) -> str:
    return self.placement[unit]

  def _sum(self, field: str, kind: str) -> int:
    return sum(getattr(u, field) for u, k in zip(self.units, self.kinds) if k == kind)

  @property
  def host_bytes(self) -> int:
    return self._sum("nbytes", HOST)

  @property
  def device_bytes(self) -> int:
    """Weight bytes resident on the device."""
    return self._sum("nbytes", DEVICE)

  @property
  def total_bytes(self) -> int:
    return sum(u.nbytes for u in self.units)

  @property
  def host_read_bytes(self) -> int:
    """Host-tier bytes read per decode step (per token at batch 1)."""
    return self._sum("read_bytes", HOST)

  @property
  def device_read_bytes(self) -> int:
    """Device-resident weight bytes read per decode step."""
    return self._sum("read_bytes", DEVICE)

  @property
  def forced_host_bytes(self) -> int:
    return sum(u.nbytes for u, f in zip(self.units, self.forced) if f == HOST)

  @property
  def max_useful_budget(self) -> int:
    """The budget beyond which nothing more moves: forced + every automatic unit."""
    return self.forced_host_bytes + sum(self.units[i].nbytes for i in self.order)

  def totals(self) -> dict[tuple[Role, str], tuple[int, int]]:
    """(role, kind) -> (units, bytes), for every role present, both kinds, sorted."""
    acc: dict[tuple[Role, str], list[int]] = {}
    for u in self.units:
      for k in KINDS:
        acc.setdefault((u.role, k), [0, 0])
    for u, k in zip(self.units, self.kinds):
      acc[(u.role, k)][0] += 1
      acc[(u.role, k)][1] += u.nbytes
    roles = list(Role)
    return {key: (v[0], v[1]) for key, v in
            sorted(acc.items(), key=lambda kv: (roles.index(kv[0][0]), KINDS.index(kv[0][1])))}

  def steps(self) -> tuple[int, ...]:
    """The budgets at which the plan changes: forced bytes, then + each unit of the order.

    `rebudget(steps()[i])` puts exactly the first i units of the order in the host tier ("first"
    and "last"; "spread" as many whole layers of each rank, see rule 3).
    """
    out = [self.forced_host_bytes]
    for i in self.order:
      out.append(out[-1] + self.units[i].nbytes)
    return tuple(out)

  def rebudget(self, budget_bytes: int) -> "Plan":
    """The plan the same inputs give under another budget."""
    return _place(self.units, self.policy, self.forced, self.order, budget_bytes)


def _place(units: tuple[UnitInfo, ...], policy: Policy, forced: tuple[str | None, ...],
           order: tuple[int, ...], budget_bytes: int) -> Plan:
  budget_bytes = int(budget_bytes)
  if budget_bytes < 0:
    raise JaxvtError(f"offload budget {gib_text(budget_bytes)} GiB is negative; pass 0 or more")
  kinds = [f if f is not None else DEVICE for f in forced]
  left = budget_bytes - sum(u.nbytes for u, f in zip(units, forced) if f == HOST)
  if left < 0:
    used = budget_bytes - left
    raise JaxvtError(f"--offload-pattern forces {used / GiB:.2f} GiB into the host tier, above the "
                     f"{budget_bytes / GiB:.2f} GiB offload budget; raise --offload-gb to at least "
                     f"{ceil_gib(used):.1f} or narrow the pattern")
  taken: list[int] = []
  for i in order:
    if units[i].nbytes > left:
      break
    taken.append(i)
    left -= units[i].nbytes
  if policy.layers == "spread" and len(taken) < len(order):
    taken = _spread_last_rank(units, policy, order, taken)
  for i in taken:
    kinds[i] = HOST
  return Plan(budget_bytes, policy, units, tuple(kinds), forced, order)


def even_layers(n: int, t: int) -> tuple[int, ...]:
  """t of the positions 0..n-1 spaced most evenly, the last one n - 1: every gap (the first
  counted from -1) is n // t or n // t + 1."""
  return tuple((i + 1) * n // t - 1 for i in range(t))


def _spread_last_rank(units: tuple[UnitInfo, ...], policy: Policy, order: tuple[int, ...],
                      taken: list[int]) -> list[int]:
  """Rule 3: `taken` (a prefix of `order`) with the layers it holds of the rank it ends in moved
  to the most evenly spaced ones: t whole layers and the prefix's part of one more take
  even_layers(n, t + 1), the part the first of them (its copy is the shortest and starts with
  the step); else the whole ones alone even_layers(n, t), the part where the prefix has it; each
  only where it holds exactly the prefix's bytes, trying the part on the grid's later layers and
  other even grids (even_grids) where it does not (layers of unequal size: a Q4_K_S file's down
  stacks); else the prefix."""
  rank = policy.rank_of(units[order[len(taken)]])
  ranked = [i for i in order if policy.rank_of(units[i]) == rank]
  if any(units[i].layer is None for i in ranked):
    return taken
  mine = set(taken) & set(ranked)
  by_layer: dict[int, list[int]] = {}
  for i in ranked:
    by_layer.setdefault(units[i].layer, []).append(i)
  layers = sorted(by_layer)
  whole = [l for l in layers if all(i in mine for i in by_layer[l])]
  part = {units[i].name for i in mine if units[i].layer not in whole}
  held = sum(units[i].nbytes for i in mine)
  n, t = len(layers), len(whole)

  def tries():
    if part:  # t + 1 grid layers, the part on the first (else on a later one)
      for grid in even_grids(n, t + 1):
        for m, at in enumerate(grid):
          rest = [layers[j] for j in grid[:m] + grid[m + 1:]]
          yield ([i for l in rest for i in by_layer[l]] +
                 [i for i in by_layer[layers[at]] if units[i].name in part])
    if whole:  # t grid layers, the part where the prefix has it
      for grid in even_grids(n, t):
        spaced = [i for j in grid for i in by_layer[layers[j]]]
        yield spaced + [i for i in mine if units[i].layer not in whole and i not in spaced]

  for chosen in tries():  # the same bytes as the prefix, so every byte total stays the prefix's
    if sum(units[i].nbytes for i in chosen) == held:
      return [i for i in taken if i not in mine] + chosen
  return taken


def even_grids(n: int, t: int):
  """Evenly spaced choices of t of n positions, the best first: even_layers(n, t), then it moved
  1, 2, ... positions earlier, then i * n // t + o for o from n // t - 1 down (gaps of n // t or
  n // t + 1 in each; the first position falls earlier down the list)."""
  seen = set()
  grids = [tuple(j - s for j in even_layers(n, t)) for s in range(n // t)]
  grids += [tuple(i * n // t + o for i in range(t)) for o in range(n // t - 1, -1, -1)]
  for g in grids:
    if g not in seen and g[0] >= 0 and g[-1] < n:
      seen.add(g)
      yield g


def ceil_gib(nbytes: int) -> float:
  """Bytes as GiB rounded up to 0.1 (a budget shown this way is never below `nbytes`)."""
  return -(-int(nbytes) * 10 // GiB) / 10


def gib_text(nbytes: int) -> str:
  """Bytes as GiB with up to three decimals and no trailing zeros: a size the user gave in GiB
  (`--device-gb 0.85`, `--offload-gb 7`) prints as given ("0.85", "7")."""
  return f"{round(nbytes / GiB, 3):g}"


def plan(cfg: ModelConfig, decls: Sequence[WeightDecl], sizes: TensorBytes, budget_bytes: int,
         policy: Policy = Policy()) -> Plan:
  """Places every unit of `sizes` under `budget_bytes` of host tier (see the module docstring)."""
  infos = unit_infos(cfg, decls, sizes, policy.batch)
  forced = _forced(cfg.arch, infos, policy.overrides)
  return _place(infos, policy, forced, offload_order(infos, policy, forced), budget_bytes)
