"""python -m jaxvt.serve on a mesh: one process with two CPU devices (--mesh tp=2), and two
processes joined over a loopback coordinator (process 0 owns HTTP and the scheduler, process 1
runs the same programs). The same 8 concurrent clients get the greedy answers of a one-device
server, a chat's next turn reuses the first (cached_tokens), only process 0 writes, and SIGTERM
to process 0 stops both."""

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from jaxvt import ffi, synth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_ffi = pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")
# different token-id prompts (a random model answers text prompts alike), different lengths
PROMPTS = [[(37 * i + 11 * k) % 300 + 5 for k in range(6 + i)] for i in range(8)]


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Servers:
  """python -m jaxvt.serve in `n` processes (0: one, no coordinator) on a free loopback port,
  `devices` CPU devices each; their stderr in files."""

  def __init__(self, tmp, args, n=0, devices=1):
    port = _port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS="--xla_backend_optimization_level=0 "
                         f"--xla_force_host_platform_device_count={devices}")
    base = [sys.executable, "-m", "jaxvt.serve", "--host=127.0.0.1", f"--port={port}", *args]
    cmds = [base]
    if n:
      co = f"127.0.0.1:{_port()}"
      cmds = [base + ["--coordinator", co, "--num-processes", str(n), "--process-id", str(i)]
              for i in range(n)]
    self.logs = [tmp / f"serve-{port}-{i}.log" for i in range(len(cmds))]
    self.outs = [tmp / f"serve-{port}-{i}.out" for i in range(len(cmds))]
    self.procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=open(o, "w"),
                                   stderr=open(l, "w"))
                  for c, l, o in zip(cmds, self.logs, self.outs)]
    self.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
      assert all(p.poll() is None for p in self.procs), self.stderr()
      try:
        if httpx.get(self.url + "/health").status_code == 200:
          return
      except httpx.TransportError:
        time.sleep(0.5)
    self.kill()
    raise AssertionError("the server did not start:\n" + self.stderr())

  def stderr(self) -> str:
    return "\n".join(f"--- process {i}:\n{l.read_text()}" for i, l in enumerate(self.logs))

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()

  def stop(self, timeout=120) -> list[int]:
    """SIGTERM to process 0 only; every process's status."""
    self.procs[0].send_signal(signal.SIGTERM)
    try:
      return [p.wait(timeout) for p in self.procs]
    finally:
      self.kill()


def _ask8(s: Servers) -> list[str]:
  c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)

  def ask(p):
    return c.completions.create(model="m", prompt=p, max_tokens=6, temperature=0).choices[0].text

  with ThreadPoolExecutor(8) as ex:
    return list(ex.map(ask, PROMPTS))


def _turn2_reuses(s: Servers) -> None:
  c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
  first = list(range(20, 50))
  r1 = c.completions.create(model="m", prompt=first, max_tokens=4, temperature=0)
  r2 = c.completions.create(model="m", prompt=first + list(range(60, 66)), max_tokens=4,
                            temperature=0)
  assert r1.usage.prompt_tokens_details.cached_tokens == 0
  assert r2.usage.prompt_tokens_details.cached_tokens == len(first)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  d = tmp_path_factory.mktemp("serve_mesh")
  path = str(d / "qwen3moe.gguf")
  synth.write_model(path, synth.tiny_config("qwen3moe"), "q8_0", seed=3)
  return d, ["--model", path, "--max-context", "128", "--expert-cache-gb", "0"]


@pytest.fixture(scope="module")
def one_device(model):
  d, args = model
  s = Servers(d, args)
  try:
    yield _ask8(s)
  finally:
    assert s.stop() == [0], s.stderr()


@needs_ffi
def test_one_process_two_devices(model, one_device):
  d, args = model
  s = Servers(d, args + ["--mesh", "tp=2"], devices=2)
  try:
    assert _ask8(s) == one_device and any(one_device)
    _turn2_reuses(s)
  finally:
    assert s.stop() == [0], s.stderr()


@needs_ffi
def test_two_processes(model, one_device):
  d, args = model
  s = Servers(d, args + ["--mesh", "tp=2"], n=2)
  try:
    assert _ask8(s) == one_device
    _turn2_reuses(s)
  finally:
    status = s.stop()
  assert status[0] == 0, s.stderr()
  assert status[1] == 0, s.stderr()  # told to stop by process 0
  assert "processes: 2" in s.logs[0].read_text()
  assert s.logs[1].read_text() == "" and s.outs[1].read_text() == ""  # one voice
