"""The offload sweep's rows, its budget points, its table, its goal verdicts and its plot.

Pure functions over `Run` rows (no JAX, no GPU), so tests check them on synthetic rows. The
goals: decode ms/token <= 1.15x the roofline at every safe budget; the plan's predicted ms within
15% of the measured at every safe budget; tok/s never rising with the
budget inside the safe range; `--offload-gb auto` within 5% of the best safe point; jaxvt >= 2x
JAX's pinned_host arm; prefill with offload >= 50% of all-device; and the jaxvt / llama.cpp
ratios of decode and prefill (`peer_goals`).
"""

from __future__ import annotations

import dataclasses
import math

ROOFLINE_MAX = 1.15
AUTO_WITHIN = 0.05
PINNED_MIN = 2.0
PREFILL_MIN = 0.5
PREDICT_WITHIN = 0.15  # the cost model's prediction of decode ms against the measured
NOISE = 0.01  # a rise of tok/s below this fraction counts as measurement noise (and is listed)


@dataclasses.dataclass
class Run:
  arm: str  # device | jaxvt | jax_pinned | jaxvt@experts | llama.cpp ...
  budget_gib: float
  ok: bool
  note: str = ""
  safe: bool = True
  forced: bool = False  # a budget below the planner's smallest safe one, run with force
  auto: bool = False  # placed by --offload-gb auto
  point: str = ""  # the sweep point this row measured (arm:budget)
  host_gib: float = 0.0
  host_mb_per_token: float = 0.0
  """MB read from the host tier per decode token (the plan's reckoning)."""
  device_read_gb: float = 0.0
  prefill_tok_s: float = 0.0
  decode_tok_s: float = 0.0
  gen_tokens: int = 0
  predicted_ms: float = 0.0
  """The plan's predicted decode ms per token (jaxvt's cost model)."""
  peak_gib: float = 0.0
  """The process's peak so far (one process serves the whole sweep)."""
  in_use_gib: float = 0.0
  pool_gib: float = 0.0
  open_s: float = 0.0
  load_s: float = 0.0
  compile_s: float = 0.0
  """The warm-up generate: compiles prefill and decode, runs them once."""
  measure_s: float = 0.0
  prefill16_tok_s: float = 0.0
  """A warm 16-token prompt (the device arm; llama-bench -p 16)."""
  # llama.cpp arms with experts on the CPU: decode tok/s of each separate llama-bench call
  # (decode_tok_s is their median; offload_llama.DECODE_CALLS)
  decode_samples: list = dataclasses.field(default_factory=list)

  @property
  def ms(self) -> float:
    return 1e3 / self.decode_tok_s if self.decode_tok_s else 0.0

  def roofline_ms(self, rates: dict) -> float:
    """Host bytes / DMA rate + device bytes / device copy rate, per token (0 if unknown)."""
    dma, hbm = rates.get("dma", 0.0), rates.get("hbm", 0.0)
    if not (dma and hbm) or self.arm.startswith("llama"):
      return 0.0
    return (self.host_mb_per_token * 1e6 / (dma * 1e9) + self.device_read_gb / hbm) * 1e3

  @property
  def host_gbs(self) -> float:
    """Host bytes read per second of decode."""
    return self.host_mb_per_token * 1e6 * self.decode_tok_s / 1e9


# ---- the points of a sweep ------------------------------------------------------------------

def spread(xs: list) -> list:
  """xs reordered so that every prefix covers the range evenly (midpoints first)."""
  out, spans = [], [(0, len(xs))]
  while spans:
    nxt = []
    for lo, hi in spans:
      if lo >= hi:
        continue
      mid = (lo + hi) // 2
      out.append(xs[mid])
      nxt += [(lo, mid), (mid + 1, hi)]
    spans = nxt
  return out


def budgets(safe: float, top: float, step: float = 1.0) -> tuple[list[float], list[float]]:
  """(safe budgets from the smallest safe one to `top` in steps <= `step` GiB, forced unsafe
  budgets below it: safe-1 and safe-0.5 where > 0)."""
  lo = math.ceil(safe * 100) / 100 if safe > 0 else 0.0
  top = max(round(top, 2), lo)
  out = [lo]
  b = math.floor(lo / step) * step + step
  while b < top - 1e-6:
    out.append(round(b, 2))
    b += step
  if top > lo:
    out.append(top)
  unsafe = [round(lo - d, 2) for d in (1.0, 0.5) if lo - d > 0]
  return out, unsafe


