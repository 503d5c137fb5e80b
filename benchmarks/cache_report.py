"""The expert-cache benchmark's rows, its points, its llama.cpp pairing, its goals and its table.

Pure functions over `Row`s (no JAX, no GPU), so tests check them on fabricated rows. The goals
(decode tok/s, rows of one run):

- realistic routing, 7 GiB in the host tier: the cache (each policy) >= 1.25x cache off;
- realistic routing, every budget: the cache never slower than cache off (a loss under NOISE
  counts as measurement noise, and is listed);
- realistic routing, 7 GiB: jaxvt with the cache >= 1.6x llama.cpp with the same bytes of routed
  experts on the CPU (`--n-cpu-moe N`);
- uniform routing, 7 GiB: the cache costs at most 2%.

`prediction` decides, from the 7 GiB arms, whether the predicted-experts ring pays with the cache
and without it.
"""

from __future__ import annotations

import dataclasses
import zlib

from jaxvt import JaxvtError

GiB = 1 << 30
MODELS = ("realistic", "high-locality", "uniform")
BUDGETS = ("auto", "7", "12", "experts")  # experts: every routed expert in the host tier
PREDICT_BUDGET = "7"  # where the prediction arms and the uniform file run
# arm -> (cache policy, None without a cache; prediction: the product's default, off, flipped)
ARMS = {"off": (None, "default"), "lru": ("lru", "default"), "lfru": ("lfru", "default"),
        "off-nopred": (None, "off"), "lru-flip": ("lru", "flip")}
GROUPS = {"cache": ("off", "lru", "lfru"), "predict": ("off-nopred", "lru-flip"),
          "jaxvt": tuple(ARMS), "llama": ("llama",)}
LLAMA = "llama.cpp"
SPEEDUP_MIN = 1.25  # the cache at 7 GiB against cache off
LLAMA_MIN = 1.6  # jaxvt with the cache at 7 GiB against llama.cpp at the same expert bytes
UNIFORM_COST = 0.02  # the most the cache may cost on uniform routing
NOISE = 0.01  # a loss below this fraction of cache off's rate counts as measurement noise


@dataclasses.dataclass
class Row:
  model: str  # realistic | high-locality | uniform
  budget: str  # auto | 7 | 12 | experts (the point's label)
  arm: str  # a key of ARMS, or llama.cpp
  ok: bool = False
  note: str = ""
  host_gib: float = 0.0
  """Weights in the host tier (llama.cpp: routed experts computed on the CPU)."""
  expert_gib: float = 0.0
  """Routed experts in the host tier: what llama.cpp's arm of the budget puts on the CPU."""
  policy: str = ""  # lru | lfru; "" without a cache
  predict: str = ""  # the predicted-experts rings: "H/D" (after a host / device layer) or "off"
  cache_gib: float = 0.0
  slots: int = 0  # cache slots per cached layer
  cached_layers: int = 0
  hits: int = 0  # routed-expert reads of cached layers during the timed decode
  misses: int = 0
  hit_bytes: int = 0
  miss_bytes: int = 0
  host_mb_per_token: float = 0.0
  """MB read over the bus per decode token: the plan's host-tier reads, with the cached layers'
  routed experts replaced by the cache's measured misses."""
  decode_tok_s: float = 0.0
  gen_tokens: int = 0
  tokens: int = 0  # crc32 of the timed decode's tokens (the same in every arm of a model)
  load_s: float = 0.0
  compile_s: float = 0.0  # the warm-up decode: compiles, fills the cache
  measure_s: float = 0.0
  flags: str = ""  # llama.cpp's flags
  # each timed decode's tok/s (jaxvt: one a prompt; llama.cpp: one a llama-bench call, whose
  # median is decode_tok_s)
  decode_samples: list = dataclasses.field(default_factory=list)
  earlier: bool = False  # from an earlier call's rows (--merge)

  @property
  def key(self) -> tuple[str, str, str]:
    return self.model, self.budget, self.arm

  @property
  def hit_rate(self) -> float | None:
    n = self.hits + self.misses
    return self.hits / n if n else None


def tokens_crc(tokens: list[int]) -> int:
  """A fingerprint of a token sequence (rows compare it across arms)."""
  return zlib.crc32(",".join(map(str, tokens)).encode())


# ---- what to run ------------------------------------------------------------------------------

def _items(text: str, what: str) -> list[str]:
  out = [x.strip() for x in text.split(",") if x.strip()]
  if not out:
    raise JaxvtError(f"--{what} is empty; pass a comma-separated list")
  return out


