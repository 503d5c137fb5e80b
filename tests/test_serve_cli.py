"""python -m jaxvt.serve's command line: --help lists the server's flags and jaxvt.run's placement
flags, and a mistake is one line on stderr with exit status 2, answered before JAX starts."""

import os
import subprocess
import sys

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
               "--prefix-cache-gb", "--port", "--host"):
    assert flag in p.stdout, flag


@pytest.mark.parametrize("args,says", [
    (["--prot", "80"], "did you mean --port"),
    (["--max-batch", "0"], "--max-batch must be between 1 and"),
    (["--offload-gb", "lots"], "--offload-gb"),
    (["--api-key", ""], "--api-key is empty"),
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
