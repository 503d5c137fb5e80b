"""Everything a user can get wrong gives one line on stderr, exit status 2, and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from jaxvt.errors import JaxvtError
from jaxvt.gguf.default_model import default_model_path
from jaxvt.gguf.reader import open_gguf

from hostile_models import write_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jaxvt.run", *args], capture_output=True,
                        text=True, cwd=ROOT, env=env, timeout=timeout)


def assert_user_error(p: subprocess.CompletedProcess, *needles: str) -> None:
  assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
  assert "Traceback" not in p.stderr, p.stderr
  lines = [l for l in p.stderr.splitlines() if l.strip()]
  err = [l for l in lines if l.startswith("jaxvt: error:")]
  assert len(err) == 1, p.stderr
  for n in needles:
    assert n.lower() in err[0].lower(), (n, err[0])


# ---- reader level ------------------------------------------------------------------------

def test_missing_file(tmp_path):
  with pytest.raises(JaxvtError, match="not found"):
    open_gguf(str(tmp_path / "nope.gguf"))


def test_not_gguf(tmp_path):
  p = tmp_path / "x.gguf"
  p.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
  with pytest.raises(JaxvtError, match="not a GGUF file"):
    open_gguf(str(p))


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated(tmp_path, keep):
  src = default_model_path()
  n = int(os.path.getsize(src) * keep)
  p = tmp_path / "trunc.gguf"
  with open(src, "rb") as f, open(p, "wb") as g:
    g.write(f.read(n))
  with pytest.raises(JaxvtError, match="truncated"):
    open_gguf(str(p))


def test_truncated_header(tmp_path):
  src = default_model_path()
  p = tmp_path / "head.gguf"
  with open(src, "rb") as f, open(p, "wb") as g:
    g.write(f.read(4096))  # magic OK, metadata cut mid-way
  with pytest.raises(JaxvtError, match="truncated or corrupt"):
    open_gguf(str(p))


# ---- CLI level ---------------------------------------------------------------------------

def test_cli_missing_file():
  assert_user_error(run_cli("--model", "/nonexistent/model.gguf"), "not found")


def test_cli_not_gguf(tmp_path):
  p = tmp_path / "bad.gguf"
  p.write_text("hello")
  assert_user_error(run_cli("--model", str(p)), "not a GGUF file")


def test_cli_truncated(tmp_path):
  src = default_model_path()
  p = tmp_path / "trunc.gguf"
  with open(src, "rb") as f, open(p, "wb") as g:
    g.write(f.read(os.path.getsize(src) // 2))
  assert_user_error(run_cli("--model", str(p)), "truncated")


def test_cli_unsupported_architecture(tmp_path):
  p = tmp_path / "falcon.gguf"
  write_gguf(p, arch="falcon", tensors=[("token_embd.weight", np.zeros((4, 32), np.float32),
                                          None)])
  assert_user_error(run_cli("--model", str(p)), "unsupported architecture", "falcon")


def test_cli_unsupported_tensor_type(tmp_path):
  """A llama file whose attention matrix is Q2_K (a format jaxvt does not read)."""
  d, ff, V = 256, 256, 64
  kv = {"llama.block_count": 1, "llama.embedding_length": d, "llama.feed_forward_length": ff,
        "llama.attention.head_count": 2, "llama.attention.head_count_kv": 2,
        "llama.context_length": 128, "llama.vocab_size": V, "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(V)], "tokenizer.ggml.merges": ["t 0"]}
  f32 = lambda *s: np.ones(s, np.float32) * 0.01
  q2k_rows = np.zeros((d, 84 * d // 256), np.uint8)  # Q2_K: 84 bytes per 256 weights
  tensors = [("token_embd.weight", f32(V, d), None), ("output_norm.weight", f32(d), None),
             ("blk.0.attn_norm.weight", f32(d), None), ("blk.0.ffn_norm.weight", f32(d), None),
             ("blk.0.attn_q.weight", q2k_rows, gguf.GGMLQuantizationType.Q2_K),
             ("blk.0.attn_k.weight", f32(d, d), None), ("blk.0.attn_v.weight", f32(d, d), None),
             ("blk.0.attn_output.weight", f32(d, d), None),
             ("blk.0.ffn_gate.weight", f32(ff, d), None), ("blk.0.ffn_up.weight", f32(ff, d), None),
             ("blk.0.ffn_down.weight", f32(d, ff), None)]
  p = tmp_path / "q2k.gguf"
  write_gguf(p, tensors=tensors, kv=kv)
  assert_user_error(run_cli("--model", str(p), "--max-context", "64", "--prompt", "t0"),
                    "unsupported format", "Q2_K")


def test_cli_prompt_longer_than_context():
  assert_user_error(run_cli("--prompt", "word " * 100, "--max-context", "16"), "max-context")


@pytest.mark.parametrize("flag,needle", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--max-context", "0"], "--max-context"),
    (["--max-context", "99999999"], "max-context"),
    (["--offload-gb", "lots"], "--offload-gb"),
    (["--max-tokens", "many"], "max_tokens"),
    (["--no-such-flag"], "unknown flag --no-such-flag"),
])
def test_cli_bad_flag_values(flag, needle):
  assert_user_error(run_cli(*flag), needle)