def parse_budgets(text: str) -> list[str]:
  """--budgets: auto, experts or GiB (> 0), comma-separated; GiB written as the label (7, 12.5)."""
  out = []
  for b in _items(text, "budgets"):
    if b not in ("auto", "experts"):
      try:
        gib = float(b)
      except ValueError:
        gib = -1.0
      if not gib > 0:
        raise JaxvtError(f"--budgets: {b!r} is not auto, experts or a positive number of GiB")
      b = f"{gib:g}"
    if b not in out:
      out.append(b)
  return out


def parse_arms(text: str) -> list[str]:
  """--arms: arm names (ARMS, llama) or groups (GROUPS), comma-separated; ARMS order."""
  out = set()
  for a in _items(text, "arms"):
    if a not in ARMS and a not in GROUPS:
      raise JaxvtError(f"--arms: no arm {a!r}; choose from {', '.join([*GROUPS, *ARMS])}")
    out.update(GROUPS.get(a, (a,)))
  return [a for a in (*ARMS, "llama") if a in out]


def parse_models(text: str) -> list[str]:
  out = _items(text, "models")
  bad = [m for m in out if m not in MODELS]
  if bad:
    raise JaxvtError(f"--models: no model {bad[0]!r}; choose from {', '.join(MODELS)}")
  return [m for m in MODELS if m in out]


def plan_points(models: list[str], budgets: list[str],
                arms: list[str]) -> list[tuple[str, str, str]]:
  """(model, budget, arm) of the jaxvt arms in run order, most telling first: the realistic file
  at 7 GiB (the cache arms, then the prediction arms), its other budgets' cache arms in the
  order given, then the high-locality and the uniform file at 7 GiB (cache off and LRU)."""
  cache = [a for a in GROUPS["cache"] if a in arms]
  pts = []
  if "realistic" in models:
    first = [PREDICT_BUDGET] if PREDICT_BUDGET in budgets else []
    for b in first + [b for b in budgets if b != PREDICT_BUDGET]:
      pts += [("realistic", b, a) for a in cache]
      if b == PREDICT_BUDGET:
        pts += [("realistic", b, a) for a in GROUPS["predict"] if a in arms]
  for m in ("high-locality", "uniform"):
    if m in models and PREDICT_BUDGET in budgets:
      pts += [(m, PREDICT_BUDGET, a) for a in ("off", "lru") if a in arms]
  return pts


def predict_plan(host: int, device: int, with_cache: bool | None, cached: bool, want: str,
                 on: tuple[int, int]) -> tuple[dict, str]:
  """The kernel rule's prediction fields an arm sets, and the prediction it then runs ("H/D":
  the predicted experts after a host-tier / a device layer, or "off").

  host, device: Products.predict_after_host / predict_after_device of the device's row;
  with_cache: its predict_with_cache (None where the rule has no such field: prediction runs
  beside a cache as without one); cached: the arm has a cache. want: "default" (as the row
  says), "off" (no prediction), "flip" (off where the default predicts; else on: `on`'s counts
  where the row has none, and predict_with_cache where a cache turned it off)."""
  def runs(h, d, wc) -> bool:
    return bool(h or d) and (not cached or wc is None or wc)

  changes = {}
  if want == "off" or (want == "flip" and runs(host, device, with_cache)):
    changes = dict(predict_after_host=0, predict_after_device=0)
  elif want == "flip":
    if not (host or device):
      changes.update(predict_after_host=on[0], predict_after_device=on[1])
    if cached and with_cache is False:
      changes["predict_with_cache"] = True
  h = changes.get("predict_after_host", host)
  d = changes.get("predict_after_device", device)
  return changes, f"{h}/{d}" if runs(h, d, changes.get("predict_with_cache", with_cache)) else "off"


def llama_configs(meta: dict, budgets: list[str], configs, has_ncmoe: bool) -> list[tuple]:
  """(label, flags, GiB of experts on the CPU, the budgets it pairs with) for llama.cpp: every
  routed expert (`-ot exps=CPU`) for `experts`, else `--n-cpu-moe N` with N layers' experts
  nearest the budget's routed-expert bytes in jaxvt's host tier (meta["budgets"][b]["expert_gib"]).
  `configs`: benchmarks.offload_llama.configs, which picks N for meta["auto"]. Budgets that share
  an N share one configuration."""
  out: dict[str, list] = {}
  for b in budgets:
    if b == "experts":
      label, flags, gib = configs(meta, False)[1]
    elif has_ncmoe and b in meta.get("budgets", {}):
      picked = configs(dict(meta, auto=meta["budgets"][b]["expert_gib"]), True)
      if len(picked) < 3:
        continue
      label, flags, gib = picked[2]
    else:
      continue
    out.setdefault(label, [label, flags, gib, []])[3].append(b)
  return [tuple(v) for v in out.values()]


