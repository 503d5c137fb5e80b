"""python -m benchmarks.mesh on the CPU: a small qwen35moe file on one device, at tp=2 over two
fake CPU devices of one process and at tp=2 over two processes of one device each (tp=2/2p),
with nothing and with everything offloadable in the host tier.

The bench runs as a subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=2 must be set
before JAX starts; its points run in children of their own, which inherit it) and writes its
section to a file under tmp, never docs/BENCHMARKS.md. The real check is that tp=2's greedy
tokens are the one-device tokens at each budget; the rest checks the table, the per-device
budget and the one-line errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from jaxvt import ffi
from benchmarks import mesh
from jaxvt.errors import JaxvtError
from jaxvt import synth
from test_parallel import FIXTURES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_ffi = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")
MESHES = ("tp=2", "tp=2/2p")
POINTS = {("1", "0"), ("1", "all")} | {(m, b) for m in MESHES for b in ("0", "all")}


def _model(directory) -> str:
  overrides, recipe = FIXTURES["qwen35moe"]  # splits over tp=2 in whole blocks
  path = os.path.join(directory, "qwen35moe.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe", **overrides), recipe, seed=3)
  return path


def _bench(directory, model: str, *args: str, devices: int = 2) -> subprocess.CompletedProcess:
  # LLVM at -O0 compiles these small programs faster (as in tests/test_parallel.py)
  env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(directory),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
             "--xla_backend_optimization_level=0")
  cmd = [sys.executable, "-m", "benchmarks.mesh", "--model", model, "--prompt", "8",
         "--gen", "4", "--out", os.path.join(directory, "BENCHMARKS.md"), *args]
  return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=520)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(stdout, the written section's text, mesh_runs.json) of one bench run: 6 points."""
  d = tmp_path_factory.mktemp("mesh")
  p = _bench(str(d), _model(str(d)), "--meshes", "1,tp=2,tp=2/2p", "--budgets", "0,all",
             "--time-limit", "450")
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  with open(d / "mesh_runs.json") as f:
    runs = json.load(f)
  return p.stdout, (d / "BENCHMARKS.md").read_text(), runs


@needs_ffi
def test_every_point_in_the_table_with_positive_rates(run):
  out, md, runs = run
  assert "<!-- bench:mesh -->" in md and "<!-- /bench:mesh -->" in md
  assert "Devices: 2 x cpu (cpu)" in md and "--meshes 1,tp=2,tp=2/2p --budgets 0,all" in md
  table = [l.split("|")[1:-1] for l in md.splitlines()
           if l.startswith(("| 1 |", "| tp=2 |", "| tp=2/2p |"))]
  assert {(c[0].strip(), c[2].strip()) for c in table} == POINTS and len(table) == 6
  for c in table:
    assert float(c[5]) > 0 and float(c[6]) > 0, c  # prefill, decode tok/s
  rows = {(r["mesh"], r["budget"]): r for r in runs["rows"]}
  assert set(rows) == POINTS and not runs["skipped"]
  for key, r in rows.items():
    assert r["ok"] and not r["note"] and not r["same_as"], r
    assert r["gen_tokens"] == 4 and r["load_s"] > 0 and r["compile_s"] > 0, r
    assert r["devices"] == (2 if key[0] in MESHES else 1)
  # budgets are per device: nothing offloaded at 0; at "all" each tp=2 device holds less
  assert rows[("1", "0")]["host_gib"] == rows[("tp=2", "0")]["host_gib"] == 0
  one, tp, two = rows[("1", "all")], rows[("tp=2", "all")], rows[("tp=2/2p", "all")]
  assert 0 < tp["host_gib"] < one["host_gib"] and tp["device_gib"] < one["device_gib"]
  assert two["host_gib"] == tp["host_gib"]  # each process's device plans as one of a mesh
  assert "POINT tp=2 all: load" in out


@needs_ffi
def test_tp2_greedy_tokens_are_the_one_device_tokens(run):
  _, md, runs = run
  rows = {(r["mesh"], r["budget"]): r for r in runs["rows"]}
  for budget in ("0", "all"):
    one = rows[("1", budget)]["tokens"]
    for m in MESHES:
      assert len(one) == 4 and rows[(m, budget)]["tokens"] == one, (m, budget, one)
  tp_rows = [l for l in md.splitlines() if l.startswith(("| tp=2 |", "| tp=2/2p |"))]
  assert len(tp_rows) == 4 and all("| same |" in l and "x |" in l for l in tp_rows), tp_rows


