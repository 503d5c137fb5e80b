"""Placement pass: budget, monotonicity, roles that never move, overrides, determinism."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from jaxvt.errors import JaxvtError
from jaxvt.model.declare import Role
from jaxvt.offload import plan as P
from jaxvt.offload.plan import DEVICE, GiB, HOST
from test_plan_fixtures import CONFIGS, base_plan, host_set, jittered, model

NEVER = (Role.NORM, Role.ROUTER, Role.SMALL)
names = st.sampled_from(sorted(CONFIGS))
fractions = st.floats(0.0, 1.2)


# ---------------------------------------------------------------------------------------------
# Sizes and reads


def test_qwen36_35b_q4_k_s_like_size():
  # Trunk only, 18.5 GiB: the 19.45 GiB UD-Q4_K_S file adds its MTP block (~0.45 GiB: 256
  # experts x 3 x 512 x 2048 in Q4_K) and Unsloth's higher-bit choices; jaxvt loads no MTP block.
  _, decls, sizes = model("qwen36_35b")
  total = sum(sizes.values()) / GiB
  assert 18.0 < total < 19.5, total
  expert = 256 * 512 * (2048 // 256) * 144  # one Q4_K [256, 512, 2048] stack
  assert sizes[("moe.w_gate", 0)] == expert
  assert sizes[("lm_head", None)] == 248320 * 2048 // 256 * 210  # Q6_K
  assert sizes[("moe.router", 5)] == 256 * 2048 * 4  # F32
  assert len([u for u in sizes if u[0] == "attn.wq"]) == 10


def test_smollm2_tied_and_fallback_formats():
  cfg, decls, sizes = model("smollm2_135m")
  assert ("lm_head", None) not in sizes
  # 576 columns are no multiple of 256: Q4_K falls back to Q4_1 (32 elements, 20 bytes).
  assert sizes[("embed", None)] == 49152 * 576 // 32 * 20
  assert sizes[("ffn.w_down", 0)] == 576 * 1536 // 256 * 144  # 1536 columns: Q4_K
  assert 0.06 < sum(sizes.values()) / GiB < 0.1


def test_read_bytes_per_token():
  p = base_plan("qwen36_35b")
  by = {u.unit: u for u in p.units}
  e = by[("moe.w_up", 3)]
  assert e.read_bytes == e.nbytes // 32  # 8 of 256 experts
  emb = by[("embed", None)]
  assert emb.read_bytes == emb.nbytes // 248320  # one row
  assert by[("lm_head", None)].read_bytes == by[("lm_head", None)].nbytes
  p8 = base_plan("qwen36_35b", 8)
  e8 = {u.unit: u for u in p8.units}[("moe.w_up", 3)]
  assert e8.read_bytes == round(e8.nbytes * (1 - (1 - 8 / 256) ** 8))  # E(1-(1-k/E)^B) experts
  assert {u.unit: u for u in p8.units}[("embed", None)].read_bytes == 8 * emb.read_bytes


def test_tied_embedding_reads_whole_and_ranks_as_output():
  p = base_plan("smollm2_135m")
  emb = next(u for u in p.units if u.name == "embed")
  row = emb.nbytes // 49152
  assert emb.read_bytes == emb.nbytes + row
  assert emb.rank_role is Role.OUTPUT
  assert p.units[p.order[-1]].name == "embed"  # offloaded last


def test_default_order_and_fractions():
  cfg, _, _ = model("qwen36_35b")
  p = base_plan("qwen36_35b")
  order = [p.units[i] for i in p.order]
  assert order[0].unit == ("embed", None)
  # the routed experts' down stacks by spread layers (P.spread_order: the last layer, then 19,
  # 29, 9, ...), then their gate and up stacks by the same layers, each layer's pair together
  spread = P.spread_order(40)
  assert [u.unit for u in order[1:41]] == [("moe.w_down", l) for l in spread]
  assert [u.unit for u in order[41:45]] == [("moe.w_gate", 39), ("moe.w_up", 39),
                                            ("moe.w_gate", 19), ("moe.w_up", 19)]
  assert order[-1].unit == ("lm_head", None)
  # LAYER_ORDER: gate, up and down of each layer together
  lo = P.plan(*model("qwen36_35b"), 0, P.Policy(order=P.LAYER_ORDER))
  lu = [lo.units[i].unit for i in lo.order]
  assert lu[1:4] == [("moe.w_gate", 39), ("moe.w_up", 39), ("moe.w_down", 39)]
  assert lu[4] == ("moe.w_gate", 19) and lu[7] == ("moe.w_gate", 29)
  assert sorted(lu) == sorted(u.unit for u in order)
  roles = [u.role for u in order]
  assert roles.index(Role.ATTENTION) > max(i for i, r in enumerate(roles) if r is Role.DELTANET)
  # The default order never puts a unit that reads more per byte held before one that reads less.
  for batch in (1, 4, 64):
    fr = [u.read_bytes / u.nbytes for u in (base_plan("qwen36_35b", batch).units[i]
                                            for i in base_plan("qwen36_35b", batch).order)]
    assert all(a <= b + 1e-9 for a, b in zip(fr, fr[1:])), batch


def test_layers_last_reverses_within_a_rank():
  cfg, decls, sizes = model("qwen36_35b")
  p = P.plan(cfg, decls, sizes, 0, P.Policy(layers="last", order=P.LAYER_ORDER))
  order = [p.units[i].unit for i in p.order]
  assert order[1:4] == [("moe.w_gate", 39), ("moe.w_up", 39), ("moe.w_down", 39)]
  p = P.plan(cfg, decls, sizes, 0, P.Policy(layers="last"))
  order = [p.units[i].unit for i in p.order]
  assert order[1:41] == [("moe.w_down", l) for l in range(39, -1, -1)]
  assert order[41:43] == [("moe.w_gate", 39), ("moe.w_up", 39)]


def test_layers_first_takes_layers_in_order():
  cfg, decls, sizes = model("qwen36_35b")
  p = P.plan(cfg, decls, sizes, 6 * GiB, P.Policy(layers="first", order=P.LAYER_ORDER))
  hosts = host_set(p)
  assert all((n, l) in hosts for l in range(13) for n in ("moe.w_gate", "moe.w_up", "moe.w_down"))
  assert ("moe.w_up", 13) not in hosts
  # the default order: every layer's down stack (5.63 GiB), then gate and up from layer 0
  downs = sizes[("embed", None)] + sum(sizes[("moe.w_down", l)] for l in range(40))
  budget = downs + 3 * sizes[("moe.w_gate", 0)]
  hosts = host_set(P.plan(cfg, decls, sizes, budget, P.Policy(layers="first")))
  assert all(("moe.w_down", l) in hosts for l in range(40))
  assert ("moe.w_gate", 0) in hosts and ("moe.w_up", 0) in hosts and ("moe.w_gate", 1) in hosts
  assert ("moe.w_up", 1) not in hosts and ("moe.w_gate", 39) not in hosts


@pytest.mark.parametrize("n", [1, 2, 3, 7, 13, 40, 94])
def test_spread_order_spaces_every_prefix(n):
  """Every prefix of k layers has gaps of at most twice the even spacing n / k (counting the
  start of the step), and the order is a permutation."""
  o = P.spread_order(n)
  assert sorted(o) == list(range(n))
  for k in range(1, n + 1):
    taken = sorted(o[:k])
    gaps = [b - a for a, b in zip([-1] + taken, taken)]
    assert max(gaps) <= max(1, 2 * n / k), (k, taken)


def test_35b_6gib_plan():
  """The default at 6 GiB: the embedding and every down stack (5.9 GiB); 0.5 GiB more adds the
  gate and up of the two layers spread_order takes first."""
  p = base_plan("qwen36_35b").rebudget(6 * GiB)
  hosts = host_set(p)
  assert p.host_bytes <= 6 * GiB and ("embed", None) in hosts
  assert all(("moe.w_down", l) in hosts for l in range(40))
  assert not any(n in ("moe.w_gate", "moe.w_up") for n, _ in hosts)
  hosts = host_set(p.rebudget(6.5 * GiB))
  assert {(n, l) for n, l in hosts if n in ("moe.w_gate", "moe.w_up")} == {
      (n, l) for n in ("moe.w_gate", "moe.w_up") for l in P.even_layers(40, 2)}


def test_35b_6gib_plan_whole_layers():
  p = P.plan(*model("qwen36_35b"), 6 * GiB, P.Policy(order=P.LAYER_ORDER))
  assert p.host_bytes <= 6 * GiB
  hosts = host_set(p)
  assert ("embed", None) in hosts
  # the prefix's 13 whole layers of experts and the gate of one more, spaced evenly: the gate
  # first (its copy is the shortest), then the whole layers
  first, *even = P.even_layers(40, 14)
  assert all((n, l) in hosts for l in even for n in ("moe.w_gate", "moe.w_up", "moe.w_down"))
  assert ("moe.w_gate", first) in hosts and ("moe.w_up", first) not in hosts
  assert sum(1 for n, _ in hosts if n.startswith("moe.")) == 40
  assert p.host_read_bytes == sum(u.read_bytes for u in p.units if u.unit in hosts)
  assert p.host_bytes + p.device_bytes == p.total_bytes


@pytest.mark.parametrize("n", [1, 2, 5, 40, 94])
def test_even_layers(n):
  for t in range(1, n + 1):
    e = P.even_layers(n, t)
    assert len(set(e)) == t and e[-1] == n - 1 and list(e) == sorted(e)
    gaps = [b - a for a, b in zip((-1,) + e, e)]
    assert max(gaps) - min(gaps) <= 1, (t, e)
    grids = list(P.even_grids(n, t))
    assert grids[0] == e and len(set(grids)) == len(grids)
    for g in grids:  # inside 0..n-1, gaps between its positions of n // t or n // t + 1
      assert 0 <= g[0] and g[-1] < n and len(g) == t
      assert all(n // t <= b - a <= n // t + 1 for a, b in zip(g, g[1:])), (t, g)


def test_spread_places_the_prefix_count_evenly():
  """40 equal expert layers: every count t of whole host-tier layers is even_layers(40, t), with
  the same bytes as the order's prefix (9 layers: 3, 7, ..., 39, where the prefix has 37 and 39)."""
  p0 = P.plan(*model("qwen36_35b"), 0, P.Policy(order=P.LAYER_ORDER))
  prefix = P.plan(*model("qwen36_35b"), 0, P.Policy(layers="spread", order=P.LAYER_ORDER))
  emb = next(u.nbytes for u in p0.units if u.name == "embed")
  layer = sum(u.nbytes for u in p0.units if u.layer == 0 and u.name.startswith("moe.w_"))
  for t in (1, 8, 9, 13, 39):
    p = p0.rebudget(emb + t * layer)
    hosts = host_set(p)
    got = sorted({l for n, l in hosts if n == "moe.w_down"})
    assert got == list(P.even_layers(40, t)), t
    assert all((n, l) in hosts for l in got for n in ("moe.w_gate", "moe.w_up"))
    k = sum(1 for i in prefix.order[:1 + 3 * t])  # the prefix: the embedding and t layers
    assert p.host_bytes == sum(prefix.units[i].nbytes for i in prefix.order[:k])
  assert sorted(P.spread_order(40)[:9]) == [4, 9, 14, 19, 24, 29, 34, 37, 39]
  assert P.even_layers(40, 9) == (3, 7, 12, 16, 21, 25, 30, 34, 39)


