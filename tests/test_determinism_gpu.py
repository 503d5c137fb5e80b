"""GPU: the same tokens in every process and at every offload budget, on a Qwen3.6-35B-A3B-shaped
file (the real layer shapes, vocabulary and formats; 8 of its 40 layers, to write and load
quickly), with jaxvt's deterministic compiler options (jaxvt.programs).

  pytest -m gpu tests/test_determinism_gpu.py      # ~5 min on an H200 (the file is written once)

One process per configuration, each with the compilation cache off so that every process
compiles (and would autotune) its own programs: nothing offloaded (twice), 2 GiB, everything
offloaded, and on an emulated 4 GiB card `auto` and 2.5 GiB. Each gives 128 greedy tokens for
two prompts, 128 tokens sampled at temperature 0.8 with one seed, and the SHA-256 of the float32
logits of prefill and 8 decode steps: all must be equal (benchmarks.determinism). The same
comparison with XLA's default (autotuned) compiles, to see what the options fix:
`python -m benchmarks.determinism --model FILE --configs 0,2,all,auto@4 --nondeterministic
--compare-only`. The default model's comparison runs on CPU in tests/test_determinism.py.
"""

from __future__ import annotations

import dataclasses
import os
import types

import pytest

from benchmarks import determinism
from jaxvt import synth
from jaxvt.model.presets import qwen36_35b_a3b_config

pytestmark = pytest.mark.gpu

MODEL = "/tmp/jaxvt-qwen36-35b-a3b-shape-8layers.gguf"
CONFIGS = "0,2,all,auto@4,2.5@4"


@pytest.fixture(scope="module")
def model_path() -> str:
  if not os.path.exists(MODEL):
    cfg = qwen36_35b_a3b_config(n_nextn=0)
    cfg = dataclasses.replace(cfg, n_layers=8, layer_types=cfg.layer_types[:8])
    part = MODEL + ".part"
    synth.write_model(part, cfg, "q4_k_m", seed=0)
    os.replace(part, MODEL)
  return MODEL


def _args(model: str):
  return types.SimpleNamespace(model=model, configs=CONFIGS, tokens=128, max_context=2048,
                               nondeterministic=False, temperature=0.8, seed=7)


def test_tokens_and_logits_identical_across_processes_and_budgets(model_path):
  runs, diffs = determinism.compare(_args(model_path))
  assert not diffs, diffs
  host = {r["config"]: r["host_gib"] for r in runs}
  assert host["0"] == 0 and host["all"] > 3 and 0 < host["auto@4"] < host["all"], host
  assert all(len(t) == 128 for r in runs for t in r["tokens"])

