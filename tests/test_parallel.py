"""Tensor and expert parallelism (jaxvt.model.sharding, jaxvt.parallel) on the CPU with four fake
devices.

The end-to-end checks run in a subprocess (`python tests/test_parallel.py ARCH DIR`): XLA_FLAGS
(--xla_force_host_platform_device_count=4) must be set before JAX starts, and the rest of the
suite runs on one CPU device. There each fixture runs unsharded and sharded, with and without the
host tier, and the logits of a prefill and of greedy decode steps are compared, as are the tokens.
The rules themselves (every weight covered, shards partition each axis, DeltaNet head order) and
the user errors are checked here, in process, in milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxvt import ffi
from jaxvt.errors import JaxvtError
from jaxvt import synth
from jaxvt.model.declare import declare, gdn_heads
from jaxvt.model import sharding as shard
from jaxvt.parallel import mesh as mesh_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_ffi = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")

# Small fixtures whose every split is whole blocks of their formats (32 elements for Q4_0/Q8_0):
# llama's attention output splits 64 columns into 2 x 32, its FFN down 128 into 2 x 64;
# qwen35moe's DeltaNet out splits per key-head group of 32 value columns, its shared-expert down
# 64 into 2 x 32.
FIXTURES = {
    "llama": (dict(), "q4_0"),
    "qwen35moe": (dict(ssm_k_dim=32, ssm_v_dim=32, shared_ffn_dim=64), "q8_0"),
}
# Meshes per fixture: (mesh, offload): 0 nothing, "all" every offloadable weight, "part" a
# per-device budget of a third of what "all" puts in one device's host tier.
RUNS = {
    "llama": [("tp=2", 0), ("tp=2", "all"), ("tp=2", "part")],
    "qwen35moe": [("tp=2", 0), ("ep=2,tp=2", "all"), ("ep=4", "part")],
}
FUSED = "+fused_norm"  # a run's name with Products.fused_norm on
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
STEPS = 4  # greedy decode steps after the prefill


def _fixture(arch: str, directory: str) -> str:
  overrides, recipe = FIXTURES[arch]
  path = os.path.join(directory, f"{arch}.gguf")
  synth.write_model(path, synth.tiny_config(arch, **overrides), recipe, seed=3)
  return path


def _greedy(eng) -> tuple[list[np.ndarray], list[int]]:
  """Logits of the prefill and of STEPS greedy decode steps, and the greedy tokens."""
  logits, cache = eng.prefill(PROMPT)
  out, toks = [np.asarray(logits)], []
  for i in range(STEPS):
    toks.append(int(np.argmax(out[-1])))
    logits, cache = eng.decode_step(cache, toks[-1], len(PROMPT) + i)
    out.append(np.asarray(logits))
  toks.append(int(np.argmax(out[-1])))
  return out, toks


def _case(arch: str, directory: str) -> dict:
  """Runs in the 4-device subprocess: unsharded and sharded runs of one fixture."""
  import jaxvt
  path = _fixture(arch, directory)
  res = {}
  with jaxvt.load(path, max_context=64) as eng:
    res["base"] = _greedy(eng)
  all_host = None
  for mesh, offload in RUNS[arch]:
    gb = {0: 0, "all": 64, "part": None}[offload]
    if gb is None:  # a third of one device's all-host bytes: the budget is per device
      gb = all_host / 3 / (1 << 30)
    with jaxvt.load(path, max_context=64, mesh=mesh, offload_gb=gb) as eng:
      p = eng.plan.plan
      if offload == "all":
        all_host = p.host_bytes
      w = eng.weights["attn.wq"]
      info = {"devices": eng.plan.devices, "host": p.host_bytes, "budget": p.budget_bytes,
              "host_layers": len(eng.weights["attn.wk"].meta.host_layers),
              "workspace": eng.memory.workspace_source,
              "wq_shards": int(w.data.shape[0]),
              "wq_spec": str(w.data.sharding.spec)}
      res[f"{mesh}/{offload}"] = _greedy(eng) + (info,)
      if (mesh, offload) == RUNS[arch][0]:  # the fused residual norm, on the mesh
        eng.ex = dataclasses.replace(eng.ex, products=dataclasses.replace(
            eng.ex.products, fused_norm=True))
        res[f"{mesh}/{offload}{FUSED}"] = _greedy(eng) + (info,)
  base_logits, base_toks = res.pop("base")
  out = {}
  for name, (logits, toks, info) in res.items():
    scale = max(float(np.abs(l).max()) for l in base_logits)
    err = max(float(np.abs(a - b).max()) for a, b in zip(logits, base_logits))
    out[name] = dict(info, err=err, scale=scale, toks=toks, base_toks=base_toks)
  return out


@pytest.fixture(scope="module", params=list(FIXTURES))
def results(request, tmp_path_factory):
  """(arch, {run: facts}) from a 4-device subprocess (one at a time: on two cores, two such
  processes side by side take longer than one after the other)."""
  arch = request.param
  # LLVM at -O0 compiles these programs ~2.5x faster; unsharded and sharded runs share the flag.
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4 "
             "--xla_backend_optimization_level=0")
  p = subprocess.run([sys.executable, os.path.abspath(__file__), arch,
                      str(tmp_path_factory.mktemp(arch))],
                     capture_output=True, text=True, cwd=ROOT, env=env, timeout=500)
  assert p.returncode == 0, p.stderr[-3000:]
  return arch, json.loads(p.stdout.strip().splitlines()[-1])


@needs_ffi
def test_sharded_equals_unsharded(results):
  """Sharded logits equal the unsharded ones to float32 reassociation, and so do the tokens.

  The sharded forward sums row-parallel partial products (attention out, FFN / shared-expert
  down, DeltaNet out) and per-device expert sums with a psum: the same float32 terms added in
  another order. Each such sum differs by a few ulps of its largest term, and the difference
  grows through 4 layers and the norms by at most a small factor, so 1e-4 of the logits' scale
  bounds it with a wide margin (every other step, column-parallel rows and experts, is the same
  arithmetic on the same bytes). Measured on these fixtures: 0.0 (the CPU kernels' sums happen to
  associate the same way at these sizes)."""
  arch, runs = results
  first = "{}/{}".format(*RUNS[arch][0])
  assert set(runs) == {f"{m}/{o}" for m, o in RUNS[arch]} | {first + FUSED}
  for name, r in runs.items():
    assert r["err"] <= 1e-4 * r["scale"], (name, r)
    assert r["toks"] == r["base_toks"], (name, r)
    # attention heads split over tp (and are replicated over ep); a mesh without tp replicates
    # them, as one device does: no shard axis
    tp = mesh_mod.parse(name.split("/")[0]).tp  # (a fused run: its mesh's)
    assert r["wq_spec"] == ("P('tp',)" if tp > 1 else "P()"), r
    if tp > 1:
      assert r["wq_shards"] == tp, r


@needs_ffi
def test_offload_budget_is_per_device(results):
  arch, runs = results
  for (mesh, offload) in RUNS[arch]:
    r = runs[f"{mesh}/{offload}"]
    assert r["devices"] == mesh_mod.parse(mesh).size
    if offload == 0:
      assert r["host"] == 0 and r["host_layers"] == 0
    elif offload == "all":
      assert r["host"] > 0 and r["host_layers"] > 0
    else:  # "part": a third of one device's host bytes fits in the per-device budget
      assert 0 < r["host"] <= r["budget"]
    if offload != 0:  # a tight plan is checked again with XLA's analysis of the sharded prefill
      assert r["workspace"] == "XLA memory analysis", r


# ---------------------------------------------------------------------------------------------
# Rules (in process, one device)


@pytest.mark.parametrize("arch", synth.ARCHS)
def test_every_weight_has_a_rule_whose_shards_partition_it(arch):
  cfg = synth.tiny_config(arch)
  spec = mesh_mod.MeshSpec(tp=2, ep=2 if cfg.is_moe else 1)
  shard.check(cfg, spec)
  for d in declare(cfg):
    r = shard.rule(d, spec)
    if r.kind == "replicate":
      continue
    n = shard.n_shards(r, spec)
    axis = {"rows": -2, "cols": -1, "experts": 0, "vector": r.axis}[r.kind]
    got = np.sort(np.concatenate([r.index(s) for s in range(n)]))
    assert np.array_equal(got, np.arange(d.shape[axis])), d.name
    assert shard.local_shape(d, r)[axis] * n == d.shape[axis]


@pytest.mark.parametrize("arch", synth.ARCHS)
def test_one_device_is_a_mesh_that_replicates_every_weight(arch):
  """On the 1 x 1 mesh every declaration's rule is "replicate" (one shard, the whole weight),
  the per-device units are the file's and the local config is the model's."""
  cfg = synth.tiny_config(arch)
  one = mesh_mod.MeshSpec()
  decls = declare(cfg)
  assert {shard.rule(d, one).kind for d in decls} == {"replicate"}
  assert shard.local_config(cfg, one) == cfg
  units = [shard.UnitBytes(d.name, l, 100, 2) for d in decls
           for l in (d.layers if d.layers is not None else (None,))]
  assert shard.device_units(units, decls, cfg, one) == (units, {(u.name, u.layer): 1
                                                                for u in units})


@pytest.mark.parametrize("order", ["tiled", "grouped"])
def test_deltanet_shards_keep_the_value_to_key_head_rule(order):
  """Inside a shard, value head j must read key head j % n_k (tiled) or j // (n_v / n_k)
  (grouped) of the shard, exactly the global heads the unsharded model pairs."""
  cfg = synth.tiny_config("qwen35", ssm_k_heads=4, ssm_v_heads=8, ssm_value_order=order)
  glob = lambda j: j % 4 if order == "tiled" else j // 2
  for s in range(2):
    kh, vh = gdn_heads(cfg, 2, s)
    for jl, j in enumerate(vh):
      kl = jl % 2 if order == "tiled" else jl // 2
      assert kh[kl] == glob(j)


def test_shard_bytes_rows_and_cols_reassemble():
  """Column shards (whole blocks) and row shards of a quantized matrix put back together are
  the matrix's bytes."""
  from jaxvt.gguf.quantize import quantize
  from jaxvt.model.declare import Role, WeightDecl
  x = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
  raw = quantize(x, 2)  # Q4_0: 32-element blocks of 18 bytes
  d = WeightDecl("w", (0,), (6, 128), Role.DENSE_FFN, True)  # the rules below, not its split
  cols = shard.Rule("cols", ("tp",), lambda s: np.arange(s * 64, (s + 1) * 64))
  parts = [shard.shard_bytes(raw, 2, d, cols, s).reshape(6, -1) for s in range(2)]
  assert np.array_equal(np.concatenate(parts, axis=1), raw.reshape(6, -1))
  rows = shard.Rule("rows", ("tp",), lambda s: np.arange(s * 3, (s + 1) * 3))
  parts = [shard.shard_bytes(raw, 2, d, rows, s) for s in range(2)]
  assert np.array_equal(np.concatenate(parts), raw.reshape(-1))
  bad = shard.Rule("cols", ("tp",), lambda s: np.arange(s * 48, (s + 1) * 48) % 128)
  with pytest.raises(JaxvtError, match="not whole blocks of 32"):
    shard.shard_bytes(raw, 2, d, bad, 0)


