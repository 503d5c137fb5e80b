"""Engines the serving tests share (a helper module, no tests): the default model, and a tiny
hybrid Gated-DeltaNet MoE file written by jaxvt.synth (recurrent state, routed experts)."""

import jax
import numpy as np
import pytest

from jaxvt import engine as engine_mod
from jaxvt import synth

# How far logits computed by other programs may differ: on the CPU a prefill in pieces gives a
# one-call prefill's bits to rounding; a GPU picks its kernels by row count (jaxvt.ffi.tuning),
# whose accumulation orders differ (0.03 seen on the tiny hybrid file's logits).
ATOL = 1e-5 if jax.default_backend() == "cpu" else 0.1


def agree_up_to_a_tie(eng, ids: list[int], tokens: list[int], tie: float) -> None:
  """`tokens` are the greedy tokens of a fresh prefill + decode of `ids`, up to a step where the
  fresh run's two best logits are within `tie` (times the best's magnitude, at least 1) of each
  other: there rounding may pick either."""
  logits, cache = eng.prefill(ids)
  for i, t in enumerate(tokens):
    x = np.asarray(logits, np.float64)
    best, second = np.sort(x)[-2:][::-1]
    if t != int(np.argmax(x)):
      assert best - second < tie * max(1.0, abs(best)), (i, t, int(np.argmax(x)), best - second)
      return
    logits, cache = eng.decode_step(cache, t, len(ids) + i)


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
