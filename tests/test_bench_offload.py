"""python -m benchmarks.offload on CPU: budget points, goal verdicts, the table and plot, the
llama-bench arm's JSON, the loader's uploads in pieces, and one sweep point end to end."""

import dataclasses
import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from benchmarks import offload_llama, offload_report
from benchmarks.offload_report import Run, budgets, goals, plan_points, spread

RATES = {"dma": 50.0, "hbm": 4000.0}


def test_budgets_cover_the_safe_range_in_steps_of_at_most_one_gib():
  safe, unsafe = budgets(3.547, 18.61)
  assert safe[0] == 3.55 and safe[-1] == 18.61
  assert all(0 < b - a <= 1.0 for a, b in zip(safe, safe[1:]))
  assert unsafe == [2.55, 3.05]
  assert budgets(0.0, 2.4) == ([0.0, 1.0, 2.0, 2.4], [])
  assert budgets(0.7, 0.7) == ([0.7], [0.2])
  for s, t in ((1.01, 9.99), (5.0, 5.5), (2.0, 3.0)):
    b, _ = budgets(s, t, step=0.5)
    assert b[0] >= s and b[-1] == round(t, 2) and all(0 < y - x <= 0.5 for x, y in zip(b, b[1:]))


def test_plan_points_order_and_coverage():
  pts = plan_points(3.55, 18.61)
  assert pts[:4] == [("jaxvt", "auto", False), ("jaxvt@experts", "experts", False),
                     ("jaxvt", 3.55, False), ("jaxvt", 18.61, False)]
  assert pts[4:7] == [("jaxvt", 3.05, True), ("jaxvt", 2.55, True),
                      ("jax_pinned", "experts", False)]
  mids = [p[1] for p in pts[7:]]
  assert sorted(mids) == [float(b) for b in range(4, 19)]
  assert len(pts) == len({(a, b) for a, b, _ in pts})
  same = plan_points(3.55, 18.61, auto=3.55)  # auto placed the smallest safe budget: once
  assert same[0] == ("jaxvt", "auto", False) and ("jaxvt", 3.55, False) not in same
  assert len(same) == len(pts) - 1


def test_spread_is_a_permutation_that_starts_in_the_middle():
  xs = list(range(11))
  s = spread(xs)
  assert sorted(s) == xs and s[0] == 5 and set(s[:3]) == {5, 2, 8}
  assert spread([]) == [] and spread([7]) == [7]


def _sweep_rows(tok_s, prefill=250.0, roof_x=1.1):
  """jaxvt rows at budgets 3, 4, ... whose ms/token is `roof_x` times their roofline."""
  rows = []
  for i, t in enumerate(tok_s):
    r = Run("jaxvt", 3.0 + i, True, host_gib=3.0 + i, prefill_tok_s=prefill, decode_tok_s=t)
    ms = 1e3 / t / roof_x  # the roofline this row should have: all of it device reads
    r.device_read_gb = ms / 1e3 * RATES["hbm"]
    rows.append(r)
  return rows


def _verdicts(rows):
  return {g.split()[0] + " " + g.split()[1]: v for g, v, _ in goals(rows, RATES)}


def test_goals_met_on_a_good_sweep():
  rows = _sweep_rows([60.0, 55.0, 50.0, 40.0])
  rows[0].auto = True
  rows.append(Run("device", 0.0, True, prefill_tok_s=300.0, decode_tok_s=70.0))
  rows.append(Run("jax_pinned", 17.9, True, decode_tok_s=3.0))
  rows.append(Run("jaxvt@experts", 17.9, True, decode_tok_s=20.0, host_gib=17.9))
  g = goals(rows, RATES)
  assert [v for _, v, _ in g] == ["MET"] * 5, g
  assert "1.10x" in g[0][2] and "6.7x" in g[3][2] and "83%" in g[4][2]


