"""llama.cpp (llama-cpp-python, live; `reference` marker) reads jaxvt's synthetic GGUF files and
computes what jaxvt computes.

This checks the synthetic files from llama.cpp's side, independently of our reading of the
converter: llama.cpp must accept the names, shapes, metadata and tokenizer (MTP block included),
and its own qwen35 graph (value heads repeated tiled with ggml_repeat, norms used as stored, IMRoPE
with 4-section positions) must give jaxvt's logits. F32 weights and an F32 KV cache keep llama.cpp
exact enough to compare at 1e-5 (quantized weights would add its Q8 activation rounding).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxvt import synth
from jaxvt.gguf.reader import open_gguf
from jaxvt.model.config import from_gguf_metadata
from test_qwen_fixtures import device_weights
from test_qwen_transformers import run_jaxvt

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 300, 17]


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35"])
def test_llamacpp_matches_jaxvt(arch, tmp_path):
  llama_cpp = pytest.importorskip("llama_cpp")
  cfg = synth.tiny_config(arch, n_nextn=1)
  path = str(tmp_path / f"{arch}.gguf")
  synth.write_model(path, cfg, "f32", seed=5)
  llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, logits_all=True, verbose=False,
                        type_k=0, type_v=0)  # F32 KV cache
  llm.eval(PROMPT)
  prefill_l = np.array(llm.scores[:len(PROMPT)], np.float32)
  tokens = [int(prefill_l[-1].argmax())]
  for _ in range(5):
    llm.eval([tokens[-1]])
    tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
  decode_l = np.array(llm.scores[len(PROMPT):llm.n_tokens], np.float32)
  read = from_gguf_metadata(open_gguf(path).metadata)
  prefill, decode = run_jaxvt(read, device_weights(path, read), PROMPT, tokens[:-1])
  scale = np.abs(prefill_l).max()
  assert np.abs(prefill - prefill_l).max() < 1e-5 * scale + 1e-5
  assert np.abs(decode - decode_l).max() < 1e-5 * scale + 1e-5
  assert [int(prefill[-1].argmax())] + [int(x) for x in decode.argmax(-1)] == tokens