@pytest.mark.parametrize("text, want", [("tp=2", (2, 1)), ("ep=4", (1, 4)), ("tp=2,ep=2", (2, 2)),
                                        ("ep=2 tp=2", (2, 2)), ("1", None), ("tp=1", None)])
def test_parse(text, want):
  spec = mesh_mod.parse(text)
  assert (spec and (spec.tp, spec.ep)) == want


@pytest.mark.parametrize("text", ["tp", "tp=2,tp=2", "dp=2", "tp=0", "tp=x"])
def test_parse_errors(text):
  with pytest.raises(JaxvtError) as e:
    mesh_mod.parse(text)
  assert "\n" not in str(e.value)


def test_model_that_does_not_split_is_refused():
  llama = synth.tiny_config("llama")  # 4 heads, 2 KV heads
  with pytest.raises(JaxvtError, match="2 KV heads do not split over tp=4"):
    shard.check(llama, mesh_mod.MeshSpec(tp=4))
  with pytest.raises(JaxvtError, match="has none; use tp"):
    shard.check(llama, mesh_mod.MeshSpec(ep=2))
  moe = synth.tiny_config("qwen3moe")  # 8 experts
  with pytest.raises(JaxvtError, match="8 experts do not split over ep\\*tp=16"):
    shard.check(moe, mesh_mod.MeshSpec(tp=2, ep=8))
  with pytest.raises(JaxvtError, match="needs 2 devices but JAX sees 1"):
    import jax
    mesh_mod.build(mesh_mod.MeshSpec(tp=2), jax.devices("cpu")[:1])