def test_goals_missed_with_the_numbers_that_miss():
  rows = _sweep_rows([60.0, 63.0, 50.0], prefill=100.0, roof_x=1.5)
  rows[2].auto = True
  rows.append(Run("device", 0.0, True, prefill_tok_s=300.0, decode_tok_s=70.0))
  rows.append(Run("jax_pinned", 17.9, True, decode_tok_s=15.0))
  rows.append(Run("jaxvt@experts", 17.9, True, decode_tok_s=20.0))
  g = goals(rows, RATES)
  assert [v for _, v, _ in g] == ["MISSED"] * 5, g
  assert "+5.0%" in g[1][2]  # 60 -> 63 tok/s
  assert "4.00 GiB 63.00" in g[2][2]  # the best point, which auto missed


def test_goals_ignore_forced_failed_and_noise():
  rows = _sweep_rows([60.0, 60.3, 50.0])  # +0.5%: noise
  rows.append(Run("jaxvt", 2.5, False, forced=True, note="RESOURCE_EXHAUSTED"))
  rows.append(Run("jaxvt", 3.5, True, forced=True, decode_tok_s=90.0))
  g = goals(rows, RATES)
  assert g[0][1] == "MET" and g[1][1] == "MET" and "+0.5%" in g[1][2]
  assert [v for _, v, _ in g[2:]] == ["NOT RUN"] * 3


def test_render_and_plot(tmp_path):
  rows = _sweep_rows([60.0, 50.0])
  rows[0].auto = True
  rows += [Run("device", 0.0, True, prefill_tok_s=300.0, decode_tok_s=70.0),
           Run("jaxvt", 2.5, False, forced=True, safe=False, note="RESOURCE_EXHAUSTED: oom"),
           Run("llama.cpp", 17.5, True, note="-ngl 99 -ot exps=CPU", decode_tok_s=30.0)]
  args = types.SimpleNamespace(time_limit=540, llama_bench=None, device_gb=16.0, prompt=512,
                               gen=128)
  md = offload_report.render(rows, RATES, "0.1144", 19.15, args, "gpu:H200", "today", 500)
  table = [l for l in md.splitlines() if l.startswith("| ") and not l.startswith("| arm")]
  assert len(table) == len(rows)
  assert table[0].startswith("| device |") and "| forced |" in md and "(auto)" in md
  assert md.count("**MET**") + md.count("**MISSED**") + md.count("**NOT RUN**") == 5 + 8
  pytest.importorskip("matplotlib")
  out = tmp_path / "sweep.png"
  assert offload_report.plot(rows, str(out)) and out.read_bytes()[:4] == b"\x89PNG"


def test_peer_goals_pair_rows_of_one_run():
  """The llama.cpp ratios: each jaxvt row against its llama.cpp configuration."""
  rows = [Run("device", 0.0, True, prefill_tok_s=5000.0, decode_tok_s=160.0,
              prefill16_tok_s=200.0),
          Run("jaxvt", 3.5, True, auto=True, prefill_tok_s=2600.0, decode_tok_s=120.0),
          Run("jaxvt@experts", 17.3, True, prefill_tok_s=900.0, decode_tok_s=61.0),
          Run("llama.cpp", 0.0, True, point="llama.cpp:-ngl 99", prefill_tok_s=5000.0,
              decode_tok_s=240.0, prefill16_tok_s=500.0),
          Run("llama.cpp", 3.4, True, point="llama.cpp:-ngl 99 --n-cpu-moe 8",
              prefill_tok_s=1000.0, decode_tok_s=150.0),
          Run("llama.cpp", 17.3, True, point="llama.cpp:-ngl 99 -ot exps=CPU",
              prefill_tok_s=240.0, decode_tok_s=60.0)]
  g = offload_report.peer_goals(rows)
  assert [v for _, v, _ in g] == ["MISSED", "MISSED", "MISSED", "MET", "MISSED", "MET", "MET",
                                  "MISSED"], g
  assert "160.0 vs 240.0 tok/s = 0.67x (-ngl 99)" in g[0][2]
  assert "--n-cpu-moe 8" in g[1][2] and "0.80x" in g[1][2] and "1.02x" in g[2][2]
  assert "0.40x" in g[7][2]
  # a miss that two decimals would round up to the goal shows a third (1.2957 is not 1.30)
  rows[1].decode_tok_s, rows[4].decode_tok_s = 156.65, 120.9
  g = offload_report.peer_goals(rows)
  assert g[1][1] == "MISSED" and "= 1.296x" in g[1][2], g[1]
  g = offload_report.peer_goals(rows[:3])
  assert [v for _, v, _ in g] == ["NOT RUN"] * 3 + ["NOT RUN", "MISSED", "NOT RUN", "NOT RUN",
                                                     "NOT RUN"]


