"""What the command line says about itself and around a run: --help, --version, a PROMPT
argument, the hint for a flag it does not know, only jaxvt's own lines on stderr (XLA's logs and
JAX's warnings silenced unless --verbose), XLA's out-of-memory error as one line, the progress
bar and timing lines, the cache without a home directory, and the chat template's renderer
dying with the CLI.

The flags' own list is the reference for --help (every flag the CLI defines is shown under its
dashed spelling); versions are compared with the installed packages' metadata.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest

from hostile_models import one_line_error, write_model
from jaxvt import run, usage
from jaxvt.errors import JaxvtError, JaxvtWarning, out_of_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lines a run prints on stderr: the plan, the progress bar, the timings, jaxvt's notes.
OWN = re.compile(r"(placement:|  |device memory|loading weights|load |compile |prefill |decode |"
                 r"jaxvt: )")


def cli(*args: str, env: dict | None = None, timeout: float = 300, **kw):
  full = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  full.update(env or {})
  return subprocess.run([sys.executable, "-m", "jaxvt.run", *args], capture_output=True,
                        text=True, cwd=kw.pop("cwd", ROOT), env=full, timeout=timeout, **kw)


def in_process(capsys, *args: str) -> tuple[int, str, str]:
  rc = run.main(["jaxvt.run", *args])
  out, err = capsys.readouterr()
  return rc, out, err


# ---- --help, --version, arguments ----------------------------------------------------------

@pytest.mark.parametrize("flag", ["--help", "-h", "--helpfull"])
def test_help_lists_every_flag_in_groups_without_starting_jax(flag):
  code = ("import sys; from jaxvt import run; rc = run.main(['jaxvt.run', %r]); "
          "sys.stderr.write('jax imported' if 'jax' in sys.modules else ''); sys.exit(rc)" % flag)
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                     timeout=60)
  assert p.returncode == 0 and p.stderr == "", p.stderr
  text = p.stdout
  for title, _ in usage.GROUPS:
    assert f"\n{title}:\n" in text
  for name in run.FLAGS:
    f = run.FLAGS[name]
    if name == f.name and name not in ("flagfile", "undefok"):
      assert usage.spelling(name) in text or f"--[no]{name.replace('_', '-')}" in text, name
  assert "python -m jaxvt.run \"" in text and "--offload-gb auto --plan" in text  # examples
  assert "--nochat" in text and "raw text" in text  # how to turn the chat template off
  assert ("\nenvironment:\n  JAXVT_EXPORT_STORE" in text) == (flag == "--helpfull")
  assert max(len(l) for l in text.splitlines()) <= 100


def _descriptions(text: str) -> dict[str, str]:
  """--help's flag entries: the flag's dashed name -> (metavariable, its description with the
  wrapped lines joined by spaces)."""
  out, name = {}, None
  for line in text.splitlines():
    m = re.match(r"  (?:-\w, )?--(?:\[no\])?([\w-]+)(?: (\S+))?(?:\s{2,}(.*))?$", line)
    if m:
      name = m.group(1)
      out[name] = [m.group(2), m.group(3) or ""]
    elif name and line.startswith(" " * 30):
      out[name][1] = (out[name][1] + " " + line.strip()).strip()
    else:
      name = None
  return out


@pytest.mark.parametrize("module", ["jaxvt.run", "jaxvt.serve"])
def test_help_shows_each_flags_own_words(module):
  """Each flag's description is its help string word for word (absl's "<a|b>: " enum prefix and
  "repeat this option to specify a list of values" suffix left out, no word broken across
  lines), and every value flag names a metavariable (no --port X)."""
  p = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                     cwd=ROOT, timeout=60)
  assert p.returncode == 0, p.stderr
  import importlib
  fv = importlib.import_module(module if module == "jaxvt.run" else module + ".__main__").FLAGS
  shown = _descriptions(p.stdout)
  assert "repeat this option" not in p.stdout and "<lru|lfru>" not in p.stdout
  for line in p.stdout.splitlines():
    assert not re.search(r"[A-Za-z]-$", line), line  # a word broken at its hyphen
  for n in fv:
    f = fv[n]
    if n != f.name or n in ("flagfile", "undefok"):
      continue
    metavar, said = shown[n.replace("_", "-")]
    assert (metavar is None) == (f.flag_type() == "bool"), (n, metavar)
    assert metavar != "X", n
    own = f.help.replace(";\n    repeat this option to specify a list of values", "")
    if f.flag_type() == "string enum":
      own = own[len("<" + "|".join(f.parser.enum_values) + ">: "):]
    assert " ".join(said.split()).startswith(" ".join(own.rstrip(".").split())), (n, said)


def test_version_names_the_installed_packages(capsys):
  rc, out, err = in_process(capsys, "--version")
  assert rc == 0 and err == ""
  import jaxvt
  assert out.startswith(f"jaxvt {jaxvt.__version__}\n")
  assert f"jax {importlib.metadata.version('jax')}" in out
  assert f"jaxlib {importlib.metadata.version('jaxlib')}" in out
  assert "extension: " in out


class _EditableFinder:
  """What an editable install (scikit-build-core's redirect mode) puts on sys.meta_path: the
  compiled module lives in site-packages, not beside the sources."""

  def __init__(self, origin: str):
    self.origin = origin

  def find_spec(self, fullname, path=None, target=None):
    if fullname != "jaxvt.ffi._jaxvt_ffi":
      return None
    import importlib.machinery
    return importlib.machinery.ModuleSpec(fullname, None, origin=self.origin)


def test_version_finds_the_extension_where_the_import_would(tmp_path, monkeypatch):
  built = tmp_path / "site" / "_jaxvt_ffi.cpython-311-x86_64-linux-gnu.so"
  built.parent.mkdir()
  built.write_bytes(os.urandom(4096))
  monkeypatch.setattr(sys, "meta_path", [_EditableFinder(str(built)), *sys.meta_path])
  import hashlib
  want = hashlib.sha256(built.read_bytes()).hexdigest()[:16]
  assert usage.extension_build() == f"{built.name} (sha256 {want})"
  monkeypatch.setattr(sys, "meta_path", [_EditableFinder(str(tmp_path / "gone.so")),
                                         *sys.meta_path[1:]])
  assert usage.extension_build().startswith("not built")


@pytest.mark.parametrize("args,needle", [
    (["--no-such-flag"], "unknown flag --no-such-flag; see --help"),
    (["--temprature", "0.5"], "did you mean --temperature?"),
    (["--max-token", "3"], "did you mean --max-tokens"),
    (["--offload", "3"], "--offload-gb or --offload-pattern"),
    (["--nochatt"], "did you mean --nochat"),
])
def test_unknown_flag_is_one_line_with_a_hint(capsys, args, needle):
  rc, out, err = in_process(capsys, *args)
  line = one_line_error(rc, out, err, needle)
  assert line.endswith("see --help")


def test_help_wins_over_a_bad_flag(capsys):
  rc, out, err = in_process(capsys, "--no-such-flag", "--help")
  assert rc == 0 and err == "" and out.startswith(usage.USAGE)


def test_prompt_argument(monkeypatch, capsys):
  """A PROMPT argument is the prompt (as --prompt); two, or one with --prompt, are refused."""
  seen = []
  monkeypatch.setattr(run, "_run", lambda F, prompt, interrupts: seen.append(prompt) or 0)
  assert in_process(capsys, "Why is the sky blue?")[0] == 0
  assert in_process(capsys, "--max-tokens", "3", "--", "--not-a-flag")[0] == 0
  assert in_process(capsys, "--prompt", "hi")[0] == 0
  assert in_process(capsys)[0] == 0
  assert seen == ["Why is the sky blue?", "--not-a-flag", "hi", None]
  one_line_error(*in_process(capsys, "two", "words"), "one PROMPT argument", "quote")
  one_line_error(*in_process(capsys, "--prompt", "a", "b"), "given twice")


def test_prompt_argument_must_be_utf8(capsys):
  one_line_error(*in_process(capsys, "caf\udce9"), "the prompt is not valid UTF-8")


def test_plan_goes_to_stdout_as_the_readme_says():
  """--plan's plan is the command's output (stdout, so `--plan > plan.txt` keeps it); in a run
  the plan is a report beside the answer (stderr). The README's flag table says the same."""
  p = cli("--plan", timeout=300)
  assert p.returncode == 0 and p.stderr == "", p.stderr
  assert p.stdout.startswith("model: ") and "offload plan: budget" in p.stdout
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    row = [l for l in f if l.startswith("| `--plan` |")]
  assert len(row) == 1 and "to stdout" in row[0], row


def test_default_context_follows_a_shorter_trained_context(tmp_path):
  """A model trained on 256 tokens: without --max-context the run uses 256 and says so in one
  note; --max-context 2048 given explicitly is still refused in one line."""
  path = write_model(tmp_path / "short.gguf", tensors=True,
                     metadata={"llama.context_length": 256})
  p = cli("--model", path, "--max-tokens", "2", "--nocompile-cache")
  assert p.returncode == 0, p.stderr
  notes = [l for l in p.stderr.splitlines() if l.startswith("jaxvt: note:")]
  assert len(notes) == 1 and "trained context is 256 tokens" in notes[0], p.stderr
  assert "using 256" in notes[0]
  p = cli("--model", path, "--max-context", "2048", "--max-tokens", "2", "--nocompile-cache")
  one_line_error(p.returncode, p.stdout, p.stderr, "--max-context 2048 is outside 1..256")


# ---- only jaxvt's lines ----------------------------------------------------------------------

def test_quiet_keeps_jaxvt_notes_and_drops_jax_warnings(capsys, caplog):
  import logging
  for verbose in (False, True):
    caplog.clear()
    with run.quiet(verbose):
      warnings.warn("a read-only cache", UserWarning)
      warnings.warn(JaxvtWarning("the cache went elsewhere"))
      logging.getLogger("jax._src.compiler").warning("a JAX log record")
    err = capsys.readouterr().err
    assert "jaxvt: note: the cache went elsewhere\n" in err
    assert ("a read-only cache" in err) == verbose, err
    assert ("a JAX log record" in caplog.text) == verbose, caplog.text
  assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ or os.environ["TF_CPP_MIN_LOG_LEVEL"] != "3"


def test_only_jaxvt_lines_reach_stderr(tmp_path):
  """XLA made chatty (TF_CPP_MIN_LOG_LEVEL=0 logs its INFO lines as JAX starts): the CLI shows
  only its own lines."""
  env = {"TF_CPP_MIN_LOG_LEVEL": "0", "JAXVT_COMPILE_CACHE": str(tmp_path)}
  p = cli("--max-tokens", "2", env=env)
  assert p.returncode == 0, p.stderr
  stray = [l for l in p.stderr.splitlines() if l.strip() and not OWN.match(l)]
  assert not stray, p.stderr


def test_verbose_lets_xla_logs_through():
  """--plan starts XLA's CPU client, which logs INFO lines at TF_CPP_MIN_LOG_LEVEL=0."""
  env = {"TF_CPP_MIN_LOG_LEVEL": "0"}
  for flags, shown in (((), False), (("-v",), True)):
    p = cli("--plan", *flags, env=env)
    assert p.returncode == 0, p.stderr
    assert bool([l for l in p.stderr.splitlines() if re.match(r"[IWE]\d{4} ", l)]) == shown


def test_out_of_memory_is_one_line(monkeypatch, capsys):
  """XLA's RESOURCE_EXHAUSTED, from a compile or a run, is jaxvt's one line naming the fixes;
  any other error of JAX's keeps its traceback."""
  import jax
  from jaxvt import engine

  oom = jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 20218095692 bytes.\nTRACE LINE")

  def load(*a, **k):
    raise oom

  monkeypatch.setattr(engine, "load", load)
  line = one_line_error(*in_process(capsys, "--max-tokens", "1"), "does not fit",
                        "--offload-gb", "--max-context", "20218095692")
  assert "TRACE LINE" not in line
  assert out_of_memory(RuntimeError("RESOURCE_EXHAUSTED")) is None  # not JAX's: a bug
  assert out_of_memory(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: x")) is None
  assert isinstance(out_of_memory(jax.errors.JaxRuntimeError("CUDA: out of memory")), JaxvtError)


# ---- what a run prints ---------------------------------------------------------------------------

def test_bar_reaches_100_percent(monkeypatch):
  err = io.StringIO()
  monkeypatch.setattr(sys, "stderr", err)
  bar = run.Bar(1000, tty=True)
  for _ in range(9):
    bar(100)  # a weight the run never places: 90% when the load ends
  bar.finish(done=True)
  text = err.getvalue()
  assert text.endswith("100%\n") and text.count("\n") == 1
  assert " 90%" in text


def test_counts_are_singular_for_one():
  class S:
    generated_tokens, decode_steps, decode_seconds, decode_tok_s = 2, 1, 0.5, 2.0
    prompt_tokens, prefill_seconds, prefill_tok_s, compile_seconds = 1, 0.1, 10.0, 0.0

  class Out:
    stats, stopped_by = S, "max_tokens"

  class Eng:
    load_seconds, check_seconds, load_times, warm_seconds, place_seconds = 1.0, 0, None, 0, 0

  text = run.timing_report(Eng, Out, compiled=1, cached=0)
  assert "(1 program compiled, 0 loaded" in text
  assert text.count("for 1 token: ") == 2 and "1 tokens" not in text and "1 programs" not in text


# ---- no home directory -----------------------------------------------------------------------

_NO_PASSWD = ("import pwd, runpy, sys\n"
              "def getpwuid(uid): raise KeyError(f'getpwuid(): uid not found: {uid}')\n"
              "pwd.getpwuid = getpwuid\n"
              "sys.argv[0] = 'jaxvt.run'\n"
              "runpy.run_module('jaxvt.run', run_name='__main__', alter_sys=True)\n")


def test_no_home_directory_caches_in_a_temporary_directory(tmp_path):
  """HOME unset and no passwd entry (a container run with --user): os.path.expanduser gives
  "~" back. The cache goes to <tmp>/jaxvt-cache-<uid>, not ./~/.cache/jaxvt, said once."""
  work, tmp = tmp_path / "work", tmp_path / "tmp"
  work.mkdir()
  tmp.mkdir()
  env = {k: v for k, v in os.environ.items()
         if k not in ("HOME", "XDG_CACHE_HOME", "JAXVT_COMPILE_CACHE")}
  env.update(JAX_PLATFORMS="cpu", TMPDIR=str(tmp), PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-c", _NO_PASSWD, "--max-tokens", "2"], capture_output=True,
                     text=True, cwd=work, env=env, timeout=300)
  assert p.returncode == 0, p.stderr
  notes = [l for l in p.stderr.splitlines() if l.startswith("jaxvt: note:")]
  cache = tmp / f"jaxvt-cache-{os.getuid()}"
  assert len(notes) == 1 and "no home directory" in notes[0] and str(cache) in notes[0], p.stderr
  assert not os.listdir(work)  # no ./~ in the working directory
  assert (cache / "xla").is_dir()


def test_no_home_directory_refuses_a_shared_directory(tmp_path, monkeypatch):
  """A <tmp>/jaxvt-cache-<uid> that others can write to (made by another user to plant
  compiled programs) is not used: a fresh private directory is."""
  from jaxvt import cachedir
  monkeypatch.delenv("HOME", raising=False)
  monkeypatch.setattr(os.path, "expanduser", lambda p: p)
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
  planted = tmp_path / f"jaxvt-cache-{os.getuid()}"
  planted.mkdir()
  planted.chmod(0o777)
  cachedir._homeless_root.cache_clear()  # pylint: disable=protected-access
  try:
    with pytest.warns(JaxvtWarning, match="for this run only"):
      root = cachedir.default_root({})
  finally:
    cachedir._homeless_root.cache_clear()  # pylint: disable=protected-access
  assert os.path.dirname(root) == str(tmp_path) and root != str(planted)
  assert os.stat(root).st_mode & 0o777 == 0o700
  assert cachedir.default_root({"XDG_CACHE_HOME": "/x"}) == "/x/jaxvt"


def _uid_without_passwd() -> int:
  import pwd
  for uid in range(12345, 13345):
    try:
      pwd.getpwuid(uid)
    except KeyError:
      return uid
  raise AssertionError("every uid from 12345 to 13344 has a passwd entry")


def test_no_home_and_no_passwd_entry_answers_in_the_chat_template(tmp_path):
  """A real uid with no passwd entry (a user namespace maps this process to one) and no HOME:
  the chat template's renderer, a child process, starts in the same conditions (no
  monkeypatched pwd there) and the run answers."""
  uid = _uid_without_passwd()
  ns = ["unshare", "--user", f"--map-user={uid}", f"--map-group={uid}"]
  try:
    probe = subprocess.run([*ns, "true"], capture_output=True, timeout=30)
  except FileNotFoundError:
    pytest.skip("no unshare(1) here")
  if probe.returncode != 0:
    pytest.skip(f"no user namespaces here ({probe.stderr.decode().strip()})")
  env = {k: v for k, v in os.environ.items()
         if k not in ("HOME", "XDG_CACHE_HOME", "JAXVT_COMPILE_CACHE")}
  env.update(JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path), PYTHONPATH=ROOT)
  code = ("import os, sys\n"
          "assert os.getuid() == %d and os.path.expanduser('~') == '~', 'not homeless'\n"
          "from jaxvt import run\n"
          "sys.exit(run.main(['jaxvt.run', '--max-tokens', '4']))\n" % uid)
  p = subprocess.run([*ns, sys.executable, "-c", code], capture_output=True, text=True,
                     cwd=tmp_path, env=env, timeout=300)
  assert p.returncode == 0 and p.stdout.strip(), p.stderr
  assert f"uid {uid} has no passwd entry" in p.stderr


# ---- the chat template's renderer dies with the CLI ------------------------------------------

def _children(pid: int) -> list[int]:
  out = []
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[1]) == pid and fields[0] != "Z":
        out.append(int(d))
  return out


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_sigterm_while_the_template_renders_ends_its_child(tmp_path):
  path = write_model(tmp_path / "m.gguf", metadata={
      "tokenizer.chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}"
                                 "{% endfor %}{% endfor %}"})
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.Popen([sys.executable, "-m", "jaxvt.run", "--model", path], cwd=ROOT, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 60
    while not (kids := _children(p.pid)):
      assert p.poll() is None and time.monotonic() < deadline
      time.sleep(0.02)
    time.sleep(0.3)  # the child is past its start, rendering
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    deadline = time.monotonic() + 2.0  # its CPU limit would end it only after seconds
    while any(_alive(k) for k in kids):
      assert time.monotonic() < deadline, [k for k in kids if _alive(k)]
      time.sleep(0.02)
  finally:
    if p.poll() is None:
      p.kill()
