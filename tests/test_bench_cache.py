"""python -m benchmarks.cache on CPU: its options, its points, llama.cpp's --n-cpu-moe pairing,
the goal verdicts and the section from fabricated rows, the parent's flow with a faked child, and
the child's arms end to end on a tiny MoE file."""

import dataclasses
import json
import os
import time
import types

import pytest

from benchmarks import cache_report, offload_llama
from benchmarks.cache_report import GiB, LLAMA, Row, goals, plan_points, prediction
from jaxvt import JaxvtError


# ---- options and points -------------------------------------------------------------------------

def test_parse_budgets_arms_and_models():
  assert cache_report.parse_budgets("auto,7,12,experts") == ["auto", "7", "12", "experts"]
  assert cache_report.parse_budgets(" 7.0, 12.50 ,7") == ["7", "12.5"]
  assert cache_report.parse_arms("cache,llama") == ["off", "lru", "lfru", "llama"]
  assert cache_report.parse_arms("lru-flip,off") == ["off", "lru-flip"]
  assert cache_report.parse_arms("jaxvt") == list(cache_report.ARMS)
  assert cache_report.parse_models("uniform,realistic") == ["realistic", "uniform"]
  for f, text, msg in ((cache_report.parse_budgets, "auto,0", "'0' is not auto"),
                       (cache_report.parse_budgets, "7,hbm", "'hbm' is not auto"),
                       (cache_report.parse_budgets, ",", "--budgets is empty"),
                       (cache_report.parse_arms, "lru,mru", "no arm 'mru'"),
                       (cache_report.parse_models, "tiny", "no model 'tiny'")):
    with pytest.raises(JaxvtError, match=msg):
      f(text)