# ---- llama.cpp arm -----------------------------------------------------------------------------

LLAMA_CPU = os.environ.get("JAXVT_LLAMA_BENCH", "/tmp/llama-cpu/bin/llama-bench")
SAMPLE = os.path.join(os.path.dirname(__file__), "reference", "llama_bench_sample.json")


def _check_parse(text: str):
  recs = json.loads(text[text.find("["):])
  pp = next(r for r in recs if r["n_gen"] == 0)
  tg = next(r for r in recs if r["n_prompt"] == 0)
  r = offload_llama.parse(text, "-ngl 99", 1.5)
  assert r.ok and r.arm == "llama.cpp" and r.budget_gib == r.host_gib == 1.5
  assert r.prefill_tok_s == pp["avg_ts"] and r.decode_tok_s == tg["avg_ts"]
  assert r.gen_tokens == tg["n_gen"] and str(tg["n_threads"]) in r.note


def test_parse_recorded_llama_bench_json():
  """A sample recorded from tools/build_llamacpp.sh's CPU build (LLAMA_GPU=none) of the
  vendored llama.cpp (llama-cpp-python 0.3.36): `llama-bench -m tiny.gguf -p 16 -n 4 -r 2
  -o json -ngl 0 -t 2` on synth.tiny_config("qwen35moe", n_nextn=1), q4_k_m."""
  if not os.path.exists(SAMPLE):
    pytest.skip("no recorded llama-bench sample")
  with open(SAMPLE) as f:
    _check_parse(f.read())


@pytest.mark.skipif(not os.access(LLAMA_CPU, os.X_OK), reason="no CPU llama-bench built here")
def test_live_llama_bench_json(tmp_path):
  from jaxvt import synth
  path = str(tmp_path / "tiny.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe", n_nextn=1), "q4_k_m", seed=0)
  cmd = offload_llama.command(LLAMA_CPU, path, 16, 4, ["-ngl", "0", "-t", "2"])
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  _check_parse(p.stdout)


FAKE_LLAMA = """#!{python}
import json, sys
args = sys.argv[1:]
if "--help" in args:
  print("--n-cpu-moe N")
  sys.exit(0)
with open({calls!r}, "a") as f:
  f.write(" ".join(args) + "\\n")
n = sum(1 for _ in open({calls!r}))
rates = [200.0, 60.0, 130.0, 50.0, 100.0, 70.0, 120.0]  # tg tok/s of call 1, 2, ...
recs = [dict(n_prompt=int(p), n_gen=0, avg_ts=1000.0)
        for p in args[args.index("-p") + 1].split(",") if int(p)]
recs.append(dict(n_prompt=0, n_gen=int(args[args.index("-n") + 1]), avg_ts=rates[n - 1],
                 n_threads=4))
print(json.dumps(recs))
"""


