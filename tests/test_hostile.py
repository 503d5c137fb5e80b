"""Every bad input to the CLI gets one line and exit status 2 (Ctrl-C: one line and 130).

A corpus of hostile inputs, built at test time from the default model (tests/hostile_models.py):
special files and paths, corrupt headers, hostile metadata (terminal escapes, wrong types, absurd
sizes), hostile chat templates (exceptions, endless loops, huge output, memory, recursion) and
bad flag values. Each case runs through `jaxvt.run.main` in this process (the CLI's own code
path after argv, fast because the file is refused before anything is loaded) and asserts: exit
status 2, exactly one line on stderr, no traceback, no control character in what was printed,
and a bounded time. A few cases run as real subprocesses: a FIFO (which used to block forever),
argv bytes that are not UTF-8 (only a real process gets them from the OS), hostile metadata and
a runaway template end to end, and Ctrl-C at three moments of a run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hostile_models import (control_chars, fifo, one_line_error, patched, small_gguf,
                            write_model)
from jaxvt import run
from jaxvt.gguf import chat_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ESC = "\x1b[2J\x1b]0;pwned\x07"  # clear the screen, retitle the terminal
TINY_VOCAB = {"tokenizer.ggml.tokens": ["<|im_start|>", "<s>", "</s>", "a", "b", "ab"],
              "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1],
              "tokenizer.ggml.merges": ["a b"], "llama.vocab_size": 6}
NO_VOCAB = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def main_in_process(capsys, *args: str, limit_s: float = 60.0) -> tuple[int, str, str]:
  t0 = time.monotonic()
  rc = run.main(["jaxvt.run", *args])
  elapsed = time.monotonic() - t0
  out, err = capsys.readouterr()
  assert elapsed < limit_s, (args, elapsed)
  return rc, out, err


def run_cli(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jaxvt.run", *args], capture_output=True,
                        cwd=ROOT, env=env, timeout=timeout, **kw)


def decoded(p: subprocess.CompletedProcess) -> tuple[int, str, str]:
  return (p.returncode, p.stdout.decode("utf-8", "replace"),
          p.stderr.decode("utf-8", "replace"))


# ---- files that are not GGUF models ---------------------------------------------------------

def _header_cases(tmp):
  """(name, path, needle): files whose header no GGUF reader should accept."""
  good = small_gguf(tmp / "good.gguf", {"x.key": "value", "x.n": 7})
  key_at, key_len = 24, len("general.architecture")
  return [
      ("empty file", patched(tmp / "empty.gguf", b""), "empty"),
      ("version 99", patched(tmp / "v99.gguf", good, (4, "<I", 99)), "version 99"),
      ("big-endian", patched(tmp / "be.gguf", good, (4, ">I", 3)), "big-endian"),
      ("2**62 keys", patched(tmp / "kv.gguf", good, (16, "<Q", 2**62)), "end of the file"),
      ("2**62 tensors", patched(tmp / "nt.gguf", good, (8, "<Q", 2**62)), "end of the file"),
      ("key length 2**60", patched(tmp / "klen.gguf", good, (key_at, "<Q", 2**60)),
       "end of the file"),
      ("value type 77", patched(tmp / "vt.gguf", good, (key_at + 8 + key_len, "<I", 77)),
       "unknown value type 77"),
      ("header cut", patched(tmp / "cut.gguf", good[:30]), "corrupt"),
  ]


def test_special_files_and_bad_headers(tmp_path, capsys):
  cases = [("directory", str(tmp_path), "directory"),
           ("device", "/dev/zero", "device"),
           ("missing", str(tmp_path / "nope.gguf"), "not found"),
           ("FIFO", fifo(tmp_path / "pipe.gguf"), "FIFO"),
           ("not GGUF", patched(tmp_path / "zip.gguf", b"PK\x03\x04" + b"\0" * 64), "not a GGUF")]
  for name, path, needle in cases + _header_cases(tmp_path):
    rc, out, err = main_in_process(capsys, "--model", path, limit_s=30)
    one_line_error(rc, out, err, needle)


def test_empty_model_path_is_an_error(capsys):
  rc, out, err = main_in_process(capsys, "--model", "")
  one_line_error(rc, out, err, "--model is empty")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path, capsys):
  p = tmp_path / "secret.gguf"
  p.write_bytes(b"GGUF" + b"\0" * 60)
  p.chmod(0)
  rc, out, err = main_in_process(capsys, "--model", str(p))
  one_line_error(rc, out, err, "permission denied")


def test_fifo_does_not_block_the_real_cli(tmp_path):
  """A FIFO as --model used to block forever in open(); now its type is checked first."""
  rc, out, err = decoded(run_cli("--model", fifo(tmp_path / "model.gguf"), timeout=60))
  one_line_error(rc, out, err, "FIFO")


# ---- hostile metadata ---------------------------------------------------------------------

METADATA_CASES = [
    # (name, metadata overrides, keys dropped, needle in the error)
    ("escapes in the architecture", {"general.architecture": f"llama{ESC}\nFAKE"}, NO_VOCAB,
     "unsupported architecture"),
    ("block_count is a string", {"llama.block_count": "thirty"}, NO_VOCAB, "block_count"),
    ("a billion blocks", {"llama.block_count": 10**9}, NO_VOCAB, "block_count"),
    ("zero heads", {"llama.attention.head_count": 0}, NO_VOCAB, "head_count"),
    ("heads not divisible", {"llama.attention.head_count_kv": 4}, NO_VOCAB, "do not divide"),
    ("NaN epsilon", {"llama.attention.layer_norm_rms_epsilon": float("nan")}, NO_VOCAB,
     "layer_norm_rms_epsilon"),
    ("negative context", {"llama.context_length": -5}, NO_VOCAB, "context_length"),
    ("rope wider than a head", {"llama.rope.dimension_count": 1000}, NO_VOCAB, "rotary"),
    ("all blocks MTP", {"llama.nextn_predict_layers": 30}, NO_VOCAB, "no trunk"),
    ("escapes in the tokenizer model", {"tokenizer.ggml.model": ESC}, NO_VOCAB,
     "is not supported"),
    ("escapes in the pre-tokenizer", {"tokenizer.ggml.pre": f"smollm{ESC}", **TINY_VOCAB}, (),
     "unsupported pre-tokenizer"),
    ("tokens that are numbers", {"tokenizer.ggml.tokens": [1, 2, 3]}, (), "arrays of strings"),
    ("token types that are strings", {**TINY_VOCAB, "tokenizer.ggml.token_type": ["x"] * 6}, (),
     "token_type"),
    ("duplicate tokens", {**TINY_VOCAB, "tokenizer.ggml.tokens": ["a"] * 6}, (), "duplicate"),
    ("bos id is text", {"tokenizer.ggml.bos_token_id": "one"}, NO_VOCAB, "bos_token_id"),
    # in range, but not what the math needs: powers, roots and divisions of these values
    ("rope base 0", {"llama.rope.freq_base": 0.0}, NO_VOCAB, "rope.freq_base"),
    ("rope base overflows float32", {"llama.rope.freq_base": 1e-40}, NO_VOCAB, "rope.freq_base"),
    ("rms epsilon 0", {"llama.attention.layer_norm_rms_epsilon": 0.0}, NO_VOCAB,
     "layer_norm_rms_epsilon"),
    ("negative rms epsilon", {"llama.attention.layer_norm_rms_epsilon": -1e-5}, NO_VOCAB,
     "layer_norm_rms_epsilon"),
    ("heads of no dimensions", {"llama.attention.head_count": 1024,
                                "llama.attention.head_count_kv": 1024},
     NO_VOCAB + ("llama.rope.dimension_count",), "heads of 0 dimensions"),
    ("rope over 0 dimensions", {"llama.rope.dimension_count": 0}, NO_VOCAB,
     "rope.dimension_count"),
    ("more experts used than exist", {"llama.expert_count": 4, "llama.expert_used_count": 8},
     NO_VOCAB, "8 of 4 experts"),
]


@pytest.mark.parametrize("name,metadata,drop,needle", METADATA_CASES,
                         ids=[c[0] for c in METADATA_CASES])
def test_hostile_metadata(tmp_path, capsys, name, metadata, drop, needle):
  path = write_model(tmp_path / "m.gguf", metadata=metadata, drop=drop)
  rc, out, err = main_in_process(capsys, "--model", path, "--prompt", "hi", limit_s=30)
  line = one_line_error(rc, out, err, needle)
  assert "\x1b" not in line and len(line) < 2100


def _default_vocab() -> tuple[list[str], list[int]]:
  from jaxvt.gguf.default_model import default_model_path
  from jaxvt.gguf.reader import read_metadata
  md = read_metadata(default_model_path(), ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
  return md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]


@pytest.mark.parametrize("change", ["fewer tokens", "more tokens"])
def test_vocabulary_and_embedding_rows_agree(tmp_path, capsys, change):
  """A token list shorter than the model's vocabulary (the embedding's rows) used to load and
  fail mid-generation on a token id with no text; longer, tokens would have no row."""
  tokens, types = _default_vocab()
  if change == "fewer tokens":
    tokens, types = tokens[:2000], types[:2000]
  else:
    tokens, types = tokens + [f"<extra_{i}>" for i in range(64)], types + [1] * 64
  path = write_model(tmp_path / "m.gguf", metadata={"tokenizer.ggml.tokens": tokens,
                                                    "tokenizer.ggml.token_type": types})
  rc, out, err = main_in_process(capsys, "--model", path, "--prompt", "hi", limit_s=30)
  one_line_error(rc, out, err, f"has {len(tokens)} tokens", "llama.vocab_size", "49152")


def test_vocabulary_shorter_than_the_embedding_without_a_vocab_size(tmp_path, capsys):
  """Without {arch}.vocab_size the vocabulary is the token list, and the embedding's rows must
  match it: the load refuses the tensor."""
  tokens, types = _default_vocab()
  path = write_model(tmp_path / "m.gguf", drop=("llama.vocab_size",), tensors=True,
                     metadata={"tokenizer.ggml.tokens": tokens[:2000],
                               "tokenizer.ggml.token_type": types[:2000]})
  rc, out, err = main_in_process(capsys, "--model", path, "--prompt", "hi", "--max-tokens", "4",
                                 limit_s=120)
  one_line_error(rc, out, err, "token_embd.weight")


def test_hostile_tensor_name_is_escaped(tmp_path, capsys):
  """A tensor whose name holds terminal escapes and a newline: one escaped line."""
  path = write_model(tmp_path / "m.gguf", metadata=TINY_VOCAB | {"llama.vocab_size": 6},
                     tensors=["output_norm.weight"],
                     rename={"output_norm.weight": f"output_norm{ESC}\nweight"})
  rc, out, err = main_in_process(capsys, "--model", path, "--prompt", "ab", "--max-tokens", "1")
  line = one_line_error(rc, out, err, "output_norm\\x1b[2J")
  assert "\\n" in line


# ---- hostile chat templates ----------------------------------------------------------------

TEMPLATE_CASES = [
    ("ZeroDivisionError", "{{ 1 // 0 }}", "ZeroDivisionError"),
    ("raise_exception with escapes", "{{ raise_exception('no\\x1b[31m\\nway') }}",
     "refused the messages"),
    ("syntax error", "{% for %}", "does not parse"),
    ("unsafe attribute", "{{ messages.__class__.__mro__ }}", "failed"),
    ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    ("huge output", "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "characters"),
    ("huge string", "{% set s = 'x' * 4000000000 %}{{ s }}", "memory"),
    ("doubling string",  # out of memory, or of time copying hundreds of MB
     "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "memory|ran longer"),
    ("endless loop", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
     "{% endfor %}", "ran longer"),
]


@pytest.mark.parametrize("name,template,needle", TEMPLATE_CASES,
                         ids=[c[0] for c in TEMPLATE_CASES])
def test_hostile_chat_template(tmp_path, capsys, monkeypatch, name, template, needle):
  monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1)
  path = write_model(tmp_path / "m.gguf", metadata={**TINY_VOCAB, "llama.vocab_size": 6,
                                                    "tokenizer.chat_template": template})
  rc, out, err = main_in_process(capsys, "--model", path, "--prompt", "hi", "--chat",
                                 limit_s=30)
  line = one_line_error(rc, out, err, "chat template of", path)
  assert re.search(needle, line) and "\x1b" not in line, line


def test_template_failures_end_to_end(tmp_path):
  """The real CLI with the full vocabulary: a template that raises, and one that never ends
  (the renderer's CPU limit stops it)."""
  raising = write_model(tmp_path / "raise.gguf",
                        metadata={"tokenizer.chat_template": "{{ {}['x']['y'] ~ 1 / 0 }}"})
  rc, out, err = decoded(run_cli("--model", raising, timeout=60))
  one_line_error(rc, out, err, "chat template of", "failed")
  endless = write_model(tmp_path / "loop.gguf", metadata={
      "tokenizer.chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}"
                                 "{% endfor %}{% endfor %}"})
  t0 = time.monotonic()
  rc, out, err = decoded(run_cli("--model", endless, timeout=60))
  one_line_error(rc, out, err, "ran longer than")
  assert time.monotonic() - t0 < chat_template.RENDER_SECONDS + chat_template.START_SECONDS + 20


# ---- flags -------------------------------------------------------------------------------

FLAG_CASES = [
    (["--offload-gb", "nan"], "--offload-gb"), (["--offload-gb", "inf"], "--offload-gb"),
    (["--offload-gb", "-0.5"], "--offload-gb"), (["--offload-gb", "1e300"], "--offload-gb"),
    (["--device-gb", "nan"], "--device-gb"), (["--device-gb", "0"], "--device-gb"),
    (["--temperature", "nan"], "--temperature"), (["--temperature", "inf"], "--temperature"),
    (["--temperature", "1e-30"], "--temperature"), (["--top-p", "nan"], "--top-p"),
    (["--top-p", "0"], "--top-p"), (["--top-k", "99999999999"], "--top-k"),
    (["--seed", str(2**64)], "--seed"), (["--max-tokens", str(2**40)], "--max-tokens"),
    (["--max-context", str(2**40)], "--max-context"), (["--max-tokens", "1.5"], "max_tokens"),
    (["--num-processes", "0", "--coordinator", "h:1"], "--num-processes"),
    (["--process-id", "-1", "--coordinator", "h:1"], "--process-id"),
    (["--mesh", "tp=0"], "--mesh"), (["--offload-pattern", "(" + ESC], "not a regular expression"),
    (["--prompt", "abc\udcff"], "byte 0xff at offset 3"),
    (["--prompt", "\ud800"], "lone surrogate"),
    (["--model", "x.gguf", f"--max-tokens={ESC}"], "max_tokens"),
]


@pytest.mark.parametrize("args,needle", FLAG_CASES, ids=[" ".join(c[0]) for c in FLAG_CASES])
def test_bad_flag_values(capsys, args, needle):
  rc, out, err = main_in_process(capsys, *args)
  one_line_error(rc, out, err, needle)


def test_invalid_utf8_from_the_shell():
  """argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape): refused,
  naming the byte, before JAX starts."""
  p = run_cli(b"--prompt", b"caf\xe9 au lait", "--max-tokens", "4", timeout=60)
  one_line_error(*decoded(p), "not valid UTF-8", "byte 0xe9 at offset 3")


def test_unsafe_plan_exits_2_unless_forced(capsys):
  args = ["--plan", "--device-gb", "0.3", "--max-context", "4096"]
  rc, out, err = main_in_process(capsys, *args)
  one_line_error(rc, "", err, "unsafe", "--force")
  assert "UNSAFE:" in out and not control_chars(out)
  rc, out, err = main_in_process(capsys, *args, "--force")
  assert rc == 0 and "UNSAFE:" in out and err == ""


# ---- Ctrl-C ---------------------------------------------------------------------------------

def _interrupt(args, ready, timeout=180) -> tuple[int, str, str]:
  """Starts the CLI, waits until ready(proc, stdout_so_far, stderr_so_far), sends SIGINT."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  p = subprocess.Popen([sys.executable, "-m", "jaxvt.run", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, cwd=ROOT, env=env)
  os.set_blocking(p.stdout.fileno(), False)
  os.set_blocking(p.stderr.fileno(), False)
  out, err = b"", b""
  deadline = time.monotonic() + timeout
  try:
    while not ready(p, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")):
      assert p.poll() is None, (p.returncode, err[-2000:])
      assert time.monotonic() < deadline, err[-2000:]
      out += p.stdout.read() or b""
      err += p.stderr.read() or b""
      time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    os.set_blocking(p.stdout.fileno(), True)
    os.set_blocking(p.stderr.fileno(), True)
    more_out, more_err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
  finally:
    if p.poll() is None:
      p.kill()
  return p.returncode, (out + more_out).decode("utf-8", "replace"), (err + more_err).decode(
      "utf-8", "replace")


def _jax_loading(p, out, err) -> bool:
  """JAX's compiled library is mapped: the process is importing JAX (main is running)."""
  try:
    with open(f"/proc/{p.pid}/maps") as f:
      return "jaxlib" in f.read()
  except OSError:
    return False


def _assert_interrupted(rc, out, err):
  assert rc == 130, (rc, err[-2000:])
  assert "Traceback" not in err and "Exception ignored" not in err and "KeyboardInterrupt" \
      not in err, err
  lines = [l for l in re.split(r"[\r\n]", err) if l.startswith("jaxvt:")]
  assert lines == ["jaxvt: interrupted (Ctrl-C); the run stopped"], err
  assert err.endswith("the run stopped\n") and (out == "" or out.endswith("\n"))


@pytest.mark.parametrize("moment", ["jax start-up", "load", "decode"])
def test_ctrl_c(moment):
  args = ["--nochat", "--prompt", "hi", "--max-tokens", "4000", "--offload-gb", "100"]  # long
  ready = {"jax start-up": _jax_loading,
           "load": lambda p, out, err: "placement:" in err,
           "decode": lambda p, out, err: len(out) > 20}[moment]
  _assert_interrupted(*_interrupt(args, ready))


def test_interrupt_handler_closes_the_engine(monkeypatch, capfd):
  """The handler itself (the part a subprocess cannot observe): it closes the engine, which
  frees the host tier, before the one line and exit status 130."""
  exits = []
  monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))

  class Engine:
    closed = False

    def close(self):
      self.closed = True

  before = signal.getsignal(signal.SIGINT)  # pytest started as a background job: SIG_IGN
  with run._Interrupts() as interrupts:  # pylint: disable=protected-access
    interrupts.engine = Engine()
    interrupts.stdout_open = True
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100):  # the handler runs at the next bytecode boundary
      if exits:
        break
      time.sleep(0.01)
  assert exits == [130] and interrupts.engine.closed
  out, err = capfd.readouterr()
  assert out == "\n" and err == "jaxvt: interrupted (Ctrl-C); the run stopped\n"
  assert signal.getsignal(signal.SIGINT) is before  # the handler that was there is back