def merge(now: list[Row], before: list[Row]) -> list[Row]:
  """This run's rows and an earlier call's rows of points this run did not measure (marked)."""
  have = {r.key for r in now}
  return now + [dataclasses.replace(r, earlier=True) for r in before if r.key not in have]


# ---- verdicts ---------------------------------------------------------------------------------

def _find(rows: list[Row], model: str, budget: str, arm: str) -> Row | None:
  return next((r for r in rows if r.key == (model, budget, arm) and r.ok and r.decode_tok_s),
              None)


def _margin(q: float, least: float) -> str:
  return f"{q / least - 1:+.1%} against the goal's {least:g}x"


def _ratio(goal: str, a: Row | None, b: Row | None, least: float, what: str) -> tuple:
  if not (a and b):
    return goal, "NOT RUN", f"{what}: a row is missing or failed"
  q = a.decode_tok_s / b.decode_tok_s
  return (goal, "MET" if q >= least else "MISSED",
          f"{a.decode_tok_s:.1f} vs {b.decode_tok_s:.1f} tok/s = {q:.3f}x, "
          f"{_margin(q, least)} ({what})")


def goals(rows: list[Row]) -> list[tuple[str, str, str]]:
  """(goal, MET / MISSED / NOT RUN, the numbers and the margin) for each goal."""
  out = []
  off7 = _find(rows, "realistic", PREDICT_BUDGET, "off")
  for pol in ("lru", "lfru"):
    out.append(_ratio(f"realistic, {PREDICT_BUDGET} GiB: decode with the cache ({pol.upper()}) "
                      f">= {SPEEDUP_MIN}x cache off", _find(rows, "realistic", PREDICT_BUDGET, pol),
                      off7, SPEEDUP_MIN, f"{pol.upper()} vs off"))
  pairs, none = [], []
  for b in dict.fromkeys(r.budget for r in rows if r.model == "realistic"):
    off = _find(rows, "realistic", b, "off")
    for pol in ("lru", "lfru"):
      if any(r.key == ("realistic", b, pol) and r.ok and not r.cache_gib for r in rows):
        none.append(f"{b} {pol.upper()}")  # placed without a cache: the off arm's program
        continue
      on = _find(rows, "realistic", b, pol)
      if off and on:
        pairs.append((b, pol, on.decode_tok_s / off.decode_tok_s))
  if pairs:
    worst = min(q for _, _, q in pairs)
    txt = ", ".join(f"{b} {p.upper()} {q:.3f}x" for b, p, q in pairs)
    if none:
      txt += "; no cache (no device memory left): " + ", ".join(none)
    out.append(("realistic, every budget: the cache never slower than cache off",
                "MET" if worst >= 1 - NOISE else "MISSED",
                f"worst {worst:.3f}x ({worst - 1:+.1%}; a loss under {NOISE:.0%} counts as "
                f"noise): {txt}"))
  else:
    out.append(("realistic, every budget: the cache never slower than cache off", "NOT RUN",
                "no budget has both a cache arm with a cache and cache off"))
  llama = {r.budget: r for r in rows if r.arm == LLAMA and r.ok and r.decode_tok_s}
  g = _ratio(f"realistic, {PREDICT_BUDGET} GiB: decode with the cache (LRU) >= {LLAMA_MIN}x "
             "llama.cpp at the same expert bytes",
             _find(rows, "realistic", PREDICT_BUDGET, "lru"), llama.get(PREDICT_BUDGET),
             LLAMA_MIN, llama[PREDICT_BUDGET].flags if PREDICT_BUDGET in llama else "llama.cpp")
  others = []
  for b, lr in llama.items():
    best = max((r for r in rows if r.model == "realistic" and r.budget == b and r.ok
                and r.arm in ("off", "lru", "lfru") and r.decode_tok_s),
               key=lambda r: r.decode_tok_s, default=None)
    if best and b != PREDICT_BUDGET:
      others.append(f"{b}: {best.arm} {best.decode_tok_s / lr.decode_tok_s:.2f}x ({lr.flags})")
  if others:
    g = (g[0], g[1], g[2] + "; other budgets, jaxvt's fastest arm: " + ", ".join(others))
  out.append(g)
  goal = f"uniform, {PREDICT_BUDGET} GiB: the cache (LRU) costs at most {UNIFORM_COST:.0%}"
  if any(r.key == ("uniform", PREDICT_BUDGET, "lru") and r.ok and not r.cache_gib for r in rows):
    out.append((goal, "NOT RUN", "the plan left no device memory for a cache"))
  else:
    lr, off = (_find(rows, "uniform", PREDICT_BUDGET, a) for a in ("lru", "off"))
    out.append(_ratio(goal, lr, off, 1 - UNIFORM_COST, "LRU vs off"))
  out.append(same_tokens(rows))
  return out


