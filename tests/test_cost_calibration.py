"""The cost model against measured decode: each recorded point's prediction within 15% of the rate
measured there (tests/reference/decode_rates.json: the command, machine and date of each set).

The GPU set is the H200's decode of the 35B-shaped file at four budgets, predicted from the
default cuda rates on the plan of its preset (weightless, as `--plan --model qwen3.6-35b-a3b`
plans it); the CPU set is this project's 2-core CPU machine, predicted from the rates recorded
beside it on the plans of the real files.
"""

from __future__ import annotations

import json
import os

import pytest

from jaxvt.offload import cost, memory
from jaxvt.offload.plan import GiB

from test_plan_fixtures import base_plan, model

WITHIN = 0.15
DATA = json.load(open(os.path.join(os.path.dirname(__file__), "reference", "decode_rates.json")))


@pytest.mark.parametrize("point", DATA["cuda"]["points"], ids=lambda p: f"{p['offload_gb']}GiB")
def test_h200_decode_is_predicted_within_15_percent(point):
  cfg = model("qwen36_35b")[0]
  plan = base_plan("qwen36_35b").rebudget(int(point["offload_gb"] * GiB))
  pred = cost.predict(plan, cost.default_rates("cuda"), cfg, memory.RunShape(),
                      context_pos=DATA["cuda"]["context_pos"])
  assert abs(pred.tokens_per_s / point["decode_tok_s"] - 1) <= WITHIN, (
      f"{point['offload_gb']} GiB: predicted {pred.tokens_per_s:.1f}, measured "
      f"{point['decode_tok_s']} tok/s")


def test_the_h200_points_order_as_measured():
  """More of the budget in the host tier is predicted slower, as it was measured."""
  cfg = model("qwen36_35b")[0]
  rates = cost.default_rates("cuda")
  got = [cost.predict(base_plan("qwen36_35b").rebudget(int(p["offload_gb"] * GiB)), rates, cfg,
                      context_pos=64).tokens_per_s for p in DATA["cuda"]["points"]]
  assert got == sorted(got, reverse=True)


def _cpu_model(name: str, tmp_path_factory) -> str:
  if name == "default":
    from jaxvt.gguf.default_model import default_model_path
    return default_model_path()
  from jaxvt import synth  # the recorded points' synthetic file: the same config and seed
  path = str(tmp_path_factory.mktemp("calib") / "moe8.gguf")
  cfg = synth.tiny_config("qwen35moe", n_layers=8, d_model=256, expert_ffn_dim=256,
                          shared_ffn_dim=256)
  synth.write_model(path, cfg, "q4_k_m", seed=7)
  return path


@pytest.mark.parametrize("point", DATA["cpu"]["points"],
                         ids=lambda p: f"{p['model']}-{p['offload_gb']}GiB")
def test_cpu_decode_is_predicted_within_15_percent(point, tmp_path_factory):
  import jax
  from jaxvt import engine, loader
  m = loader.open_model(_cpu_model(point["model"], tmp_path_factory))
  placed = engine.plan(m, offload_gb=point["offload_gb"], device=jax.devices("cpu")[0],
                       max_context=DATA["cpu"]["max_context"])
  rates = cost.Rates(**DATA["cpu"]["rates"])
  pred = cost.predict(placed.plan, rates, m.cfg,
                      memory.RunShape(max_context=DATA["cpu"]["max_context"]),
                      context_pos=DATA["cpu"]["context_pos"])
  assert abs(pred.tokens_per_s / point["decode_steps_s"] - 1) <= WITHIN, (
      f"{point}: predicted {pred.tokens_per_s:.1f} steps/s")