def plan_points(safe: float, top: float, step: float = 1.0,
                auto: float | None = None) -> list[tuple]:
  """(arm, budget, forced) in run order: auto, every routed expert in the host tier (llama.cpp's
  `-ot exps=CPU`), the smallest safe budget (unless auto placed exactly that: `auto` is its host
  GiB), everything, the forced unsafe budgets, JAX's pinned_host arm on the routed experts,
  then the budgets between, spread."""
  safe_b, unsafe = budgets(safe, top, step)
  pts = [("jaxvt", "auto", False), ("jaxvt@experts", "experts", False)]
  if auto is None or abs(auto - safe) > 1e-6:
    pts.append(("jaxvt", safe_b[0], False))
  if len(safe_b) > 1:
    pts.append(("jaxvt", safe_b[-1], False))
  pts += [("jaxvt", b, True) for b in sorted(unsafe, reverse=True)]
  pts.append(("jax_pinned", "experts", False))
  pts += [("jaxvt", b, False) for b in spread(safe_b[1:-1])]
  return pts


# ---- verdicts --------------------------------------------------------------------------------

def _sweep(runs: list[Run]) -> list[Run]:
  """jaxvt's measured safe points, one per budget (auto's row stands for its budget too)."""
  by = {}
  for r in runs:
    if r.arm == "jaxvt" and r.ok and r.safe and not r.forced:
      by.setdefault(round(r.budget_gib, 2), r)
  return [by[k] for k in sorted(by)]


def goals(runs: list[Run], rates: dict) -> list[tuple[str, str, str]]:
  """(goal, verdict MET / MISSED / NOT RUN, the numbers) for each goal of the sweep itself."""
  sw = _sweep(runs)
  out = []
  ratios = [(r.budget_gib, r.ms / r.roofline_ms(rates)) for r in sw if r.roofline_ms(rates)]
  if ratios:
    worst = max(x for _, x in ratios)
    out.append((f"decode ms/token <= {ROOFLINE_MAX}x roofline at every safe budget",
                "MET" if worst <= ROOFLINE_MAX else "MISSED",
                f"worst {worst:.2f}x; " + ", ".join(f"{b:.2f} GiB {x:.2f}x" for b, x in ratios)))
  else:
    out.append(("decode <= 1.15x roofline", "NOT RUN", "no safe point or no same-run rates"))
  preds = [(r.budget_gib, r.predicted_ms / r.ms - 1) for r in sw if r.predicted_ms and r.ms]
  if preds:
    worst = max(abs(x) for _, x in preds)
    out.append((f"the plan's predicted decode within {PREDICT_WITHIN:.0%} of the measured rate "
                "at every safe budget", "MET" if worst <= PREDICT_WITHIN else "MISSED",
                f"worst {worst:.1%}; " + ", ".join(f"{b:.2f} GiB {x:+.1%}" for b, x in preds)))
  if len(sw) >= 2:
    rises = [(a.budget_gib, b.budget_gib, b.decode_tok_s / a.decode_tok_s - 1)
             for a, b in zip(sw, sw[1:]) if b.decode_tok_s > a.decode_tok_s]
    big = [x for x in rises if x[2] > NOISE]
    txt = ", ".join(f"{a:.2f}->{b:.2f} GiB +{x:.1%}" for a, b, x in rises) or "none"
    out.append(("decode tok/s never rises as the budget rises (safe range)",
                "MISSED" if big else "MET",
                f"{len(sw)} safe points; rises: {txt} (rises under {NOISE:.0%} count as noise)"))
  else:
    out.append(("tok/s never rises with the budget", "NOT RUN", f"{len(sw)} safe point(s)"))
  auto = next((r for r in runs if r.arm == "jaxvt" and r.auto and r.ok), None)
  if auto and sw:
    best = max(sw, key=lambda r: r.decode_tok_s)
    gap = 1 - auto.decode_tok_s / best.decode_tok_s
    out.append((f"--offload-gb auto within {AUTO_WITHIN:.0%} of the best safe point",
                "MET" if gap <= AUTO_WITHIN else "MISSED",
                f"auto {auto.budget_gib:.2f} GiB {auto.decode_tok_s:.2f} tok/s; best "
                f"{best.budget_gib:.2f} GiB {best.decode_tok_s:.2f} tok/s ({gap:+.1%} below)"))
  else:
    out.append(("auto within 5% of best", "NOT RUN", "auto or the sweep did not run"))
  pin = next((r for r in runs if r.arm == "jax_pinned" and r.ok), None)
  same = next((r for r in runs if r.arm == "jaxvt@experts" and r.ok), None)
  if pin and same and pin.decode_tok_s:
    x = same.decode_tok_s / pin.decode_tok_s
    out.append((f"jaxvt decode >= {PINNED_MIN:g}x JAX pinned_host (same placement)",
                "MET" if x >= PINNED_MIN else "MISSED",
                f"{same.decode_tok_s:.2f} vs {pin.decode_tok_s:.2f} tok/s = {x:.1f}x "
                f"({same.host_gib:.2f} GiB of experts offloaded)"))
  else:
    out.append(("jaxvt >= 2x pinned_host", "NOT RUN", "the pinned_host pair did not run"))
  dev = next((r for r in runs if r.arm == "device" and r.ok), None)
  off = [r for r in sw if r.host_gib > 0]
  if dev and off and dev.prefill_tok_s:
    worst = min(off, key=lambda r: r.prefill_tok_s)
    ratio = worst.prefill_tok_s / dev.prefill_tok_s
    at_auto = f"; at auto {auto.prefill_tok_s / dev.prefill_tok_s:.0%}" if auto else ""
    out.append((f"prefill with offload >= {PREFILL_MIN:.0%} of all-device",
                "MET" if ratio >= PREFILL_MIN else "MISSED",
                f"lowest {worst.prefill_tok_s:.1f} tok/s at {worst.budget_gib:.2f} GiB = "
                f"{ratio:.0%} of {dev.prefill_tok_s:.1f}{at_auto}"))
  else:
    out.append(("prefill >= 50% of all-device", "NOT RUN",
                "the device arm or the sweep is missing"))
  return out