def same_tokens(rows: list[Row]) -> tuple[str, str, str]:
  """Every jaxvt row of a model decoded the same tokens (the cache and the rings change where
  experts are read from, never the bits)."""
  jx = [r for r in rows if r.ok and r.arm in ARMS and r.decode_tok_s]
  if not jx:
    return "the same tokens in every jaxvt arm of a model", "NOT RUN", "no jaxvt row"
  bad = []
  for m in dict.fromkeys(r.model for r in jx):
    mine = [r for r in jx if r.model == m]
    bad += [f"{m} {r.budget} {r.arm}" for r in mine if r.tokens != mine[0].tokens]
  return ("the same tokens in every jaxvt arm of a model", "MISSED" if bad else "MET",
          f"differ from the model's first row: {', '.join(bad)}" if bad else
          f"{len(jx)} rows, {len({r.model for r in jx})} model(s)")


def prediction(rows: list[Row]) -> list[str]:
  """The predicted-experts ring at 7 GiB on the realistic file, with and without the cache: its
  worth (on against off) and what to do with it."""
  b = PREDICT_BUDGET
  out = []
  for what, x, y in (("without the cache", "off", "off-nopred"), ("with the LRU cache", "lru",
                                                                   "lru-flip")):
    p, q = _find(rows, "realistic", b, x), _find(rows, "realistic", b, y)
    if not (p and q):
      out.append(f"{what}: NOT RUN ({x} or {y} is missing)")
      continue
    if p.predict == q.predict:
      out.append(f"{what}: both arms ran prediction {p.predict}: the flip changed nothing")
      continue
    on, off = (p, q) if p.predict != "off" else (q, p)
    gain = on.decode_tok_s / off.decode_tok_s - 1
    verdict = ("keep it: it pays" if gain > NOISE else "drop it: it costs" if gain < -NOISE
               else "drop it: no measurable gain for its bus bytes")
    hr = lambda r: f", hit rate {r.hit_rate:.1%}" if r.hit_rate is not None else ""
    out.append(f"{what}: prediction {on.predict} {on.decode_tok_s:.1f} tok/s "
               f"({on.host_mb_per_token:.0f} MB/tok{hr(on)}) vs off {off.decode_tok_s:.1f} tok/s "
               f"({off.host_mb_per_token:.0f} MB/tok{hr(off)}): {gain:+.1%}; {verdict} "
               f"(the default here: {p.predict})")
  return out


# ---- the markdown -------------------------------------------------------------------------------

def _cell(r: Row, off: dict) -> str:
  hr = f"{r.hit_rate:.1%}" if r.hit_rate is not None else ""
  base = off.get((r.model, r.budget))
  x = f"{r.decode_tok_s / base:.3f}" if base and r.decode_tok_s and r.arm != "off" else ""
  t = f"{r.load_s:.0f}/{r.compile_s:.0f}/{r.measure_s:.0f}" if r.load_s else ""
  if r.arm == LLAMA:
    t = f"{r.measure_s:.0f}" if r.measure_s else ""
  spread = (f" ({min(r.decode_samples):.1f}-{max(r.decode_samples):.1f})"
            if len(r.decode_samples) > 1 else "")
  slots = f"{r.slots} x {r.cached_layers}" if r.slots else ""
  note = "; ".join(s for s in (r.flags, r.note, "earlier call" if r.earlier else "") if s)
  return (f"| {r.model} | {r.budget} | {r.arm} | {r.policy} | {r.predict} | {r.host_gib:.2f} | "
          f"{r.expert_gib:.2f} | {r.cache_gib:.2f} | {slots} | {hr} | {r.host_mb_per_token:.0f} | "
          f"{r.decode_tok_s:.2f}{spread} | {x} | {t} | {note} |")


