"""python -m jaxvt.serve's command line: --help lists the server's flags and jaxvt.run's placement
flags, and a mistake is one line on stderr with exit status 2, answered before JAX starts."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(*args):
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  return subprocess.run([sys.executable, "-m", "jaxvt.serve", *args], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=120)


def test_help_lists_the_server_and_placement_flags():
  p = _serve("--help")
  assert p.returncode == 0 and p.stderr == ""
  for flag in ("--offload-gb", "--device-gb", "--max-context", "--api-key", "--max-batch",
               "--prefix-cache-gb", "--port", "--host", "--header-timeout", "--send-timeout",
               "--timeout-keep-alive", "--limit-concurrency"):
    assert flag in p.stdout, flag


@pytest.mark.parametrize("args,says", [
    (["--prot", "80"], "did you mean --port"),
    (["--max-batch", "0"], "--max-batch must be between 1 and"),
    (["--offload-gb", "lots"], "--offload-gb"),
    (["--api-key", ""], "--api-key is empty"),
    (["--send-timeout", "0"], "--send-timeout must be at least 0.1"),
    (["--header-timeout", "nan"], "--header-timeout"),
    (["--limit-concurrency", "0"], "--limit-concurrency must be between 1 and"),
    (["--mesh", "tp=2,tp=4"], "names 'tp' twice"),
    (["--coordinator", "nohost"], "must be HOST:PORT"),
    (["--model", "/nonexistent/model.gguf"], "not found"),
    (["extra"], "takes no arguments")])
def test_a_mistake_is_one_line_and_status_2(args, says):
  p = _serve(*args)
  lines = p.stderr.strip().splitlines()
  assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("jaxvt: error: ")
  assert says in lines[0], lines[0]
  assert "Traceback" not in p.stderr


def test_a_busy_port_is_refused_before_the_model_loads():
  """A port another server listens on: one line naming the port and the fix, status 2, and
  nothing loaded first (no placement report)."""
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    p = _serve("--host", "127.0.0.1", "--port", str(port))
  lines = p.stderr.strip().splitlines()
  assert p.returncode == 2 and len(lines) == 1, p.stderr
  assert lines[0].startswith("jaxvt: error: ") and f"port {port} is in use" in lines[0]
  assert "--port" in lines[0]


def _readme_client() -> str:
  """The Python client example in README's Serving section."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  section = text[text.index("\n## Serving\n"):]
  section = section[:section.index("\n## ", 1)]
  return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def _requirement_names(reqs) -> set[str]:
  return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_the_readmes_client_example_needs_only_the_serve_extra():
  """Every package the example imports comes with `pip install '.[serve]'`."""
  import ast
  import importlib.metadata
  import tomllib
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  installed = _requirement_names(project["dependencies"] +
                                 project["optional-dependencies"]["serve"])
  dists = importlib.metadata.packages_distributions()
  tree = ast.parse(_readme_client())
  modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
  assert modules
  for module in modules:
    top = module.split(".")[0]
    if top in sys.stdlib_module_names:
      continue
    names = {d.lower().replace("_", "-") for d in dists.get(top, [])}
    assert names & installed, (module, names, sorted(installed))


def test_serving_is_said_once_the_port_listens():
  """--port 0: the system picks the port, and the "serving on" line names it once a client can
  connect (read the line, connect at once, ask /health); README's client example, pointed at
  that port, gets an answer."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
         "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.Popen([sys.executable, "-m", "jaxvt.serve", "--host", "127.0.0.1",
                           "--port", "0", "--max-batch", "1", "--prefix-cache-gb", "0"],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
                          env=env)
  try:
    deadline = time.monotonic() + 300
    seen = []
    while time.monotonic() < deadline:
      line = proc.stderr.readline()
      assert line, "".join(seen)  # the server exited before saying it serves
      seen.append(line)
      if "serving" in line:
        break
    m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", seen[-1])
    assert m and int(m.group(1)) != 0, seen[-1]
    with socket.create_connection(("127.0.0.1", int(m.group(1))), timeout=5) as conn:
      conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
      assert conn.recv(64).startswith(b"HTTP/1.1 200"), seen
    example = _readme_client().replace("127.0.0.1:8000", f"127.0.0.1:{m.group(1)}")
    assert example != _readme_client()
    p = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip(), p.stderr
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(timeout=60)
    finally:
      if proc.poll() is None:
        proc.kill()