def test_llama_decode_with_cpu_experts_in_separate_calls(tmp_path):
  """The configurations computing experts on the CPU time decode in DECODE_CALLS separate
  llama-bench calls (decode alone, -p 0), taken in turns once every configuration has run; the
  row's decode is the median of its calls, and the goal line shows their spread and the ratio's.
  A fake llama-bench answers each call with the next rate of a list."""
  calls = tmp_path / "calls"
  fake = tmp_path / "bin" / "llama-bench"
  fake.parent.mkdir()
  fake.write_text(FAKE_LLAMA.format(python=sys.executable, calls=str(calls)))
  fake.chmod(0o755)
  meta = dict(expert_layer_bytes=0.45 * (1 << 30), n_layers=40, auto=3.5)
  assert offload_llama.DECODE_CALLS == 3
  runs = offload_llama.run_all(str(fake), "m.gguf", meta, 512, 128, time.time() + 600,
                               lambda s: None)
  by = {r.point: r for r in runs}
  ngl, ot, ncm = (by["llama.cpp:-ngl 99"], by["llama.cpp:-ngl 99 -ot exps=CPU"],
                  by["llama.cpp:-ngl 99 --n-cpu-moe 8"])
  assert (ngl.decode_samples, ngl.decode_tok_s) == ([200.0], 200.0)  # all on the GPU: one call
  assert (ot.decode_samples, ot.decode_tok_s) == ([60.0, 50.0, 70.0], 60.0)
  assert (ncm.decode_samples, ncm.decode_tok_s) == ([130.0, 100.0, 120.0], 120.0)
  assert ncm.prefill_tok_s == 1000.0  # from its first call, the only one with prompts
  lines = calls.read_text().splitlines()
  assert len(lines) == 7 and all("-p 0 " in c for c in lines[3:])
  assert ["exps=CPU" in c for c in lines[3:]] == [True, False, True, False]  # in turns
  auto = Run("jaxvt", 3.5, True, auto=True, decode_tok_s=156.0)
  g = {goal: (v, n) for goal, v, n in offload_report.peer_goals([auto, ncm])}
  v, n = g["decode at auto >= 1.3x llama.cpp"]
  assert v == "MET" and "156.0 vs 120.0 tok/s = 1.30x" in n
  assert "median of 3 calls, 100.0-130.0 tok/s: 1.20-1.56x" in n


def test_parse_failures_and_configs():
  assert not offload_llama.parse("[]", "x", 0.0).ok
  assert not offload_llama.parse("no json here", "x", 0.0).ok
  meta = dict(expert_layer_bytes=0.45 * (1 << 30), n_layers=40, auto=3.5)
  c = offload_llama.configs(meta, has_ncmoe=True)
  assert [x[1][:2] for x in c] == [["-ngl", "99"]] * 3
  assert c[1][1][2:] == ["-ot", "exps=CPU"] and c[1][2] == pytest.approx(18.0)
  assert c[2][1][2:] == ["--n-cpu-moe", "8"] and c[2][2] == pytest.approx(3.6)
  assert len(offload_llama.configs(meta, has_ncmoe=False)) == 2
  c = offload_llama.configs(dict(meta, routed=18.45), has_ncmoe=False)  # the MTP's experts too
  assert c[1][2] == pytest.approx(18.45)
  cmd = offload_llama.command("lb", "m.gguf", 512, 128, [])
  assert cmd[cmd.index("-p") + 1] == "512,16"
  recs = [dict(n_prompt=512, n_gen=0, avg_ts=5000.0), dict(n_prompt=16, n_gen=0, avg_ts=700.0),
          dict(n_prompt=0, n_gen=128, avg_ts=200.0, n_threads=16)]
  r = offload_llama.parse(json.dumps(recs), "-ngl 99", 0.0)
  assert (r.prefill_tok_s, r.prefill16_tok_s, r.decode_tok_s) == (5000.0, 700.0, 200.0)
  assert offload_llama.find("/nonexistent/bin/llama-bench") is None


# ---- the loader's uploads and copies (jaxvt.transfer) --------------------------------------------

def test_device_stack_uploaded_in_pieces_matches_one_transfer(monkeypatch):
  import jax

  from jaxvt import transfer
  rng = np.random.default_rng(0)
  raws = [rng.integers(0, 255, (n, 7), dtype=np.uint8) for n in (5, 3, 5, 4, 5)]
  rows = [lambda r=r: r.reshape(-1) for r in raws]
  stride = max(r.size for r in raws)
  whole = np.asarray(transfer.device_stack(rows, stride, jax.devices()[0]))
  monkeypatch.setattr(transfer, "upload_max", lambda: 2 * stride)  # 2 rows per piece
  pieces = np.asarray(transfer.device_stack(rows, stride, jax.devices()[0]))
  np.testing.assert_array_equal(np.asarray(transfer.device_stack(rows, stride, jax.devices()[0],
                                                                  lead=1))[0], whole)
  np.testing.assert_array_equal(whole, pieces)
  for row, r in zip(whole, raws):
    np.testing.assert_array_equal(row[:r.size], r.reshape(-1))
    assert not row[r.size:].any()
  monkeypatch.setattr(transfer, "COPY_CHUNK", 1000)  # threaded copy in many pieces
  src = rng.integers(0, 255, 10_007, dtype=np.uint8)
  dst = np.zeros_like(src)
  transfer.copy_bytes(dst, src)
  np.testing.assert_array_equal(dst, src)