def _ratio_goal(goal: str, a: Run | None, b: Run | None, key: str, least: float,
                what: str) -> tuple[str, str, str]:
  """`goal` met when a.key / b.key >= least (both rows measured in this run)."""
  x, y = (getattr(a, key) if a else 0.0), (getattr(b, key) if b else 0.0)
  if not (x and y):
    return goal, "NOT RUN", f"{what}: a row is missing or failed"
  q = x / y
  digits = 3 if q < least <= round(q, 2) else 2  # a miss that two decimals would round away
  text = f"{x:.1f} vs {y:.1f} tok/s = {q:.{digits}f}x ({what})"
  calls = b.decode_samples if key == "decode_tok_s" else []
  if len(calls) > 1:  # the denominator is a median of calls: their spread, and the ratio's
    lo, hi = min(calls), max(calls)
    text += (f"; llama.cpp's median of {len(calls)} calls, {lo:.1f}-{hi:.1f} tok/s: "
             f"{x / hi:.2f}-{x / lo:.2f}x")
  return goal, "MET" if q >= least else "MISSED", text


def peer_goals(runs: list[Run]) -> list[tuple[str, str, str]]:
  """Decode and prefill: jaxvt / llama.cpp ratios from the same run's rows.
  Pairs: all in HBM with `-ngl 99`; `--offload-gb auto` with `--n-cpu-moe N`; every routed
  expert in the host tier (jaxvt@experts) with `-ot exps=CPU`."""
  ok = [r for r in runs if r.ok]
  one = lambda f: next((r for r in ok if f(r)), None)
  dev = one(lambda r: r.arm == "device")
  auto = one(lambda r: r.arm == "jaxvt" and r.auto)
  exps = one(lambda r: r.arm == "jaxvt@experts")
  ngl = one(lambda r: r.point == "llama.cpp:-ngl 99")
  ncm = one(lambda r: r.point.startswith("llama.cpp:-ngl 99 --n-cpu-moe"))
  ot = one(lambda r: r.point == "llama.cpp:-ngl 99 -ot exps=CPU")
  lab = lambda r, d: r.point.split(":", 1)[1] if r else d
  return [
      _ratio_goal("decode, all in HBM >= 1.0x llama.cpp", dev, ngl, "decode_tok_s", 1.0,
                  lab(ngl, "-ngl 99")),
      _ratio_goal("decode at auto >= 1.3x llama.cpp", auto, ncm, "decode_tok_s", 1.3,
                  lab(ncm, "--n-cpu-moe")),
      _ratio_goal("decode, every routed expert in the host tier >= 1.2x llama.cpp", exps, ot,
                  "decode_tok_s", 1.2, lab(ot, "-ot exps=CPU")),
      _ratio_goal("prefill, all in HBM >= 1.0x llama.cpp", dev, ngl, "prefill_tok_s", 1.0,
                  lab(ngl, "-ngl 99")),
      _ratio_goal("prefill at auto >= 0.9x jaxvt all in HBM", auto, dev, "prefill_tok_s", 0.9,
                  "auto vs the device arm"),
      _ratio_goal("prefill at auto >= 1.5x llama.cpp", auto, ncm, "prefill_tok_s", 1.5,
                  lab(ncm, "--n-cpu-moe")),
      _ratio_goal("prefill, every routed expert in the host tier >= 2x llama.cpp", exps, ot,
                  "prefill_tok_s", 2.0, lab(ot, "-ot exps=CPU")),
      _ratio_goal("warm 16-token prefill within 2x of llama.cpp's time (>= 0.5x its tok/s)",
                  dev, ngl, "prefill16_tok_s", 0.5, lab(ngl, "-ngl 99") + ", -p 16"),
  ]