def test_a_bad_option_is_one_line_before_jax_starts(capsys):
  from benchmarks import cache
  assert cache.cli(["--budgets", "auto,-3"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("jaxvt: error: --budgets: '-3'") and err.count("\n") == 1


def test_points_most_telling_first():
  pts = plan_points(["realistic", "uniform"], ["auto", "7", "12", "experts"],
                    cache_report.parse_arms("cache,predict,llama"))
  assert pts[:5] == [("realistic", "7", a) for a in ("off", "lru", "lfru", "off-nopred",
                                                      "lru-flip")]
  assert [p[1] for p in pts[5:14]] == ["auto"] * 3 + ["12"] * 3 + ["experts"] * 3
  assert pts[14:] == [("uniform", "7", "off"), ("uniform", "7", "lru")]
  assert len(set(pts)) == len(pts) == 16
  # subsets: the prediction arms and the uniform file only where 7 GiB is asked for
  assert plan_points(["realistic", "uniform"], ["12"], ["off", "lru", "off-nopred"]) == [
      ("realistic", "12", "off"), ("realistic", "12", "lru")]
  assert plan_points(["uniform"], ["auto", "7"], ["lfru", "lru"]) == [("uniform", "7", "lru")]
  assert plan_points(["realistic"], ["7"], ["llama"]) == []


def test_predict_plan_flips_what_the_arm_would_run():
  plan = lambda *a: cache_report.predict_plan(*a, on=(2, 1))
  assert plan(2, 2, False, False, "default") == ({}, "2/2")
  assert plan(2, 2, False, True, "default") == ({}, "off")  # the rule turns it off by a cache
  assert plan(2, 2, None, True, "default") == ({}, "2/2")  # a rule without predict_with_cache
  assert plan(2, 2, True, True, "default") == ({}, "2/2")
  off = dict(predict_after_host=0, predict_after_device=0)
  assert plan(2, 2, False, False, "off") == (off, "off")
  assert plan(2, 2, False, False, "flip") == (off, "off")
  assert plan(2, 2, True, True, "flip") == (off, "off")
  assert plan(2, 2, False, True, "flip") == ({"predict_with_cache": True}, "2/2")
  assert plan(0, 0, False, True, "flip") == (dict(predict_after_host=2, predict_after_device=1,
                                                   predict_with_cache=True), "2/1")
  assert plan(0, 0, None, False, "flip") == (dict(predict_after_host=2, predict_after_device=1),
                                             "2/1")
  assert plan(0, 3, None, True, "flip") == (off, "off")


# ---- llama.cpp at the same expert bytes ---------------------------------------------------------

META = {"expert_layer_bytes": 0.42 * GiB, "n_layers": 40, "routed": 16.88,
        "budgets": {"auto": {"host_gib": 3.78, "expert_gib": 3.70},
                    "7": {"host_gib": 6.88, "expert_gib": 6.88},
                    "7.1": {"host_gib": 7.0, "expert_gib": 7.0},
                    "12": {"host_gib": 11.94, "expert_gib": 11.94},
                    "experts": {"host_gib": 16.88, "expert_gib": 16.88}}}


def test_llama_configs_pair_each_budget_with_its_expert_bytes():
  confs = cache_report.llama_configs(META, ["auto", "7", "7.1", "12", "experts"],
                                     offload_llama.configs, True)
  got = {label: (flags, round(gib, 2), bs) for label, flags, gib, bs in confs}
  # N = the layers of experts nearest the budget's host-tier expert bytes (0.42 GiB a layer)
  assert got["-ngl 99 --n-cpu-moe 9"] == (["-ngl", "99", "--n-cpu-moe", "9"], 3.78, ["auto"])
  assert got["-ngl 99 --n-cpu-moe 16"][1:] == (6.72, ["7"])
  assert got["-ngl 99 --n-cpu-moe 17"][1:] == (7.14, ["7.1"])
  assert got["-ngl 99 --n-cpu-moe 28"][1:] == (11.76, ["12"])
  assert got["-ngl 99 -ot exps=CPU"] == (["-ngl", "99", "-ot", "exps=CPU"], 16.88, ["experts"])
  for label, _, gib, bs in confs:  # each within half a layer of jaxvt's bytes
    for b in bs:
      assert abs(gib - META["budgets"][b]["expert_gib"]) <= 0.21, (label, b)
  # budgets with one N share its configuration; without --n-cpu-moe only -ot exps=CPU runs
  shared = cache_report.llama_configs(dict(META, budgets={"7": {"expert_gib": 6.88},
                                                          "6.9": {"expert_gib": 6.9}}),
                                      ["7", "6.9"], offload_llama.configs, True)
  assert [(c[0], c[3]) for c in shared] == [("-ngl 99 --n-cpu-moe 16", ["7", "6.9"])]
  assert [c[0] for c in cache_report.llama_configs(META, ["auto", "experts"],
                                                   offload_llama.configs, False)] == [
      "-ngl 99 -ot exps=CPU"]


FAKE_LLAMA = r"""#!/bin/sh
case " $* " in *" --help "*) echo "--n-cpu-moe N"; exit 0 ;; esac
echo "$*" >> {calls}
case " $* " in *" --n-cpu-moe 28 "*) echo "out of memory" >&2; exit 1 ;; esac
ncpu=41; calls=$(wc -l < {calls})
while [ $# -gt 0 ]; do
  [ "$1" = --n-cpu-moe ] && ncpu=$2; [ "$1" = -n ] && gen=$2; shift
done
echo "[{{\"n_prompt\": 0, \"n_gen\": $gen, \"n_threads\": 16, \
\"avg_ts\": $((200 - 3 * ncpu + calls % 3))}}]"
"""


def test_llama_rows_one_per_budget(tmp_path):
  """llama-bench (a fake answering 200 - 3 N tok/s, N the layers of experts on the CPU, and
  failing for N = 28) at each budget's expert bytes: decode alone, in separate calls."""
  from benchmarks import cache
  calls = tmp_path / "calls"
  fake = tmp_path / "llama-bench"
  fake.write_text(FAKE_LLAMA.format(calls=str(calls)))
  fake.chmod(0o755)
  args = types.SimpleNamespace(realistic="m.gguf", llama_gen=64)
  rows = cache.llama_rows(str(fake), args, META, ["auto", "7", "12", "experts"],
                          time.time() + 600, lambda s: None)
  by = {r.budget: r for r in rows}
  assert [r.arm for r in rows] == [LLAMA] * 4
  assert by["auto"].flags == "-ngl 99 --n-cpu-moe 9" and by["auto"].ok
  assert by["7"].flags == "-ngl 99 --n-cpu-moe 16" and by["7"].expert_gib == pytest.approx(6.72)
  assert len(by["7"].decode_samples) == offload_llama.DECODE_CALLS
  assert 152.0 - 1 <= by["7"].decode_tok_s <= 152.0 + 2  # the median of its calls
  assert by["experts"].flags == "-ngl 99 -ot exps=CPU"
  assert 77.0 <= by["experts"].decode_tok_s <= 80.0
  assert not by["12"].ok and "exit 1" in by["12"].note and "--n-cpu-moe 28" in by["12"].flags
  lines = calls.read_text().splitlines()
  assert all("-p 0 " in c and "-n 64 " in c for c in lines)


# ---- verdicts and the section --------------------------------------------------------------------

def _row(model, budget, arm, tok_s, cache_gib=None, **kw):
  policy = cache_report.ARMS[arm][0] if arm in cache_report.ARMS else ""
  if cache_gib is None:
    cache_gib = 2.0 if policy else 0.0
  hits = kw.pop("hits", 900 if cache_gib else 0)
  misses = kw.pop("misses", 100 if cache_gib else 0)
  return Row(model, budget, arm, ok=True, decode_tok_s=tok_s, cache_gib=cache_gib,
             policy=policy if cache_gib else "", hits=hits, misses=misses,
             predict=kw.pop("predict", "2/2"), tokens=kw.pop("tokens", 7), **kw)


def _good_rows():
  rows = [_row("realistic", "7", "off", 100.0, host_mb_per_token=222),
          _row("realistic", "7", "lru", 140.0, host_mb_per_token=60),
          _row("realistic", "7", "lfru", 130.0),
          _row("realistic", "7", "off-nopred", 95.0, predict="off"),
          _row("realistic", "7", "lru-flip", 137.0, predict="off"),
          _row("realistic", "auto", "off", 170.0),
          _row("realistic", "auto", "lru", 0.0, cache_gib=0.0),  # no room: not measured
          _row("realistic", "12", "off", 90.0), _row("realistic", "12", "lru", 89.5),
          _row("realistic", "12", "lfru", 95.0),
          _row("realistic", "experts", "off", 70.0), _row("realistic", "experts", "lru", 120.0),
          _row("uniform", "7", "off", 100.0, tokens=3), _row("uniform", "7", "lru", 99.0,
                                                              tokens=3)]
  rows += [Row("realistic", "7", LLAMA, ok=True, decode_tok_s=80.0, flags="-ngl 99 --n-cpu-moe 16",
               decode_samples=[78.0, 80.0, 83.0]),
           Row("realistic", "experts", LLAMA, ok=True, decode_tok_s=50.0,
               flags="-ngl 99 -ot exps=CPU")]
  return rows


def _verdicts(rows):
  return [(g.split(":")[0] + ":" + g.split(":")[1][:30], v, n) for g, v, n in goals(rows)]


def test_goals_met_with_their_margins():
  g = goals(_good_rows())
  assert [v for _, v, _ in g] == ["MET"] * 6, g
  assert "140.0 vs 100.0 tok/s = 1.400x, +12.0% against the goal's 1.25x" in g[0][2]
  assert "1.300x" in g[1][2]
  never = g[2][2]  # 12 GiB LRU is 0.6% slower: noise, listed; auto had no room for a cache
  assert "worst 0.994x (-0.6%" in never and "12 LRU 0.994x" in never
  assert "no cache (no device memory left): auto LRU" in never
  assert "140.0 vs 80.0 tok/s = 1.750x" in g[3][2] and "--n-cpu-moe 16" in g[3][2]
  assert "experts: lru 2.40x (-ngl 99 -ot exps=CPU)" in g[3][2]
  assert "0.990x" in g[4][2] and "+1.0% against the goal's 0.98x" in g[4][2]
  assert "13 rows, 2 model(s)" in g[5][2]  # auto LRU decoded nothing: no cache to place


def _changed(changes: dict) -> list[Row]:
  """_good_rows with {key: {field: value}} applied."""
  return [dataclasses.replace(r, **changes.get(r.key, {})) for r in _good_rows()]


def test_goals_missed_and_not_run():
  rows = _changed({("realistic", "7", "lru"): dict(decode_tok_s=120.0),
                   ("realistic", "12", "lfru"): dict(decode_tok_s=85.0),
                   ("uniform", "7", "lru"): dict(decode_tok_s=97.0, tokens=4)})
  g = goals(rows)
  assert [v for _, v, _ in g] == ["MISSED", "MET", "MISSED", "MISSED", "MISSED", "MISSED"], g
  assert "1.200x, -4.0% against the goal's 1.25x" in g[0][2]
  assert "120.0 vs 80.0 tok/s = 1.500x, -6.2% against the goal's 1.6x" in g[3][2]
  assert "worst 0.944x" in g[2][2] and "12 LFRU 0.944x" in g[2][2]
  assert "0.970x, -1.0% against the goal's 0.98x" in g[4][2]
  assert "uniform 7 lru" in g[5][2]
  # rows missing or failed: NOT RUN, never a verdict from another row
  part = [r for r in rows if r.arm != LLAMA and r.model == "realistic" and r.budget != "7"]
  part[0].ok = False
  g = goals(part)
  assert [v for _, v, _ in g][:2] == ["NOT RUN", "NOT RUN"] and g[3][1] == "NOT RUN"
  assert g[4][1] == "NOT RUN"
  uni = [_row("uniform", "7", "off", 100.0), _row("uniform", "7", "lru", 0.0, cache_gib=0.0)]
  assert goals(uni)[4][1:] == ("NOT RUN", "the plan left no device memory for a cache")


def test_prediction_decides_with_and_without_the_cache():
  lines = prediction(_good_rows())
  assert lines[0].startswith("without the cache: prediction 2/2 100.0 tok/s (222 MB/tok) vs off "
                             "95.0 tok/s") and "+5.3%; keep it: it pays" in lines[0]
  assert "with the LRU cache: prediction 2/2 140.0 tok/s (60 MB/tok, hit rate 90.0%)" in lines[1]
  assert "+2.2%; keep it" in lines[1]
  rows = _changed({("realistic", "7", "lru-flip"): dict(decode_tok_s=145.0),
                   ("realistic", "7", "off-nopred"): dict(decode_tok_s=100.5)})
  lines = prediction(rows)
  assert "-0.5%; drop it: no measurable gain" in lines[0] and "-3.4%; drop it: it costs" in lines[1]
  # a product whose default runs no prediction with the cache: the flipped arm turns it on
  rows = _changed({("realistic", "7", "lru-flip"): dict(decode_tok_s=145.0, predict="2/2"),
                   ("realistic", "7", "lru"): dict(predict="off")})
  assert "prediction 2/2 145.0 tok/s" in prediction(rows)[1]
  assert "(the default here: off)" in prediction(rows)[1]
  assert prediction([])[0].startswith("without the cache: NOT RUN")


def test_render_the_section():
  rows = _good_rows() + [Row("realistic", "12", "lru-flip", note="not asked", earlier=True)]
  args = types.SimpleNamespace(time_limit=540, device_gb=16.0, gen=256, prompt=16,
                               temperature=1.0, repeats=2)
  body = cache_report.render(rows, {"frac": "0.1167", "llama_gen": 128}, args,
                             "python -m benchmarks.cache --time-limit 540", "gpu:H200",
                             "2026-12-04",
                             500.0, ["realistic 12 lfru"], ["a note"])
  assert body.startswith("## Expert cache")
  assert "Command: `python -m benchmarks.cache --time-limit 540` (500 s in all" in body
  assert "Machine: gpu:H200  \n" in body and "Date: 2026-12-04\n" in body
  table = [l for l in body.splitlines() if l.startswith("| realistic") or l.startswith("| uniform")]
  assert len(table) == len(rows)
  assert table[0].startswith("| realistic | auto | off |")  # budgets in order, off first
  lru7 = next(l for l in table if l.startswith("| realistic | 7 | lru |"))
  assert "| 90.0% | 60 | 140.00 | 1.400 |" in lru7
  assert any("llama.cpp" in l and "| 80.00 (78.0-83.0) | 0.800 |" in l for l in table)
  assert "earlier call" in table[[i for i, l in enumerate(table) if "not asked" in l][0]]
  assert "Not run (time limit, or not asked for): realistic 12 lfru." in body
  assert "\nNote: a note." in body and body.count("**MET**") == 6
  assert "- with the LRU cache: prediction" in body


def test_merge_keeps_this_calls_rows_and_marks_the_earlier():
  now = [_row("realistic", "7", "off", 100.0)]
  before = [_row("realistic", "7", "off", 90.0), Row("realistic", "7", LLAMA, ok=True)]
  got = cache_report.merge(now, before)
  assert [(r.arm, r.decode_tok_s, r.earlier) for r in got] == [("off", 100.0, False),
                                                               (LLAMA, 0.0, True)]


# ---- the parent, its child faked -----------------------------------------------------------------

def test_main_runs_the_child_then_llama_and_merges(tmp_path, monkeypatch):
  from benchmarks import cache, report
  started = []

  class FakeRows:
    def __init__(self, cmd, env, err, log):
      started.append((cmd, env))
      pts = json.loads(cmd[cmd.index("--points") + 1])
      self.runs = [_row(m, b, a, 100.0 + i) for i, (m, b, a) in enumerate(pts)]
      self.info = {"meta": {"realistic": dict(META, model="realistic")}, "skipped": ["x y z"]}
      self.p = types.SimpleNamespace(returncode=0)

    def wait(self, deadline):
      return self

  monkeypatch.setattr(cache, "Rows", FakeRows)
  ensured = []
  monkeypatch.setattr(cache, "ensure_models", lambda args, models, log: ensured.append(models))
  monkeypatch.setattr(cache.offload, "pool_fraction", lambda gb: "0.1167")
  monkeypatch.setattr(offload_llama, "find", lambda p: "/bin/llama-bench")
  monkeypatch.setattr(cache, "llama_rows", lambda binary, args, meta, budgets, end, log: [
      Row("realistic", "7", LLAMA, ok=True, decode_tok_s=60.0, flags="-ngl 99 --n-cpu-moe 16")])
  written = {}
  monkeypatch.setattr(report, "write_section", lambda name, body: written.update({name: body}))
  monkeypatch.setenv("OUT", str(tmp_path))
  rows_path = str(tmp_path / "rows.json")
  first = cache.parser().parse_args(["--arms", "cache", "--budgets", "7,12", "--rows", rows_path,
                                     "--models", "realistic"])
  cache.main(first)
  cmd, env = started[0]
  assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1167"}
  assert cmd[cmd.index("--child") + 1] == "arms" and cmd[cmd.index("--facts") + 1] == ""
  assert json.loads(open(rows_path).read())["info"]["meta"]["realistic"]["n_layers"] == 40
  second = cache.parser().parse_args(["--arms", "predict,llama", "--budgets", "7", "--rows",
                                      rows_path, "--merge", "--write"])
  body = cache.main(second)
  cmd = started[1][0]
  assert cmd[cmd.index("--facts") + 1] == "realistic"
  assert json.loads(cmd[cmd.index("--points") + 1]) == [["realistic", "7", "off-nopred"],
                                                        ["realistic", "7", "lru-flip"]]
  assert written["cache"] == body
  assert "Command: `python -m benchmarks.cache --budgets 7 --arms predict,llama --time-limit " \
         "540 --merge --write`" in body
  saved = json.loads(open(rows_path).read())["rows"]
  assert {(r["budget"], r["arm"], r["earlier"]) for r in saved} == {
      ("7", "off", True), ("7", "lru", True), ("7", "lfru", True), ("12", "off", True),
      ("12", "lru", True), ("12", "lfru", True), ("7", "off-nopred", False),
      ("7", "lru-flip", False), ("7", LLAMA, False)}
  assert "earlier call" in body and os.path.exists(tmp_path / "cache_rows.json")
  assert "come from `python -m benchmarks.cache --models realistic --budgets 7,12 --arms cache " \
         "--time-limit 540` on the same machine" in body
  # the uniform file's arms and llama.cpp's (on the realistic file) in one call
  third = cache.parser().parse_args(["--models", "uniform", "--arms", "cache,llama", "--rows",
                                     rows_path])
  cache.main(third)
  cmd = started[2][0]
  assert json.loads(cmd[cmd.index("--points") + 1]) == [["uniform", "7", "off"],
                                                        ["uniform", "7", "lru"]]
  assert cmd[cmd.index("--facts") + 1] == "realistic"
  assert ensured == [["realistic"], ["realistic"], ["uniform", "realistic"]]  # the files used


def test_a_child_that_dies_fails_its_arm_and_a_new_one_runs_the_rest(monkeypatch):
  from benchmarks import cache
  started = []

  class Dying:
    """Runs its first point, skips one named "late", dies in the next (exit -11) the first time;
    the next child runs all it gets."""

    def __init__(self, cmd, env, err, log):
      pts = [tuple(p) for p in json.loads(cmd[cmd.index("--points") + 1])]
      started.append((pts, cmd[cmd.index("--facts") + 1]))
      first = len(started) == 1
      run = pts[:1] if first else [p for p in pts if p[2] != "late"]
      self.runs = [_row(*p, 100.0) for p in run]
      self.info = {"meta": {"realistic": {"model": "realistic"}} if first else {},
                   "skipped": [" ".join(p) for p in pts if p[2] == "late"]}
      self.p = types.SimpleNamespace(returncode=-11 if first else 0)

    def wait(self, deadline):
      return self

  monkeypatch.setattr(cache, "Rows", Dying)
  args = cache.parser().parse_args([])
  pts = [("realistic", "7", "off"), ("realistic", "7", "late"), ("realistic", "7", "lru"),
         ("realistic", "7", "lfru")]
  rows, info = cache.children(args, pts, "realistic", time.time() + 300, "0.1", print)
  assert [p for p, _ in started] == [pts, pts[3:]] and started[1][1] == ""  # facts once
  assert [(r.arm, r.ok) for r in rows] == [("off", True), ("lru", False), ("lfru", True)]
  assert "child process died (exit -11)" in rows[1].note
  assert info["skipped"] == ["realistic 7 late"] and "realistic" in info["meta"]
  # no time left for a new child: what is left is listed as not run
  started.clear()
  rows, info = cache.children(args, pts, "", time.time() + 30, "0.1", print)
  assert len(started) == 1 and info["skipped"] == ["realistic 7 late", "realistic 7 lru",
                                                    "realistic 7 lfru"]


# ---- the child's arms, end to end ----------------------------------------------------------------

def test_child_arms_end_to_end(tmp_path, capsys, monkeypatch):
  """Cache off and LRU with every routed expert of a tiny MoE file in the host tier: the cached
  arm hits, reads fewer bytes over the bus and decodes the same greedy tokens."""
  from jaxvt import engine, ffi
  if not ffi.available("cpu"):
    pytest.skip("needs the jaxvt extension")
  if not hasattr(engine, "expert_cache_stats"):
    pytest.skip("the product has no expert cache")
  from benchmarks import cache, offload
  from jaxvt import synth
  path = str(tmp_path / "tiny.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe", n_nextn=1), "q4_k_m", seed=0)
  monkeypatch.setattr(offload, "LOCK", str(tmp_path / "lock"))
  pts = [["realistic", "experts", "off"], ["realistic", "experts", "lru"]]
  args = types.SimpleNamespace(child="arms", points=json.dumps(pts), facts="", realistic=path,
                               uniform=path, budgets="experts", prompt=8, gen=24, repeats=2,
                               temperature=0.0, device_gb=16.0, deadline=0.0, time_limit=120)
  cache.child(args)
  out = capsys.readouterr().out
  rows = {r.arm: r for r in (Row(**json.loads(l[4:])) for l in out.splitlines()
                             if l.startswith("ROW "))}
  off, lru = rows["off"], rows["lru"]
  assert off.ok and lru.ok, out
  assert off.expert_gib > 0 and off.host_mb_per_token > 0 and off.decode_tok_s > 0
  assert lru.cache_gib > 0 and lru.slots > 0 and lru.cached_layers > 0 and lru.policy == "lru"
  assert lru.hits > 0 and lru.hits + lru.misses > 0
  assert lru.host_mb_per_token < off.host_mb_per_token
  assert lru.tokens == off.tokens and lru.gen_tokens == 24 and len(lru.decode_samples) == 2
  meta = json.loads(next(l for l in out.splitlines() if l.startswith("META "))[5:])
  assert meta["budgets"]["experts"]["expert_gib"] == pytest.approx(off.expert_gib)