# ---------------------------------------------------------------------------------------------
# The CLI


def _cli(*args, devices: int = 4):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, "-m", "jaxvt.run", *args], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=300)


@needs_ffi
def test_cli_errors_are_one_line(tmp_path):
  path = _fixture("llama", str(tmp_path))
  for args, msg in [(("--mesh", "tp=4"), "2 KV heads do not split over tp=4"),
                    (("--mesh", "tp=2"), "needs 2 devices but JAX sees 1"),
                    (("--mesh", "tp=two"), "is not AXIS=N"),
                    (("--process-id", "1"), "need --coordinator")]:
    p = _cli("--model", path, "--max-context", "64", "--max-tokens", "2", *args,
             devices=1 if args[1] == "tp=2" else 4)
    assert p.returncode == 2, (args, p.stderr)
    assert msg in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_cli_plan_per_device():
  """`--plan --mesh` plans one device's shards: expert parallelism over 2 devices halves the
  routed experts' bytes, and the budget is per device."""
  # Both budgets are unsafe on 16 GiB: --force prints the plan with exit status 0.
  full = _cli("--model", "qwen3.6-35b-a3b", "--plan", "--device-gb", "16", "--max-context", "4096",
              "--force")
  ep = _cli("--model", "qwen3.6-35b-a3b", "--plan", "--device-gb", "16", "--max-context", "4096",
            "--mesh", "ep=2", "--offload-gb", "2", "--force")
  assert full.returncode == 0 and ep.returncode == 0, ep.stderr
  assert "per device (--mesh ep=2: 2 devices)" in ep.stdout
  gib = lambda text: float(text.split("routed_experts")[1].split()[1])
  assert abs(gib(ep.stdout) + float(ep.stdout.split("routed_experts")[1].split()[3])
             - gib(full.stdout) / 2) < 0.02
  assert "budget 2 GiB" in ep.stdout  # as given


if __name__ == "__main__":  # the 4-device subprocess of `results`
  print(json.dumps(_case(sys.argv[1], sys.argv[2])))