# ---- one sweep process, end to end ---------------------------------------------------------

def test_sweep_child_end_to_end(tmp_path, capsys, monkeypatch):
  """Two budgets of a tiny model in one process: the second reuses the first's pinned copies."""
  from jaxvt import ffi
  if not ffi.available("cpu"):
    pytest.skip("needs the jaxvt extension")
  from benchmarks import offload
  from jaxvt import synth
  path = str(tmp_path / "tiny.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe", n_nextn=1), "q4_k_m", seed=0)
  monkeypatch.setattr(offload, "LOCK", str(tmp_path / "lock"))
  s = offload.Session(path, 8, 3, 16.0)
  e1 = s.engine(1.0)  # every offloadable weight in the host tier
  bufs = dict(s.tier.bufs)
  assert bufs and e1.plan.host_bytes > 0
  e2 = s.engine(1.0)
  assert s.tier.bufs == bufs  # nothing copied again
  w1, w2 = e1.weights, e2.weights
  for k in w1:
    if hasattr(w1[k], "table"):
      np.testing.assert_array_equal(np.asarray(w1[k].table), np.asarray(w2[k].table))
  del e1, e2, w1, w2
  args = types.SimpleNamespace(child="sweep", model=path, prompt=8, gen=3, device_gb=16.0,
                               deadline=0.0, time_limit=120, after="",
                               points=json.dumps([["jaxvt", "auto", False]]))
  s.tier.close()
  offload.child(args)
  out = capsys.readouterr().out
  runs = [Run(**json.loads(l[4:])) for l in out.splitlines() if l.startswith("RUN ")]
  assert len(runs) == 1 and runs[0].ok, out
  r = runs[0]
  assert r.auto and r.point == "jaxvt:auto" and r.decode_tok_s > 0 and r.prefill_tok_s > 0
  assert r.gen_tokens == 3 and r.load_s > 0 and r.compile_s > 0 and r.measure_s > 0
  assert "POINT jaxvt auto: load" in out
  assert dataclasses.asdict(r)["predicted_ms"] > 0


def test_failed_point_frees_its_weights(tmp_path, monkeypatch):
  """A point that fails after its load (as an unsafe budget runs out of device memory) deletes its
  weights' arrays: later points of the same process get the memory back."""
  from jaxvt import ffi
  if not ffi.available("cpu"):
    pytest.skip("needs the jaxvt extension")
  import jax
  from jaxvt import synth
  from benchmarks import offload
  path = str(tmp_path / "tiny.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe", n_nextn=1), "q4_k_m", seed=0)
  s = offload.Session(path, 8, 3, 16.0)
  made = []

  def engine(*a, engine=s.engine, **k):
    eng = engine(*a, **k)
    made.append([x for x in jax.tree_util.tree_leaves(eng.weights) if isinstance(x, jax.Array)])
    return eng

  def fail(eng, ids, overlap):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.0KiB")

  monkeypatch.setattr(s, "engine", engine)
  monkeypatch.setattr(offload, "warm_up", fail)
  r = s.measure("jaxvt", 0.5, forced=True)
  assert not r.ok and r.note.startswith("RuntimeError: RESOURCE_EXHAUSTED")
  assert made and made[0] and all(x.is_deleted() for x in made[0])
  monkeypatch.undo()
  r2 = s.measure("jaxvt", 0.5)  # the next point runs
  assert r2.ok and r2.decode_tok_s > 0, r2.note
  s.tier.close()