def test_spread_places_down_stacks_evenly():
  """The default order: t down stacks go on even_layers(40, t), and no gate or up moves until
  every down stack has; past them, t whole layers' gate and up go evenly too."""
  p0 = base_plan("qwen36_35b")
  emb = next(u.nbytes for u in p0.units if u.name == "embed")
  down = next(u.nbytes for u in p0.units if u.unit == ("moe.w_down", 0))
  pair = 2 * next(u.nbytes for u in p0.units if u.unit == ("moe.w_gate", 0))
  for t in (1, 9, 27, 39, 40):
    p = p0.rebudget(emb + t * down)
    hosts = host_set(p)
    assert sorted(l for n, l in hosts if n == "moe.w_down") == list(P.even_layers(40, t)), t
    assert not any(n in ("moe.w_gate", "moe.w_up") for n, _ in hosts), t
  for t in (1, 9, 13):
    hosts = host_set(p0.rebudget(emb + 40 * down + t * pair))
    assert sorted(l for n, l in hosts if n == "moe.w_up") == list(P.even_layers(40, t)), t


def test_spread_with_layers_of_unequal_size():
  """Down stacks of two sizes (every third layer's larger, as in a Q4_K_S file): every budget
  holds exactly the prefix's bytes; rule 3 finds evenly spaced layers holding them for most
  budgets (a grid of another phase, the part on another of its layers) and keeps the prefix's
  layers for the rest."""
  cfg, decls, sizes = model("qwen36_35b")
  sizes = dict(sizes)
  for l in range(40):
    if l % 3 == 2:
      sizes[("moe.w_down", l)] = sizes[("moe.w_down", l)] * 176 // 144  # Q5_K, not Q4_K
  p0 = P.plan(cfg, decls, sizes, 0)
  grids = [set(g) for t in range(2, 41) for g in P.even_grids(40, t)]
  moved, n = 0, 0
  for k in range(8, 120):  # budgets ending in the routed experts' rank, 3+ whole layers
    p = p0.rebudget(p0.steps()[k])
    assert p.host_bytes == p0.steps()[k]  # the prefix's bytes
    hosts = host_set(p)
    whole = {l for nm, l in hosts if nm == "moe.w_down" and ("moe.w_gate", l) in hosts}
    part = {l for nm, l in hosts if nm.startswith("moe.w_") and l not in whole}
    n += 1
    moved += any(whole | part == g for g in grids)
  assert moved >= n // 2, (moved, n)