# ---- the markdown and the plot ---------------------------------------------------------------

def _row(r: Run, rates: dict) -> str:
  roof = r.roofline_ms(rates)
  x = f"{r.ms / roof:.2f}" if roof and r.ms else ""
  safe = "forced" if r.forced else ("yes" if r.safe else "NO")
  arm = r.arm + (" (auto)" if r.auto else "")
  t = f"{r.load_s:.0f}/{r.compile_s:.0f}/{r.measure_s:.0f}" if r.load_s else ""
  mem = f"{r.peak_gib:.2f}/{r.pool_gib:.2f}" if r.pool_gib else ""
  return (f"| {arm} | {r.budget_gib:.2f} | {safe} | {r.host_gib:.2f} | {r.host_mb_per_token:.0f} | "
          f"{r.host_gbs:.1f} | {r.prefill_tok_s:.1f} | {r.decode_tok_s:.2f} | {r.ms:.1f} | "
          f"{r.predicted_ms:.1f} | {roof:.1f} | {x} | {t} | {mem} | {r.note} |")


def render(runs: list[Run], rates: dict, frac: str, model_gib: float, args, machine: str,
           date: str, total_s: float = 0.0, skipped: list[str] = (), layers: int = 40,
           notes: list[str] = ()) -> str:
  """The markdown section of a sweep: setup, table (budget order), goal verdicts."""
  dma, hbm = rates.get("dma", 0.0), rates.get("hbm", 0.0)
  llama = f" --llama-bench {args.llama_bench}" if getattr(args, "llama_bench", None) else ""
  lines = ["## Offload sweep: Qwen3.6-35B-A3B-shaped model in an emulated 16 GiB card\n",
           f"Command: `python -m benchmarks.offload --time-limit {args.time_limit}{llama}` "
           f"({total_s:.0f} s in all; on the GPU machine `bash tools/gpu_session.sh sweep`, "
           "llama-bench from `tools/build_llamacpp.sh`)  ", f"Machine: {machine}  ",
           f"Date: {date}\n",
           f"Model: {model_gib:.2f} GiB file (Q4_K_M-like synthetic weights, {layers} trunk layers "
           f"+ MTP block). 16 GiB card: XLA pool fraction {frac}, --device-gb {args.device_gb:g}. "
           f"Same run: DMA host->device {dma:.1f} GB/s, device copy {hbm:.0f} GB/s. Prompt "
           f"{args.prompt} tokens then {args.gen} greedy tokens (the JAX pinned_host arm: its "
           "row's token count); prefill tok/s: the median of three warm prompts. Roofline = "
           "host bytes/DMA + device bytes/device copy rate. "
           "safe: the planner's verdict; forced: below the smallest safe budget, run with "
           "--force. Times: load (placement + upload; host copies are made once per process) / "
           "compile + warm-up generate / timed generate, seconds. peak: the sweep process's "
           "peak so far. llama.cpp rows: llama-bench tg (decode, from an empty context) and pp "
           "(prefill), each the mean of its two runs (-r 2); with experts on the CPU, decode is "
           "the median of separate calls (their rates drift from call to call); their budget is "
           "the GiB of experts computed on the CPU.\n",
           "| arm | budget GiB | safe | host GiB | host MB/tok | host GB/s | prefill tok/s | "
           "decode tok/s | ms/tok | predicted ms | roofline ms | x roofline | load/compile/"
           "measure s | peak/pool GiB | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  order = {"device": 0, "jaxvt": 1, "jaxvt@experts": 2, "jax_pinned": 3}
  for r in sorted(runs, key=lambda r: (order.get(r.arm, 4), r.arm, r.budget_gib)):
    lines.append(_row(r, rates))
  if skipped:
    lines.append(f"\nNot run (the time limit came first): {', '.join(skipped)}.")
  lines += [f"\nNote: {n}." for n in notes]
  lines.append("\nGoals, from the rows above:\n")
  lines += [f"- {g}: **{v}** ({n})" for g, v, n in goals(runs, rates)]
  lines.append("\nAgainst llama.cpp (jaxvt / llama.cpp, rows of this run; the device "
               "arm's 16-token prompt and llama-bench -p 16 warm):\n")
  lines += [f"- {g}: **{v}** ({n})" for g, v, n in peer_goals(runs)]
  return "\n".join(lines)


def plot(runs: list[Run], path: str) -> bool:
  """Decode and prefill tok/s against the offload budget, one line or marker per arm."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  fig, axes = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
  sw = sorted([r for r in runs if r.arm == "jaxvt" and r.ok and not r.forced],
              key=lambda r: r.budget_gib)
  forced = [r for r in runs if r.arm == "jaxvt" and r.forced]
  auto = [r for r in sw if r.auto]
  others = [r for r in runs if r.ok and r.arm not in ("jaxvt", "device")]
  style = {"jax_pinned": ("s", "C2", "JAX pinned_host (device_put per layer)"),
           "jaxvt@experts": ("D", "C3", "jaxvt, same placement as pinned_host")}
  llama = sorted({r.note.split(";")[0] for r in others if r.arm == "llama.cpp"})
  for i, lab in enumerate(llama):
    style["llama.cpp " + lab] = ("^v<>"[i % 4], f"C{4 + i}", "llama.cpp " + lab)
  for ax, key, name in ((axes[0], "decode_tok_s", "decode tok/s"),
                        (axes[1], "prefill_tok_s", "prefill tok/s")):
    val = lambda r: getattr(r, key) if r.ok else 0.0
    if sw:
      ax.plot([r.budget_gib for r in sw], [val(r) for r in sw], "o-", color="C0",
              label="jaxvt measured")
      if key == "decode_tok_s":
        ax.plot([r.budget_gib for r in sw], [1e3 / r.predicted_ms if r.predicted_ms else 0
                                             for r in sw], "x--", color="C1",
                label="jaxvt predicted")
    if forced:
      ax.plot([r.budget_gib for r in forced], [val(r) for r in forced], "X", color="red", ms=10,
              ls="none", label="jaxvt forced below the safe range (0 = failed)")
    if auto:
      ax.plot([auto[0].budget_gib], [val(auto[0])], "*", ms=15, color="gold",
              label="--offload-gb auto")
    for r in runs:
      if r.arm == "device" and r.ok:
        ax.axhline(val(r), ls=":", color="gray", label="all weights on the device (no cap)")
    for r in others:
      k = r.arm if r.arm in style else "llama.cpp " + r.note.split(";")[0]
      m, c, lab = style.get(k, ("^", "C9", r.arm))
      ax.plot([r.budget_gib], [val(r)], m, color=c, ms=8, ls="none", label=lab)
    ax.set_ylabel(name)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7, loc="best")
  axes[1].set_xlabel("offload budget: GiB in the host tier (llama.cpp: GiB of experts on the CPU)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True