def test_forced_points_run_last_in_a_process_of_their_own(tmp_path, monkeypatch):
  """The sweep's child gets the safe points only; the forced (unsafe) budgets go to a second
  child started after it ends, so a forced point out of memory cannot fail a safe one."""
  from benchmarks import offload, report
  meta = {"safe": 3.55, "top": 18.61, "auto": 3.5, "n_layers": 40}
  calls = []

  class Fake:
    def __init__(self, arm, points):
      self.arm, self.points, self.runs = arm, points, []
      self.info = {"meta": meta} if arm == "sweep" else {}
      self.p = types.SimpleNamespace(returncode=0)

    def wait(self, deadline):
      calls.append(("wait", self.arm))
      pts = self.points if self.points is not None else offload.safe_points(meta)
      self.runs = [Run(a, 0.0, True, point=f"{a}:{b}", forced=f) for a, b, f in pts]
      return self

  def child(arm, args, env, deadline, log, points=None, after="", signal=""):
    calls.append(("start", arm, points))
    return Fake(arm, points)

  monkeypatch.setattr(offload, "_offload_child", child)
  monkeypatch.setattr(offload, "ensure_model", lambda *a: None)
  monkeypatch.setattr(offload, "pool_fraction", lambda gb: "0.1167")
  monkeypatch.setattr(offload_llama, "find", lambda p: None)
  monkeypatch.setattr(offload.offload_report, "plot", lambda *a: False)
  written = {}
  monkeypatch.setattr(report, "write_section", lambda name, body: written.update({name: body}))
  monkeypatch.setenv("OUT", str(tmp_path))
  model = tmp_path / "m.gguf"
  model.write_bytes(b"0" * 1024)
  args = types.SimpleNamespace(model=str(model), time_limit=600, device_gb=16.0, prompt=8, gen=3,
                               llama_bench=None)
  offload.main(args)
  starts = [c for c in calls if c[0] == "start"]
  assert [c[1] for c in starts] == ["device", "sweep", "forced"]
  assert starts[1][2] is None  # the sweep child plans its own points: the safe ones
  planned = offload_report.plan_points(3.55, 18.61, auto=3.5)
  forced = [p for p in planned if p[2]]
  assert forced and starts[2][2] == forced
  assert offload.safe_points(meta) == [p for p in planned if not p[2]]
  # the forced child starts only once the sweep child has ended
  assert calls.index(("wait", "sweep")) < calls.index(starts[2])
  assert "offload" in written


def test_the_sweeps_auto_is_the_budget_jaxvt_load_picks(monkeypatch):
  """The sweep plans `auto` as jaxvt.load does, from XLA's analysis of each candidate's prefill
  (here inflated above the estimate so the two disagree), not from the estimate alone: it
  measures the budget a user of --offload-gb auto gets, and its smallest safe budget is not
  below it."""
  import jaxvt
  from jaxvt import engine as engine_mod, ffi, loader
  from benchmarks import offload
  from jaxvt.offload import memory as M
  from jaxvt.offload.plan import GiB
  if not ffi.available("cpu"):
    pytest.skip("needs the jaxvt extension")
  with jaxvt.load() as eng:  # the embedded default model
    path = eng.path
  s = offload.Session(path, 64, 8, None)
  m = loader.open_model(path)
  base = engine_mod.plan(m, offload_gb=0.0, max_context=s.max_context)
  bd, weights = base.breakdown, base.plan.total_bytes
  ex = engine_mod.exec_for("cpu", True, s.par)
  real = engine_mod.plan_workspace_bytes(m, base.placement, ex, s.max_context, s.max_context)
  extra = bd.workspace - real + int(0.03 * GiB)  # XLA's figure: the estimate + 0.03 GiB
  cap = bd.kv_cache + bd.state + bd.workspace + M.SLACK_MIN_BYTES + int(0.6 * weights)
  orig = engine_mod.plan_workspace_bytes
  monkeypatch.setattr(engine_mod.steps, "plan_workspace_bytes", lambda *a: orig(*a) + extra)
  s.device_gb = cap / GiB
  sweep = s.plan("auto").plan.host_bytes
  with jaxvt.load(path, max_context=s.max_context, offload_gb="auto", device_gb=cap / GiB) as eng:
    assert eng.memory.workspace_source == "XLA memory analysis"
    assert sweep == eng.plan.plan.host_bytes
  est = engine_mod.plan(m, offload_gb="auto", device_gb=cap / GiB, max_context=s.max_context)
  assert est.plan.host_bytes < sweep  # the estimate alone (the sweep's old auto) differs
  assert s.facts()["safe"] >= sweep / GiB - 1e-9