# ---------------------------------------------------------------------------------------------
# Properties


@settings(max_examples=60, deadline=None)
@given(names, fractions, st.integers(0, 2**31))
def test_never_exceeds_budget_and_wastes_under_one_unit(name, frac, seed):
  cfg, decls, sizes = jittered(name, seed)
  budget = int(frac * sum(sizes.values()))
  p = P.plan(cfg, decls, sizes, budget)
  assert p.host_bytes <= budget
  k = prefix_len(p, budget)
  if k < len(p.order):  # the first unit the prefix left out did not fit: waste under one unit
    assert p.host_bytes + p.units[p.order[k]].nbytes > budget
  # the prefix's bytes, whichever layers hold them (rule 3)
  assert p.host_bytes == p.forced_host_bytes + sum(p.units[i].nbytes for i in p.order[:k])
  check_rank_prefix(p, budget)


def prefix_len(p: P.Plan, budget: int) -> int:
  """Units of the order in rule 2's prefix (what fits after the forced bytes)."""
  left, k = budget - p.forced_host_bytes, 0
  for i in p.order:
    if p.units[i].nbytes > left:
      break
    left, k = left - p.units[i].nbytes, k + 1
  return k


def whole_layers(p: P.Plan, idx) -> int:
  layers = {}
  for i in idx:
    layers.setdefault(p.units[i].layer, []).append(p.kinds[i] == HOST)
  return sum(1 for l, v in layers.items() if l is not None and all(v))


