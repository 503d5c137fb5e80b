"""Loading as public steps: open_model -> layout -> plan -> place -> Engine is what jaxvt.load does,
and opening a model decides everything about the file once."""

from __future__ import annotations

import jax
import pytest

import jaxvt
from jaxvt import engine, ffi, synth
from jaxvt.gguf.reader import open_gguf
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.model.config import from_gguf_metadata
from jaxvt.offload.host_tier import HostTier


def test_open_model_decides_tied_embeddings_where_the_config_is_built(tmp_path):
  tied = jaxvt.open_model()  # SmolLM2: no output.weight, the embedding is the head
  assert tied.cfg.tied_embeddings and "lm_head" not in {d.name for d in tied.decls}
  assert all(u.name != "lm_head" for u in tied.units)
  path = str(tmp_path / "untied.gguf")
  synth.write_model(path, synth.tiny_config("llama"), "q8_0", seed=1)
  untied = jaxvt.open_model(path)
  assert not untied.cfg.tied_embeddings and ("lm_head", None) in {(u.name, u.layer)
                                                                 for u in untied.units}
  gf = open_gguf(path)
  assert from_gguf_metadata(gf.metadata, gf.tensors) == untied.cfg
  assert from_gguf_metadata(open_gguf(tied.path).metadata, open_gguf(tied.path).tensors) == tied.cfg


@pytest.mark.skipif(not ffi.available("cpu"), reason="jaxvt extension not built")
def test_the_steps_are_what_load_does():
  prompt = "The capital of France is"
  with jaxvt.load(max_context=128, offload_gb=0.02) as eng:
    want = eng.generate(prompt, max_tokens=6).tokens
    want_host = eng.plan.plan.host_bytes
  model = jaxvt.open_model()
  par = jaxvt.layout(model.cfg)
  assert par.size == 1 and par.devices == [jax.devices()[0]]
  placed = jaxvt.plan(model, offload_gb=0.02, max_context=128, mesh=par)
  assert placed.plan.host_bytes == want_host > 0
  with HostTier() as tier:
    weights = jaxvt.place(model, placed, par, host=tier)
    eng = jaxvt.Engine(model.cfg, engine.exec_for(par.devices[0].platform, True, par), weights,
                       Tokenizer.from_gguf_metadata(model.gguf.metadata), 128)
    assert eng.generate(prompt, max_tokens=6).tokens == want
    del eng, weights
