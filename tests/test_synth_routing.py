"""Routing-realistic synthetic models (jaxvt.synth_routing, write_model(routing=...)): the
statistics a real decode of the written file shows (benchmarks.routing, the product's decode
program with a recording route) are the targets, and clearly not those of the uniform file."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from benchmarks.routing import probe
from jaxvt import synth
from jaxvt.synth_routing import Draws, Knobs, RoutingStats, measure, simulate

TOKENS = 256
STATS = RoutingStats(tokens=TOKENS)  # the default reuse targets, at the probe's decode length


def _reference(ids: np.ndarray, E: int) -> dict[str, list[float]]:
  """The statistics by their definitions, with Python sets (module docstring of synth_routing)."""
  T, L, k = ids.shape
  sets = [[set(ids[t, l].tolist()) for l in range(L)] for t in range(T)]
  out = {}
  for name, w in (("next_token_reuse", 1), ("reuse_within_8", 8)):
    out[name] = [sum(len(sets[t][l] & set().union(*(sets[t - j][l] for j in range(1, w + 1))))
                     for t in range(w, T)) / ((T - w) * k) for l in range(L)]
  top = math.ceil(E / 10)
  out["skew"] = [sum(sorted(np.bincount(ids[:, l].ravel(), minlength=E).tolist(),
                            reverse=True)[:top]) / (T * k) for l in range(L)]
  h, pred = T // 2, []
  for l in range(L - 1):
    co = np.zeros((E, E))
    for t in range(h):
      for i, j in itertools.product(sets[t][l], sets[t][l + 1]):
        co[i, j] += 1
    hits = 0
    for t in range(h, T):
      score = sum(co[i] for i in sets[t][l])
      order = sorted(range(E), key=lambda j: (-score[j], j))  # ties: lower id first
      hits += len(set(order[:k]) & sets[t][l + 1])
    pred.append(hits / ((T - h) * k))
  out["next_layer_predictability"] = pred
  return out


def test_measure_matches_the_definitions():
  rng = np.random.default_rng(0)
  E, k = 12, 3
  ids = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(3)])
                  for _ in range(40)])  # [40, 3, 3]
  ids[5:9] = ids[4]  # some reuse
  got, want = measure(ids, E), _reference(ids, E)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-12, err_msg=name)


def test_uniform_process_has_memoryless_statistics():
  """The simulated process with no topic structure: reuse k/E and 1 - (1 - k/E)^8."""
  E, k = 64, 4
  knobs = Knobs(topics=2, stay=0.5, theta=0.0, beta=0.0, rho=0.0)
  st = measure(simulate(knobs, k, Draws.make(E, 1 << 20, 2048, 0)), E)
  assert abs(st["next_token_reuse"].mean() - k / E) < 0.01
  assert abs(st["reuse_within_8"].mean() - (1 - (1 - k / E) ** 8)) < 0.02


@pytest.mark.parametrize("bad", [dict(next_token_reuse=0.0), dict(skew=1.5),
                                 dict(next_token_reuse=0.6, reuse_within_8=0.5),
                                 dict(tokens=8)])
def test_routing_stats_refuse_impossible_targets(bad):
  with pytest.raises(ValueError):
    RoutingStats(**bad)


def test_routing_needs_a_moe_model_with_its_own_head(tmp_path):
  with pytest.raises(ValueError, match="MoE"):
    synth.write_model(tmp_path / "d.gguf", synth.tiny_config("qwen3"), routing=RoutingStats())
  with pytest.raises(ValueError, match="output head"):
    synth.write_model(tmp_path / "t.gguf", synth.tiny_config("qwen3moe", tied_embeddings=True),
                      routing=RoutingStats())


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  """{"realistic" | "uniform": (per-layer statistics of a decode, k / E)}: one tiny qwen3moe
  shape (32 experts, 4 used), written with and without routing statistics."""
  d = tmp_path_factory.mktemp("routing")
  cfg = synth.tiny_config("qwen3moe", n_experts=32, n_experts_used=4, context_length=1024)
  out = {}
  for name, routing in (("realistic", STATS), ("uniform", None)):
    path = str(d / f"{name}.gguf")
    synth.write_model(path, cfg, "f32", seed=1, routing=routing)
    out[name] = probe(path, TOKENS)[0]
  return out, cfg.n_experts_used / cfg.n_experts


def test_a_realistic_decode_has_the_target_reuse(measured):
  (st, _), targets = measured, STATS.targets()
  for name in ("next_token_reuse", "reuse_within_8"):
    assert abs(st["realistic"][name].mean() - targets[name]) < 0.07, (name, st["realistic"])


def test_the_uniform_decode_is_memoryless_and_the_realistic_is_not(measured):
  st, k_over_e = measured
  uni, real = st["uniform"], st["realistic"]
  assert abs(uni["next_token_reuse"].mean() - k_over_e) < 0.06, uni
  assert real["next_token_reuse"].mean() > uni["next_token_reuse"].mean() + 0.2
  assert real["reuse_within_8"].mean() > uni["reuse_within_8"].mean() + 0.08


def test_every_statistic_can_be_targeted(tmp_path):
  """qwen35moe (Gated-DeltaNet and attention layers, a shared expert; Q4_K experts): skew and
  next-layer predictability set too."""
  stats = RoutingStats(tokens=TOKENS, skew=0.5, next_layer_predictability=0.6)
  cfg = synth.tiny_config("qwen35moe", n_experts=32, n_experts_used=4, context_length=1024)
  path = str(tmp_path / "targeted.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=2, routing=stats)
  st = probe(path, TOKENS)[0]
  for name, target in stats.targets().items():
    assert abs(st[name].mean() - target) < 0.08, (name, st)


def test_targets_out_of_reach_are_refused(tmp_path):
  """Reuse of 0.9 needs a few experts to take most selections: a skew of 0.12 contradicts it."""
  stats = RoutingStats(next_token_reuse=0.9, reuse_within_8=0.95, skew=0.12, tokens=64)
  with pytest.raises(ValueError, match="out of reach"):
    synth.write_model(tmp_path / "x.gguf", synth.tiny_config("qwen3moe", n_experts=32,
                                                             n_experts_used=4), routing=stats)