def table(rows: list[Row]) -> list[str]:
  """One line a row: model, then budget in BUDGETS order, then arm."""
  off = {(r.model, r.budget): r.decode_tok_s for r in rows if r.arm == "off" and r.ok}
  border = {b: i for i, b in enumerate(BUDGETS)}
  aorder = {a: i for i, a in enumerate((*ARMS, LLAMA))}
  rows = sorted(rows, key=lambda r: (MODELS.index(r.model) if r.model in MODELS else 9,
                                     border.get(r.budget, 5), aorder.get(r.arm, 9)))
  head = ["| model | budget | arm | policy | predict | host GiB | expert GiB | cache GiB | "
          "slots x layers | hit rate | host MB/tok | decode tok/s | x off | load/warm/measure s | "
          "note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  return head + [_cell(r, off) for r in rows]


def render(rows: list[Row], meta: dict, args, command: str, machine: str, date: str,
           total_s: float, skipped: list[str] = (), notes: list[str] = ()) -> str:
  """The `cache` section: command, machine, date, setup, the table, goals and the prediction."""
  lines = [
      "## Expert cache: routed experts of host-tier layers cached in spare device memory\n",
      f"Command: `{command}` ({total_s:.0f} s in all; on the "
      "GPU machine `bash tools/gpu_session.sh cache`, llama-bench from "
      "`tools/build_llamacpp.sh`)  ", f"Machine: {machine}  ", f"Date: {date}\n",
      f"Models: the Qwen3.6-35B-A3B-shaped file (Q4_K_M-like weights, 40 trunk layers + MTP "
      "block) written by jaxvt.synth with the same seed and three routings: `realistic` "
      "(`routing=jaxvt.synth_routing.PRESETS['realistic']`: a drifting working set calibrated "
      "to the LRU hit rates of real routing traces, next-token reuse and a capped skew; "
      "docs/BENCHMARKS.md `routing`), `high-locality` (`PRESETS['high-locality']`: real reuse "
      "from a few topics whose experts take about 0.84 of a decode's choices, so its hit rates "
      "are an upper end) and `uniform` (no routing targets: uniform, memoryless routing, the "
      "lower end). An emulated 16 GiB card (XLA pool "
      f"fraction {meta.get('frac', '?')}, --device-gb {args.device_gb:g}). Budgets: GiB in the "
      "host tier (`auto`: --offload-gb auto; `experts`: every routed expert, as `-ot "
      "exps=CPU`). Arms: `off` (--expert-cache-gb 0), `lru` / `lfru` (the cache takes the device "
      "memory the plan leaves free, that eviction policy), each with the product's default "
      "prediction (predict: the predicted-experts rings' experts after a host / a device "
      "layer); `off-nopred`: no cache, no prediction; `lru-flip`: the cache with prediction "
      f"flipped from its default. Each arm: a warm-up decode of {args.gen} tokens after another "
      f"prompt (compiles, fills the cache), then {args.repeats} timed decodes of {args.gen} "
      f"tokens, each after its own {args.prompt}-token prompt (the same in every arm), sampled "
      f"at temperature {args.temperature:g}; decode tok/s: all their tokens over all their time "
      "(in brackets: the slowest and fastest one). Hit rate and host MB/tok are the timed "
      "decodes' (the cache's counters); without a cache, host MB/tok is the plan's. x off: "
      "decode against the same file and budget's `off`. "
      f"llama.cpp: llama-bench tg{meta.get('llama_gen', '?')} (-r 2), the median of "
      "separate calls, with the same bytes of routed experts on the CPU (--n-cpu-moe N: N "
      "layers' experts nearest jaxvt's host-tier experts at that budget).\n", *table(rows)]
  if skipped:
    lines.append(f"\nNot run (time limit, or not asked for): {', '.join(skipped)}.")
  lines += [f"\nNote: {n}." for n in notes]
  lines.append("\nGoals, from the rows above:\n")
  lines += [f"- {g}: **{v}** ({n})" for g, v, n in goals(rows)]
  lines.append(f"\nPrediction (the predicted-experts rings), realistic file at {PREDICT_BUDGET} "
               "GiB:\n")
  lines += [f"- {p}" for p in prediction(rows)]
  return "\n".join(lines)