def check_rank_prefix(p: P.Plan, budget: int):
  """Rules 2 and 3: the ranks before the prefix's last one wholly in the host tier, those after it
  wholly on the device; in that rank, at least the prefix's count of whole layers (the fill after
  them may complete one more where layers differ in size), or the prefix itself."""
  k = prefix_len(p, budget)
  if k == len(p.order):
    assert all(p.kinds[i] == HOST for i in p.order)
    return
  rank = lambda i: p.policy.rank_of(p.units[i])
  last = rank(p.order[k])
  for i in p.order:
    assert p.kinds[i] == (HOST if rank(i) < last else DEVICE if rank(i) > last else p.kinds[i])
  mine = [i for i in p.order if rank(i) == last]
  as_prefix = all(p.kinds[i] == (HOST if j < k else DEVICE) for j, i in enumerate(p.order))
  if p.policy.layers != "spread":
    assert as_prefix
  elif not as_prefix:
    pre = [i for i in p.order[:k] if rank(i) == last]
    assert whole_layers(p, mine) >= sum(
        1 for l in {p.units[i].layer for i in pre}
        if all(i in pre for i in mine if p.units[i].layer == l))


layer_policies = st.sampled_from(["spread", "first", "last"])


@settings(max_examples=60, deadline=None)
@given(names, fractions, fractions, st.integers(0, 2**31), layer_policies)
def test_monotone_in_budget(name, f1, f2, seed, layers):
  """A larger budget never moves a unit back ("first", "last"); under "spread" the ranks before
  the last only grow, and the last rank's count of whole layers never falls."""
  cfg, decls, sizes = jittered(name, seed)
  total = sum(sizes.values())
  lo, hi = sorted((int(f1 * total), int(f2 * total)))
  pol = P.Policy(layers=layers)
  p_lo, p_hi = P.plan(cfg, decls, sizes, lo, pol), P.plan(cfg, decls, sizes, hi, pol)
  assert p_lo.rebudget(hi).kinds == p_hi.kinds
  if layers != "spread":
    assert host_set(p_lo) <= host_set(p_hi)
    return
  rank = lambda i: pol.rank_of(p_lo.units[i])
  k = prefix_len(p_lo, lo)
  if k < len(p_lo.order):
    last = rank(p_lo.order[k])
    before = {p_lo.units[i].unit for i in p_lo.order if rank(i) < last}
    assert before <= host_set(p_lo) and before <= host_set(p_hi)
    mine = [i for i in p_lo.order if rank(i) == last]
    assert whole_layers(p_lo, mine) <= whole_layers(p_hi, mine)


