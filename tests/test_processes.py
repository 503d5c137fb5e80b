"""Runs over several processes (jaxvt.parallel.processes, .guard, .voice) on the CPU: two
processes joined over a loopback coordinator on a free port, collectives over gloo, every process
bounded in time.

Greedy tokens of `python -m jaxvt.run` and of the Python API over two processes equal one
process's for tp=2 and ep=2 (one CPU device a process) and tp=2,ep=2 (two a process, through
--xla_force_host_platform_device_count), on a qwen3moe and a qwen35moe (hybrid) file, with the
routed experts in the host tier too. Only process 0 writes (nothing but the answer on stdout);
a process killed, or SIGTERM to process 0, stops the other with one line; every mistake (an
unreachable coordinator, a port in use, mismatched --num-processes, a process id out of range,
another model file or other flags in one process, a mesh larger than the devices) is one line
and exit status 2 in bounded time.

The API runs execute this file as a script (`python tests/test_processes.py api ...`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxvt import ffi, synth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_ffi = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")
PROMPT = "The capital of France"
TOKENS = 6
TIMEOUT = 240  # seconds any one process may take (two cores shared with the rest of a run)
FILES = {
    "qwen3moe": dict(),
    "qwen35moe": dict(ssm_k_dim=32, ssm_v_dim=32, shared_ffn_dim=64),
}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int = 1) -> dict:
  flags = "--xla_backend_optimization_level=0"  # compiles ~2.5x faster, in every arm alike
  if devices > 1:
    flags += f" --xla_force_host_platform_device_count={devices}"
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags,
              PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def start(cmds: list[list[str]], devices: int = 1) -> list[subprocess.Popen]:
  return [subprocess.Popen(c, cwd=ROOT, env=_env(devices), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for c in cmds]


def finish(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[tuple]:
  """(status, stdout, stderr) of each process; kills them all past `timeout`."""
  out, end = [], time.monotonic() + timeout
  try:
    for p in procs:
      o, e = p.communicate(timeout=max(1.0, end - time.monotonic()))
      out.append((p.returncode, o, e))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return out


def run_cli(args: list[str], n: int = 2, devices: int = 1, per: dict | None = None,
            port: int | None = None) -> list[tuple]:
  """`python -m jaxvt.run ARGS` in `n` processes joined on a free loopback port (`per`:
  process id -> extra arguments of that process); n=0: one process, no coordinator."""
  base = [sys.executable, "-m", "jaxvt.run", *args]
  if n == 0:
    return finish(start([base], devices))
  port = port or free_port()
  cmds = [base + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                  "--process-id", str(i), *(per or {}).get(i, [])] for i in range(n)]
  return finish(start(cmds, devices))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("procs")
  out = {}
  for arch, kw in FILES.items():
    out[arch] = str(d / f"{arch}.gguf")
    synth.write_model(out[arch], synth.tiny_config(arch, **kw), "q8_0", seed=3)
  return out


def _gen(path: str, *extra: str) -> list[str]:
  return ["--model", path, "--nochat", "--max-tokens", str(TOKENS), "--max-context", "64",
          "--expert-cache-gb", "0", *extra, PROMPT]


def _one_line(status, err: str, says: str, code: int = 2) -> None:
  lines = err.strip().splitlines()
  assert status == code and len(lines) == 1 and lines[0].startswith("jaxvt: error: "), err
  assert says in lines[0], lines[0]


def _same_as_one(files, arch: str, mesh: str, devices: int, *extra: str) -> None:
  (s1, alone, e1), = run_cli(_gen(files[arch], *extra), n=0)
  assert s1 == 0, e1
  (s0, out0, err0), (s1, out1, err1) = run_cli(_gen(files[arch], "--mesh", mesh, *extra),
                                               devices=devices)
  assert s0 == 0 and s1 == 0, err0 + err1
  assert out0 == alone and out0.strip()  # the same greedy text: the same tokens
  assert out1 == "" and err1 == ""  # one voice
  assert "[Gloo]" not in out0
  assert "processes: 2" in err0 and "decode" in err0


@needs_ffi
def test_cli_tp2_over_two_processes_is_one_process(files):
  _same_as_one(files, "qwen3moe", "tp=2", 1)


@needs_ffi
@pytest.mark.parametrize("arch,mesh,devices,offload", [
    ("qwen3moe", "ep=2", 1, "0"),
    ("qwen3moe", "tp=2,ep=2", 2, "64"),
    ("qwen35moe", "tp=2", 1, "64"),
    ("qwen35moe", "tp=2,ep=2", 2, "0"),
])
def test_cli_meshes_over_two_processes(files, arch, mesh, devices, offload):
  """offload 64: every offloadable weight (the routed experts among them) in the host tier."""
  _same_as_one(files, arch, mesh, devices, "--offload-gb", offload)


def _api_tokens(path: str, mesh: str | None, offload: float, n: int, devices: int) -> list:
  script = [sys.executable, os.path.abspath(__file__), "api", path, mesh or "", str(offload)]
  if n == 1:
    (status, out, err), = finish(start([script + ["", "1", "0"]], devices))
    assert status == 0, err
    return json.loads(out.splitlines()[-1])
  port = free_port()
  res = finish(start([script + [f"127.0.0.1:{port}", str(n), str(i)] for i in range(n)],
                     devices))
  assert all(s == 0 for s, _, _ in res), "\n".join(e[-2000:] for _, _, e in res)
  # the last line: gloo's own "[Gloo] Rank 0 is connected ..." may come first (the user's
  # program, not the CLI, owns this stdout)
  return json.loads(res[0][1].splitlines()[-1])


@needs_ffi
@pytest.mark.parametrize("arch", list(FILES))
def test_api_over_two_processes_is_one_process(files, arch):
  """jax.distributed.initialize (the user's) + jaxvt.load(mesh=tp=2,ep=2), experts in the host
  tier: the same greedy tokens as one process."""
  alone = _api_tokens(files[arch], None, 0, 1, 1)
  both = _api_tokens(files[arch], "tp=2,ep=2", 64, 2, 2)
  assert both == alone and len(alone) == TOKENS


def _api_main(path, mesh, offload, coordinator, n, pid) -> None:
  import jax
  if coordinator:
    jax.distributed.initialize(coordinator, int(n), int(pid))
  import jaxvt
  from jaxvt.sampling import SamplingParams
  with jaxvt.load(path, max_context=64, mesh=mesh or None, offload_gb=float(offload),
                  expert_cache_gb=0) as eng:
    ids = eng.tokenizer.encode(PROMPT)
    out = eng.generate(ids, max_tokens=TOKENS, sampling=SamplingParams(0.0, 0, 1.0))
  if jax.process_index() == 0:
    print(json.dumps(out.tokens))


# ---------------------------------------------------------------------------------------------
# Faults and mistakes: one line, a bounded time.

def test_process_id_out_of_range_is_answered_before_jax():
  (status, out, err), = run_cli(["--coordinator", "127.0.0.1:1", "--num-processes", "2",
                                 "--process-id", "2", "x"], n=0)
  _one_line(status, err, "--process-id must be between 0 and 1")
  assert out == ""


def test_unreachable_coordinator_is_one_line(files):
  port = free_port()  # nobody listens there
  t0 = time.monotonic()
  (status, out, err), = finish(start([[
      sys.executable, "-m", "jaxvt.run", *_gen(files["qwen3moe"]), "--coordinator",
      f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1", "--join-timeout", "2"]]))
  _one_line(status, err, "could not join the run")
  assert out == "" and time.monotonic() - t0 < 120


def test_coordinator_port_in_use_is_one_line(files):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    (status, out, err), = finish(start([[
        sys.executable, "-m", "jaxvt.run", *_gen(files["qwen3moe"]), "--coordinator",
        f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"]]))
  _one_line(status, err, f"port {port} is in use")


@needs_ffi
def test_another_model_file_in_one_process_is_one_line_in_each(files):
  res = run_cli(_gen(files["qwen3moe"], "--mesh", "tp=2"),
                per={1: ["--model", files["qwen35moe"]]})
  for pid, (status, out, err) in enumerate(res):
    _one_line(status, err, "run every process with the same model file and flags")
    assert "model" in err and out == ""


@needs_ffi
@pytest.mark.parametrize("other,says", [
    (["--max-tokens", "5"], "max_tokens"),
    (["--mesh", "ep=2"], "mesh"),
])
def test_other_flags_in_one_process_are_one_line_in_each(files, other, says):
  res = run_cli(_gen(files["qwen3moe"], "--mesh", "tp=2"), per={1: other})
  for status, out, err in res:
    _one_line(status, err, says)


def test_mismatched_num_processes_is_one_line_in_each(files):
  port = free_port()
  base = [sys.executable, "-m", "jaxvt.run", *_gen(files["qwen3moe"]), "--coordinator",
          f"127.0.0.1:{port}", "--join-timeout", "5"]
  res = finish(start([base + ["--num-processes", "2", "--process-id", "0"],
                      base + ["--num-processes", "3", "--process-id", "2"]]))
  for status, out, err in res:
    _one_line(status, err, "could not join the run")


@needs_ffi
def test_mesh_larger_than_the_devices_is_one_line_in_each(files):
  res = run_cli(_gen(files["qwen3moe"], "--mesh", "ep=4"))
  for status, out, err in res:
    _one_line(status, err, "needs 4 devices")


@needs_ffi
@pytest.mark.parametrize("victim,sig", [(1, signal.SIGKILL), (0, signal.SIGTERM)])
def test_a_process_gone_stops_the_other_with_one_line(files, victim, sig):
  """Process 1 killed, or SIGTERM to process 0, in the middle of the run: the other process
  says so in one line and exits with status 1 within the heartbeat's bound."""
  port = free_port()
  base = [sys.executable, "-m", "jaxvt.run", "--model", files["qwen3moe"], "--nochat",
          "--max-tokens", "240", "--max-context", "256", "--expert-cache-gb", "0", "--mesh",
          "tp=2", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", PROMPT]
  procs = start([base + ["--process-id", str(i)] for i in range(2)])
  # the plan is printed once both have joined and placed; the signal comes while they compile
  # and decode (a quiet machine decodes this tiny model's tokens in about a second)
  for line in procs[0].stderr:
    if line.startswith("placement:"):
      break
  time.sleep(0.3)
  procs[victim].send_signal(sig)
  t0 = time.monotonic()
  survivor = procs[1 - victim]
  out, err = survivor.communicate(timeout=TIMEOUT)
  procs[victim].communicate(timeout=TIMEOUT)
  assert survivor.returncode == 1, err
  assert time.monotonic() - t0 < 60
  lines = [l for l in err.splitlines() if l.startswith("jaxvt: error")]
  assert len(lines) == 1 and "another process of the run" in lines[0], err
  assert "Traceback" not in err and "Check failure" not in err


if __name__ == "__main__":
  if sys.argv[1] == "api":
    _api_main(*sys.argv[2:])