@needs_ffi
def test_a_mesh_larger_than_the_devices_is_one_line(tmp_path):
  model = str(tmp_path / "absent.gguf")  # refused before the model would be written
  p = _bench(str(tmp_path), model, "--meshes", "1,tp=2", "--budgets", "0", devices=1)
  assert p.returncode == 2, p.stderr[-2000:]
  assert p.stderr.strip() == ("jaxvt: error: --mesh tp=2 needs 2 devices but JAX sees 1 (cpu); "
                              "use a smaller mesh"), p.stderr
  assert not os.path.exists(model) and not (tmp_path / "BENCHMARKS.md").exists()


@pytest.mark.parametrize("args, msg", [
    (("--meshes", "1,tp=two"), "is not AXIS=N"),
    (("--budgets", "0,lots"), "'lots' is not GiB >= 0, 'auto' or 'all'"),
    (("--budgets", "-1"), "'-1' is not GiB"),
    (("--gen", "1"), "--gen >= 2"),
    (("--device-gb", "0"), "--device-gb must be positive"),
])
def test_bad_arguments_are_one_line(args, msg, capsys):
  from benchmarks import __main__ as bench_main
  assert bench_main.main(["mesh", "--model", "/nonexistent.gguf", *args]) == 2
  err = capsys.readouterr().err
  assert msg in err and len(err.strip().splitlines()) == 1, err


def test_parse_meshes_and_budgets():
  assert mesh.parse_meshes("1, tp=2,tp=2+ep=2,tp=2,tp=2+ep=2/2p") == [
      "1", "tp=2", "tp=2,ep=2", "tp=2,ep=2/2p"]
  assert mesh.processes("tp=2,ep=2/2p") == 2 and mesh.mesh_arg("tp=2/2p") == "tp=2"
  assert mesh.mesh_size("tp=2,ep=2/2p") == 4 and mesh.processes("tp=2") == 1
  for bad in ("tp=2/3p", "tp=2/1p", "1/2p", "tp=2/two"):
    with pytest.raises(JaxvtError, match="must be /Np"):
      mesh.parse_meshes(bad)
  assert mesh.parse_budgets("0,auto,all,2.5,0") == ["0", "auto", "all", "2.5"]
  assert [mesh.budget_gib(b) for b in ("0", "auto", "all")] == [0.0, "auto", mesh.ALL_GIB]
  args = types.SimpleNamespace(meshes="1,tp=2", budgets="0,all", prompt=8, gen=4, device_gb=None)
  assert mesh.points(args) == [("1", "0"), ("tp=2", "0"), ("1", "all"), ("tp=2", "all")]
  with pytest.raises(JaxvtError, match="names no mesh"):
    mesh.parse_meshes(" , ")


def test_render_speedups_token_check_and_repeats():
  P = mesh.Point
  rows = [P("1", "0", True, prefill_tok_s=100.0, decode_tok_s=50.0, tokens=[1, 2, 3]),
          P("tp=2", "0", True, devices=2, prefill_tok_s=150.0, decode_tok_s=80.0, tokens=[1, 2, 3]),
          P("1", "auto", True, same_as="0", prefill_tok_s=100.0, decode_tok_s=50.0,
            tokens=[1, 2, 3]),
          P("tp=2", "all", True, devices=2, host_gib=9.0, prefill_tok_s=90.0,
            decode_tok_s=20.0, tokens=[1, 5, 3]),
          P("1", "all", False, note="JaxRuntimeError: RESOURCE_EXHAUSTED")]
  args = types.SimpleNamespace(model="/nonexistent/m.gguf", meshes="1,tp=2", budgets="0,auto,all",
                               prompt=8, gen=3, time_limit=60, device_gb=16.0)
  meta = dict(machine="cpu:test", devices="2 x cpu (cpu)")
  md = mesh.render(rows, meta, args, "today", 12.0, ["tp=2 at auto"])
  lines = [l for l in md.splitlines() if l.startswith(("| 1 |", "| tp=2 |"))]
  assert len(lines) == 5
  assert "| 1.50x | 1.60x | same |" in lines[1]
  assert "the placement of budget 0" in lines[2]
  assert "|  |  |  |" in lines[3]  # no one-device row at "all" to compare with
  assert "RESOURCE_EXHAUSTED" in lines[4]
  assert "emulated 16 GiB card" in md and "Not run (the time limit came first): tp=2 at auto" in md
  rows[4] = P("1", "all", True, prefill_tok_s=100.0, decode_tok_s=40.0, tokens=[1, 2, 3])
  md = mesh.render(rows, meta, args, "today", 12.0, [])
  assert "| 0.90x | 0.50x | differ from token 1 |" in md