@settings(max_examples=40, deadline=None)
@given(names, fractions, st.integers(0, 2**31), st.booleans())
def test_norms_routers_small_stay_on_device(name, frac, seed, force_all):
  cfg, decls, sizes = jittered(name, seed)
  total = sum(sizes.values())
  pol = P.Policy(overrides=P.parse_overrides([".*"]) if force_all else ())
  budget = total if force_all else int(frac * total)
  p = P.plan(cfg, decls, sizes, budget, pol)
  for u, k in zip(p.units, p.kinds):
    if u.role in NEVER:
      assert k == DEVICE, u
    elif force_all:
      assert k == HOST, u


@settings(max_examples=30, deadline=None)
@given(names, fractions, st.integers(0, 2**31))
def test_deterministic(name, frac, seed):
  cfg, decls, sizes = jittered(name, seed)
  budget = int(frac * sum(sizes.values()))
  items = list(sizes.items())
  random.Random(seed).shuffle(items)
  a = P.plan(cfg, decls, sizes, budget)
  b = P.plan(cfg, decls, dict(items), budget)  # mapping order does not matter
  assert a.kinds == b.kinds and a.order == b.order
  assert dict(a.placement) == dict(b.placement)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 39), st.integers(0, 39), fractions)
def test_overrides_honoured_and_counted(l_host, l_dev, frac):
  cfg, decls, sizes = model("qwen36_35b")
  specs = [rf"blk\.{l_host}\.ffn_(gate|up|down)_exps=host", rf"blk\.{l_dev}\.=device", "embed=device"]
  pol = P.Policy(overrides=P.parse_overrides(specs))
  forced = sum(sizes[(n, l_host)] for n in ("moe.w_gate", "moe.w_up", "moe.w_down"))
  total = sum(sizes.values())
  budget = forced + int(frac * (total - forced))
  p = P.plan(cfg, decls, sizes, budget, pol)
  assert p.forced_host_bytes == forced
  assert p.host_bytes <= budget
  for u, k in zip(p.units, p.kinds):
    if u.layer == l_host and u.role is Role.ROUTED_EXPERTS:
      assert k == HOST  # first match wins, even where layer l_dev == l_host
    elif (u.layer == l_dev and u.offloadable) or u.name == "embed":
      assert k == DEVICE
  if forced > 0:
    with pytest.raises(JaxvtError, match="forces .* GiB into the host tier"):
      P.plan(cfg, decls, sizes, forced - 1, pol)


