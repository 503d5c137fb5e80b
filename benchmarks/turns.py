"""python -m benchmarks.turns: a short next turn and a batch's decode through the expert cache.

  python -m benchmarks.turns [--model PATH] [--budget 7] [--device-gb 16] [--conversation 2000]
                             [--turn 20] [--rows 8] [--steps 64] [--repeats 3] [--write]

The file (default: benchmarks.cache's realistic-routing 35B-shaped file, written when missing)
is loaded once, in a child process on an emulated --device-gb card (XLA's pool), at --budget GiB
in the host tier with the expert cache what the plan and --rows sequences leave free (as
jaxvt.serve sizes it for its batch). Two
kernel rules run side by side on the same placed weights, alternating, --repeats times after a
warm-up round:
  routed    the product's rule (engine.exec_for): a prefill of few tokens reads the routed
            experts its tokens need through the expert cache, filling it, as decode does
            (Products.routed_per_expert: jaxvt.offload.cost.routed_crossover);
  streamed  the same rule with routed_per_expert 0: such a prefill reads every expert its
            tokens and its padding route to over the bus (the grouped kernel, or whole layers
            copied ahead), and leaves the cache as it was.
Next turn: a --conversation-token prompt prefilled (the first turn, whose cache is kept), then
--turn more tokens prefilled after it, as prompt reuse runs them; its seconds against a prompt
of both lengths never seen, and the expert cache's counters around it. Batch (the product's
rule): --steps greedy decode steps of 1 row and of --rows rows (each its own prompt); tokens/s
and their ratio, and per step the cache's misses (one per slot routed to a missed expert: what
each row reading its own experts would read) against its fills (each distinct missed expert,
read over the bus once). Medians are reported. `--write` writes the `turns` section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxvt
from benchmarks import report
from benchmarks.cache import REALISTIC
from benchmarks.cli import child_env, parser_of, run
from benchmarks.offload import ensure_model, pool_fraction
from jaxvt import SamplingParams, engine
from jaxvt.synth_routing import PRESETS

GREEDY = SamplingParams()
GOAL_TURN, GOAL_ROWS = 0.25, 3.0  # next turn / fresh prompt at most; rows / one row at least


def parser():
  ap = parser_of("turns", __doc__, child=int)
  ap.add_argument("--model", default=REALISTIC,
                  help="GGUF file (default: the realistic-routing file, written if missing)")
  ap.add_argument("--budget", default="7", help="--offload-gb: GiB in the host tier")
  ap.add_argument("--device-gb", type=float, default=16.0, help="the emulated card's GiB")
  ap.add_argument("--expert-cache-gb", default="auto")
  ap.add_argument("--conversation", type=int, default=2000)
  ap.add_argument("--turn", type=int, default=20)
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--steps", type=int, default=64, help="decode steps of each batch arm")
  ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of each batch row")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--write", action="store_true")
  return ap


def _counts(d) -> dict:
  return {} if d is None else dict(hits=d.hits, misses=d.misses, fills=d.fills,
                                   miss_bytes=d.host_bytes, fill_bytes=d.fill_bytes)


def _delta(eng, before) -> dict:
  after = engine.expert_cache_stats(eng.weights)
  return _counts(None if after is None else after - before)


def _timed_prefill(eng, ids: list[int], cache=None, start: int = 0):
  t = time.perf_counter()
  logits, cache = eng.prefill(ids, cache, start)
  jax.block_until_ready(logits)
  return time.perf_counter() - t, cache


def next_turn(eng, conv: list[int], turn: list[int], fresh: list[int]) -> dict:
  """The first turn (conv) prefilled, then `turn` after it, timed; `fresh` (as long as both)
  timed from an empty cache. (seconds, and the expert cache's counters around the turn)"""
  _, cache = _timed_prefill(eng, conv)
  before = engine.expert_cache_stats(eng.weights)
  turn_s, cache = _timed_prefill(eng, turn, cache, len(conv))
  counts = _delta(eng, before)
  del cache
  fresh_s, _ = _timed_prefill(eng, fresh)
  return dict(turn_s=turn_s, fresh_s=fresh_s, **{f"turn_{k}": v for k, v in counts.items()})


def batch_decode(eng, prompts: list[list[int]], steps: int) -> dict:
  """`steps` greedy decode steps of len(prompts) rows after their prompts (one prefill call):
  seconds of the decode programs, and the cache's counters around them."""
  B, T = len(prompts), len(prompts[0])
  cache = eng.new_cache(B)
  toks = jnp.asarray(prompts, jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  logits, cache = engine.prefill_fn(eng.weights, cache, toks, pos, jnp.ones((B, T), bool),
                                    jnp.full((B,), T - 1, jnp.int32), cfg=eng.cfg, ex=eng.ex,
                                    kv_len=eng.kv_len(T))
  token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  key = engine.row_key(0, GREEDY)
  jax.block_until_ready((token, cache))
  before = engine.expert_cache_stats(eng.weights)
  t = time.perf_counter()
  out = []
  for kv, n, p in eng.decode_calls(T, steps + 1):
    toks, cache, key, token = engine.decode_loop_fn(
        eng.weights, cache, token, jnp.int32(p), key, cfg=eng.cfg, ex=eng.ex, kv_len=kv,
        params=GREEDY, steps=n)
    out.append(toks)
  jax.block_until_ready(out)
  seconds = time.perf_counter() - t
  made = sum(int(o.shape[0]) for o in out)
  return dict(seconds=seconds, steps=made, tok_s=B * made / seconds, **_delta(eng, before))


def measure(eng, conversation: int, turn: int, rows: int, steps: int, prompt: int,
            repeats: int, seed: int = 0) -> dict:
  """Both measurements on a loaded Engine (the routed arm is `eng` itself, the streamed arm the
  same weights under routed_per_expert 0); round 0 warms up (compiles) and is dropped."""
  streamed = dataclasses.replace(eng, ex=dataclasses.replace(
      eng.ex, products=dataclasses.replace(eng.ex.products, routed_per_expert=0.0)))
  arms = {"routed": eng, "streamed": streamed}
  rng = np.random.default_rng(seed)
  ids = lambda n: rng.integers(10, eng.cfg.vocab_size - 10, n).tolist()
  out = {"turn": {a: [] for a in arms}, "batch": {1: [], rows: []}}
  for r in range(repeats + 1):
    conv, new, fresh = ids(conversation), ids(turn), ids(conversation + turn)
    for a, arm in arms.items():
      got = next_turn(arm, conv, new, fresh)
      if r:
        out["turn"][a].append(got)
    for b in (1, rows):
      got = batch_decode(eng, [ids(prompt) for _ in range(b)], steps)
      if r:
        out["batch"][b].append(got)
  return out


def summary(out: dict, rows: int) -> dict:
  """Medians over the repeats: per arm the turn's and the fresh prompt's seconds and their
  ratio, per batch size tokens/s, and per decode step the cache's misses and fills."""
  med = lambda xs: float(np.median(xs)) if xs else float("nan")
  s = {}
  for a, rs in out["turn"].items():
    turn_s, fresh_s = med([r["turn_s"] for r in rs]), med([r["fresh_s"] for r in rs])
    s[a] = dict(turn_s=turn_s, fresh_s=fresh_s, ratio=turn_s / fresh_s,
                **{k[5:]: med([r[k] for r in rs]) for k in rs[0] if k.startswith("turn_")
                   and k != "turn_s"})
  for b, rs in out["batch"].items():
    per = lambda k: med([r[k] / r["steps"] for r in rs if k in r])
    s[f"rows_{b}"] = dict(tok_s=med([r["tok_s"] for r in rs]), misses=per("misses"),
                          fills=per("fills"), miss_bytes=per("miss_bytes"),
                          fill_bytes=per("fill_bytes"))
  s["rows_ratio"] = s[f"rows_{rows}"]["tok_s"] / s["rows_1"]["tok_s"]
  return s


def child(args) -> None:
  """The measurements in this process (the emulated card's pool set by the parent): one JSON
  line, RESULT."""
  def room_for_rows(placed):
    """As the server sizes it: the cache gets what --rows sequences leave (the plan has one)."""
    bd = placed.breakdown
    if args.expert_cache_gb == "auto":
      free = bd.headroom + bd.expert_cache - bd.slack - (args.rows - 1) * (bd.kv_cache + bd.state)
      placed.with_expert_cache("auto", free=max(0, free))

  eng = jaxvt.load(args.model, max_context=args.conversation + args.turn + args.steps + 64,
                   offload_gb=float(args.budget), device_gb=args.device_gb,
                   expert_cache_gb=args.expert_cache_gb, on_plan=room_for_rows)
  with eng:
    cp = eng.plan.expert_cache
    out = measure(eng, args.conversation, args.turn, args.rows, args.steps, args.prompt,
                  args.repeats)
    info = dict(machine=report.machine(), routed_per_expert=eng.ex.products.routed_per_expert,
                cache=None if cp is None else cp.describe())
  print("RESULT " + json.dumps(dict(summary=summary(out, args.rows), **info)), flush=True)


def main(args) -> str:
  if args.model == REALISTIC:
    ensure_model(REALISTIC, print, routing=PRESETS["realistic"])
  env = child_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": pool_fraction(args.device_gb)})
  cmd = [sys.executable, "-m", "benchmarks.turns", "--child", "1"] + [
      f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
      if k not in ("child", "write")]
  p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
  lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
  if p.returncode or not lines:
    raise RuntimeError(f"the measuring process failed (exit {p.returncode}): "
                       f"{p.stdout.strip()[-400:]}")
  res = json.loads(lines[-1][7:])
  return report.publish("turns", section(args, res), args.write)


def section(args, res: dict) -> list[str]:
  s, rows = res["summary"], args.rows
  cmd = "python -m benchmarks.turns " + " ".join(a for a in sys.argv[1:] if a != "--write")
  mb = lambda v: f"{v / 1e6:.1f}"
  out = ["## Short turns and batches through the expert cache\n",
         f"Command: `{cmd.strip()} --write`  ", f"Machine: {res['machine']}  ",
         f"Date: {report.stamp()}\n",
         f"{os.path.basename(args.model)} at --offload-gb {args.budget} on an emulated "
         f"{args.device_gb:g} GiB card; {res['cache'] or 'no expert cache'}; the crossover "
         f"{res['routed_per_expert']:.2f} routed slots per expert. Medians of {args.repeats} "
         "rounds after a warm-up, the arms alternating in one process.\n",
         f"| arm | {args.turn}-token next turn s | fresh {args.conversation + args.turn}-token "
         "prompt s | ratio | turn hits | misses | fills | fill MB |",
         "|---|---|---|---|---|---|---|---|"]
  for a in ("routed", "streamed"):
    r = s[a]
    out.append(f"| {a} | {r['turn_s']:.3f} | {r['fresh_s']:.3f} | {r['ratio']:.3f} | "
               f"{r.get('hits', 0):.0f} | {r.get('misses', 0):.0f} | {r.get('fills', 0):.0f} | "
               f"{mb(r.get('fill_bytes', 0))} |")
  out += ["", "| rows | tok/s | misses / step | fills / step | MB a step: per row read | "
          "read once |", "|---|---|---|---|---|---|"]
  for b in (1, rows):
    r = s[f"rows_{b}"]
    out.append(f"| {b} | {r['tok_s']:.1f} | {r['misses']:.1f} | {r['fills']:.1f} | "
               f"{mb(r['miss_bytes'])} | {mb(r['fill_bytes'])} |")
  goal = lambda what, v, want, lower=False: (
      f"- {what}: {v:.3f}, {'met' if (v <= want if lower else v >= want) else 'missed'}")
  out += ["", "Goals:", goal(f"next turn <= {GOAL_TURN}x a fresh prompt (routed)",
                             s["routed"]["ratio"], GOAL_TURN, lower=True),
          goal(f"{rows} rows >= {GOAL_ROWS}x one row", s["rows_ratio"], GOAL_ROWS)]
  return out


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv, child)


if __name__ == "__main__":
  sys.exit(cli())
