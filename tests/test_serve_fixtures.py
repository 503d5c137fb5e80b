"""Engines the serving tests share (a helper module, no tests): the default model, and a tiny
hybrid Gated-DeltaNet MoE file written by jaxvt.synth (recurrent state, routed experts)."""

import pytest

from jaxvt import engine as engine_mod
from jaxvt import synth


def hybrid_file(directory, seed: int = 12, **overrides) -> str:
  """A tiny qwen35moe GGUF file (q8_0) in `directory`."""
  path = str(directory / "qwen35moe.gguf")
  synth.write_model(path, synth.tiny_config("qwen35moe", **overrides), "q8_0", seed=seed)
  return path


@pytest.fixture(scope="module")
def smol():
  e = engine_mod.load(max_context=256)
  yield e
  e.close()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
  e = engine_mod.load(hybrid_file(tmp_path_factory.mktemp("hybrid")), max_context=256)
  yield e
  e.close()
