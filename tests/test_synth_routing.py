"""Routing-realistic synthetic models (jaxvt.synth_routing, write_model(routing=...)): the
statistics a real decode of the written file shows (benchmarks.routing, the product's decode
program with a recording route) are the targets, and clearly not those of the uniform file."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math

import numpy as np
import pytest

from benchmarks.routing import probe
from jaxvt import synth
from jaxvt.synth_routing import (PRESETS, Draws, Knobs, RoutingStats, calibrate, lru_hits, lru_name,
                                 measure, simulate)

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


# ---------------------------------------------------------------------------------------------
# The drifting process and the LRU curve (PRESETS["realistic"]).

def _lru_reference(ids: np.ndarray, capacity: int, rng) -> float:
  """Hit rate of one layer's LRU cache of `capacity` experts over ids int [T, k], by an explicit
  ordered cache: each step looks its experts up, then uses them in a random order."""
  cache: collections.OrderedDict = collections.OrderedDict()
  hits = 0
  for step in ids:
    hits += sum(int(e) in cache for e in step)
    for e in rng.permutation(step):
      cache.pop(int(e), None)
      cache[int(e)] = True
      if len(cache) > capacity:
        cache.popitem(last=False)
  return hits / ids.size


def test_lru_hits_match_an_explicit_cache():
  """lru_hits (ties of a step: the expected share of a random order) against the explicit
  cache averaged over random orders, at whole capacities from under one step's experts up."""
  rng = np.random.default_rng(3)
  E, k, T = 16, 4, 80
  topic = np.cumsum(rng.random(T) < 0.2) % 3  # some reuse
  ids = np.stack([np.stack([rng.choice(np.arange(5 * c + l, 5 * c + l + 8) % E, k,
                                       replace=False) for l in range(2)]) for c in topic])
  caps = [2, 4, 6, 9, 12]
  got = lru_hits(ids, E, [c / E for c in caps])
  for l in range(2):
    for i, c in enumerate(caps):
      want = np.mean([_lru_reference(ids[:, l], c, rng) for _ in range(300)])
      assert abs(got[l, i] - want) < 0.01, (l, c, got[l, i], want)


@pytest.fixture(scope="module")
def realistic_fit():
  """calibrate of PRESETS["realistic"] on the shape the real curve was measured on (128 experts,
  top-8), as it is, without a skew limit and with a tight one."""
  st = PRESETS["realistic"]
  return {name: calibrate(s, 128, 8, 4096, 256)
          for name, s in (("preset", st), ("free", dataclasses.replace(st, max_skew=None)),
                          ("tight", dataclasses.replace(st, max_skew=0.2)))}


def test_calibrate_meets_the_real_lru_curve(realistic_fit):
  """The fitted process, run on fresh random draws and measured with the explicit LRU cache,
  hits as the real traces do (within 0.05 a point), and reuses as targeted (within 0.06)."""
  knobs, sim = realistic_fit["preset"]
  st = PRESETS["realistic"]
  assert knobs.forward is not None and knobs.width > 0  # the drifting process
  for name, target in st.targets().items():
    assert abs(sim[name] - target) < 0.06, (name, sim)
  rng = np.random.default_rng(0)
  ids = np.concatenate([simulate(knobs, 8, Draws.make(128, 4096, st.tokens, s))
                        for s in (100, 101)], axis=1)  # [T, 4 layers, k]: fresh sequences
  for share, real in st.lru_curve:
    got = np.mean([_lru_reference(ids[:, l], round(share * 128), rng) for l in range(4)])
    assert abs(got - real) < 0.05 + 0.02, (share, got, real)  # + the rounding of the capacity


@pytest.mark.parametrize("name,limit", [("preset", 0.3), ("tight", 0.2)])
def test_the_skew_limit_is_respected(realistic_fit, name, limit):
  """The fitted process's skew (on fresh draws, by the reference definition) stays under the
  limit; the tight limit binds: without a limit the fit concentrates its choices more."""
  knobs, _ = realistic_fit[name]
  fresh = [simulate(knobs, 8, Draws.make(128, 4096, 1024, s)) for s in (200, 201)]
  got = np.mean([_reference(ids, 128)["skew"] for ids in fresh])
  assert got <= limit + 0.025, got  # + the sampling noise of other draws
  assert realistic_fit["free"][1]["skew"] > 0.2 + 0.05, realistic_fit["free"][1]


def test_high_locality_is_the_few_topic_process():
  """PRESETS["high-locality"] is RoutingStats()'s targets, calibrated by the few-topic process
  with uniform jumps (no ring), whose top 10% of experts take most selections."""
  st = PRESETS["high-locality"]
  assert st == RoutingStats() and not st.drifting
  knobs, sim = calibrate(dataclasses.replace(st, tokens=256), 64, 4, 4096, 256)
  assert knobs.forward is None and knobs.width == 0
  assert sim["skew"] > PRESETS["realistic"].max_skew  # uniform routing here: about 0.15


@pytest.mark.parametrize("bad", [dict(lru_curve=((0.5, 0.4), (0.25, 0.6))),
                                 dict(lru_curve=((0.1, 0.6), (0.2, 0.5))),
                                 dict(lru_curve=((0.0, 0.5),)), dict(max_skew=1.2),
                                 dict(skew=0.5, max_skew=0.3)])
def test_routing_stats_refuse_bad_curves(bad):
  with pytest.raises(ValueError):
    RoutingStats(**bad)


@pytest.mark.slow
def test_a_realistic_decode_has_the_real_lru_curve(tmp_path):
  """The written file's router reproduces the calibrated routing in the product's decode: a
  1024-token decode of a 128-expert top-8 file hits an LRU cache as the real traces do."""
  cfg = synth.tiny_config("qwen35moe", n_experts=128, n_experts_used=8, d_model=256, n_layers=4,
                          expert_ffn_dim=32, shared_ffn_dim=32, vocab_size=4096,
                          context_length=2048)
  path = str(tmp_path / "drift.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=0, routing=PRESETS["realistic"])
  st = probe(path, 1024)[0]
  for share, real in PRESETS["realistic"].lru_curve:
    assert abs(st[lru_name(share)].mean() - real) < 0.06, (share, st[lru_name(share)])
  assert st["skew"].mean() < PRESETS["realistic"].max_skew + 0.03, st["skew"]
