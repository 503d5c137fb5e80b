"""jaxvt's decoder against transformers on synthetic GGUF models (Qwen3, Qwen3-MoE, Qwen3.5-MoE).

tests/reference/record_transformers.py built each transformers model from the same GGUF file
(regenerated here deterministically from the case's parameters; its sha256 must match the
recording's) and recorded prefill logits, 16 greedy decode steps and their logits. Here the file is
loaded by jaxvt's loader and run by jaxvt.model.decoder.forward (prefill, then one token per step,
the DeltaNet layers taking the chunked then the recurrent path). The `reference`-marked test
repeats the comparison against a live transformers model when torch/transformers are importable.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvt.model import decoder
from jaxvt.model.layers import Exec
from test_qwen_fixtures import device_weights

HERE = os.path.dirname(__file__)
REF = os.path.join(HERE, "reference")
sys.path.insert(0, REF)
import record_transformers as rec  # noqa: E402

CASES = sorted(rec.CASES)
MAX_LEN = 64


def _recording(name: str):
  path = os.path.join(REF, f"transformers_{name}.npz")
  if not os.path.exists(path):
    pytest.skip(f"{os.path.basename(path)} not recorded (python tests/reference/record_transformers.py)")
  return np.load(path)


@functools.cache
def _fixture(name: str, directory: str):
  path = os.path.join(directory, f"{name}.gguf")
  sha = rec.write_case_file(rec.CASES[name], path)
  from jaxvt.gguf.reader import open_gguf
  from jaxvt.model.config import from_gguf_metadata
  read = from_gguf_metadata(open_gguf(path).metadata)
  return read, path, sha


@functools.cache
def _step_fn(cfg, kv_len, ex):
  def step(w, cache, tokens, positions):
    return decoder.forward(w, cache, tokens, positions, cfg, ex, kv_len)
  return jax.jit(step)


def run_jaxvt(cfg, weights, prompt, forced, ex=Exec(kernels=False, numerics="f32")):
  """Prefill logits [n, V]; then feeds `forced` tokens one by one: their logits [len, V]."""
  cache = decoder.init_cache(cfg, 1, MAX_LEN)
  step = _step_fn(cfg, MAX_LEN, ex)
  n = len(prompt)
  logits, cache = step(weights, cache, jnp.asarray([prompt], jnp.int32),
                       jnp.arange(n, dtype=jnp.int32)[None])
  prefill = np.asarray(logits[0])
  decode = []
  for i, tok in enumerate(forced):
    logits, cache = step(weights, cache, jnp.asarray([[tok]], jnp.int32),
                         jnp.asarray([[n + i]], jnp.int32))
    decode.append(np.asarray(logits[0, -1]))
  return prefill, np.stack(decode)


def _close(got, want, what):
  scale = np.abs(want).max()
  err = np.abs(got - want).max()
  assert err <= 1e-4 * scale + 1e-5, f"{what}: max abs err {err:.3g} (logit scale {scale:.3g})"
  return err / scale


def _runs():
  # "f32" numerics: transformers computes the dequantized model in float arithmetic (jaxvt's
  # default "ggml" numerics are llama.cpp's: tests/test_llamacpp_match.py).
  runs = [pytest.param(n, Exec(kernels=False, numerics="f32"), id=f"{n}-ref") for n in CASES]
  from jaxvt import ffi
  if ffi.available("cpu"):  # the FFI kernels on every format of the K-quant case
    runs.append(pytest.param("qwen35moe_k", Exec(kernels=True, numerics="f32"),
                             id="qwen35moe_k-kernels"))
  return runs


@pytest.mark.parametrize("name,ex", _runs())
def test_decoder_matches_transformers_recording(name, ex, tmp_path_factory):
  z = _recording(name)
  cfg, path, sha = _fixture(name, str(tmp_path_factory.getbasetemp()))
  if sha != str(z["file_sha256"]):
    pytest.fail(f"the regenerated {name} fixture differs from the recorded one (jaxvt.synth "
                "changed?): re-run tests/reference/record_transformers.py")
  weights = device_weights(path, cfg)
  prompt = z["prompt"].tolist()
  tokens = z["tokens"].tolist()
  prefill, decode = run_jaxvt(cfg, weights, prompt, tokens[:-1], ex)
  _close(prefill, z["prefill_logits"], "prefill logits")
  _close(decode, z["decode_logits"], "decode logits")
  # Greedy choices agree wherever transformers' choice was not a near tie.
  ours = [int(np.argmax(prefill[-1]))] + [int(np.argmax(l)) for l in decode]
  sure = z["margins"] > 1e-3 * np.abs(z["prefill_logits"]).max()
  assert [o for o, s in zip(ours, sure) if s] == [t for t, s in zip(tokens, sure) if s]


@pytest.mark.reference
@pytest.mark.parametrize("name", ["qwen35moe"])
def test_decoder_matches_transformers_live(name, tmp_path):
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError:
    pytest.skip("torch/transformers not installed")
  case = rec.CASES[name]
  cfg = rec.case_config(case)
  path = str(tmp_path / "m.gguf")
  rec.write_case_file(case, path)
  model = rec.hf_model(cfg)
  rec.load_state(model, rec.hf_state_dict(cfg, rec.gguf_tensors(path)))
  prompt = rec.PROMPT[:9]
  prefill_t, tokens, decode_t, _ = rec.run_greedy(model, prompt, 6)
  from jaxvt.gguf.reader import open_gguf
  from jaxvt.model.config import from_gguf_metadata
  read = from_gguf_metadata(open_gguf(path).metadata)
  prefill, decode = run_jaxvt(read, device_weights(path, read), prompt, tokens[:-1].tolist())
  _close(prefill, prefill_t, "prefill logits")
  _close(decode, decode_t, "decode logits")