@settings(max_examples=30, deadline=None)
@given(names, st.integers(0, 2**31))
def test_steps_are_the_budgets_where_the_plan_changes(name, seed):
  cfg, decls, sizes = jittered(name, seed)
  for layers in ("first", "last"):  # exactly the order's prefix
    p = P.plan(cfg, decls, sizes, 0, P.Policy(layers=layers))
    steps = p.steps()
    assert steps[-1] == p.max_useful_budget == p.total_bytes - sum(
        u.nbytes for u in p.units if not u.offloadable)
    i = random.Random(seed).randrange(len(steps))
    q = p.rebudget(steps[i])
    assert host_set(q) == {p.units[j].unit for j in p.order[:i]}
    if i:  # one byte less and the i-th unit no longer fits (jittered sizes are >= 1)
      assert host_set(p.rebudget(steps[i] - 1)) == {p.units[j].unit for j in p.order[:i - 1]}
  p = P.plan(cfg, decls, sizes, 0)  # "spread": the same ranks, as many whole layers
  i = random.Random(seed).randrange(len(p.steps()))
  q = p.rebudget(p.steps()[i])
  assert q.host_bytes <= p.steps()[i]
  check_rank_prefix(q, p.steps()[i])


def test_totals_add_up():
  for name in CONFIGS:
    p = base_plan(name).rebudget(GiB // 20)
    t = p.totals()
    assert sum(n for n, _ in t.values()) == len(p.units)
    assert sum(b for (_, k), (_, b) in t.items() if k == HOST) == p.host_bytes
    assert sum(b for (_, k), (_, b) in t.items() if k == DEVICE) == p.device_bytes


# ---------------------------------------------------------------------------------------------
# Inputs and errors


def test_parse_overrides():
  ovs = P.parse_overrides(["exps", r"blk\.1[0-9]\.=device", "a=b=host", "x{1,3}=device"])
  assert [(o.pattern, o.kind) for o in ovs] == [
      ("exps", HOST), (r"blk\.1[0-9]\.", DEVICE), ("a=b", HOST), ("x{1,3}", DEVICE)]
  with pytest.raises(JaxvtError, match="not a regular expression"):
    P.parse_overrides(["(unclosed=host"])
  with pytest.raises(JaxvtError, match="empty pattern"):
    P.parse_overrides(["=host"])


def test_override_matching_nothing_offloadable_is_an_error():
  cfg, decls, sizes = model("qwen36_35b")
  for spec in ("norm", "no_such_tensor=device"):
    with pytest.raises(JaxvtError, match="matches no offloadable weight"):
      P.plan(cfg, decls, sizes, GiB, P.Policy(overrides=P.parse_overrides([spec])))


def test_bad_budget_and_sizes():
  cfg, decls, sizes = model("smollm2_135m")
  with pytest.raises(JaxvtError, match="negative"):
    P.plan(cfg, decls, sizes, -1)
  missing = dict(sizes)
  del missing[("attn.wq", 0)]
  with pytest.raises(ValueError, match="no byte size"):
    P.plan(cfg, decls, missing, 0)
  with pytest.raises(ValueError, match="undeclared"):
    P.plan(cfg, decls, {**sizes, ("bogus", 0): 1}, 0)
  with pytest.raises(ValueError, match="every offloadable role"):
    P.Policy(order=((Role.EMBEDDING,),))
  with pytest.raises(JaxvtError, match="batch"):
    P.Policy(batch=0)


def test_ceil_gib_never_below():
  for n in (0, 1, GiB, 6 * GiB + 1, 4060938240):
    g = P.ceil_gib(n)
    assert int(g * GiB) >= n and g - 0.1 < n / GiB + 1e-12


def test_row_bytes_is_the_one_table():
  """The planner sizes rows with jaxvt.gguf.formats, the table jaxvt.gguf.quants also uses."""
  from jaxvt.gguf import formats, quants
  assert P.row_bytes is formats.row_bytes and quants.FORMATS is formats.FORMATS
  for t in (0, 1, 2, 3, 8, 12, 13, 14, 30):
    for c in (256, 2048, 576):
      try:
        want = quants.row_bytes(t, c)
      except JaxvtError:
        with pytest.raises(JaxvtError):
          P.row_bytes(t, c)
      else:
        assert P.row_bytes(t, c) == want