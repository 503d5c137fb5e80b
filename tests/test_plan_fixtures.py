"""Weightless model configurations shared by the planner tests (no tests here)."""

import functools
import random

from jaxvt.model.config import ModelConfig
from jaxvt.model.declare import declare
from jaxvt.offload import plan as P
from jaxvt.offload.plan import HOST


def qwen36_35b() -> ModelConfig:
  """Qwen3.6-35B-A3B's shape (jaxvt.model.presets), with its MTP block."""
  from jaxvt.model.presets import qwen36_35b_a3b_config
  return qwen36_35b_a3b_config(n_nextn=1)


def smollm2_135m() -> ModelConfig:
  """SmolLM2-135M: llama, tied embeddings."""
  return ModelConfig(
      arch="llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, v_head_dim=64,
      ffn_dim=1536, vocab_size=49152, rms_eps=1e-5, rope_theta=100000.0, rope_dim=64,
      context_length=8192, tied_embeddings=True)


CONFIGS = {"qwen36_35b": qwen36_35b, "smollm2_135m": smollm2_135m}


@functools.lru_cache(maxsize=None)
def model(name):
  cfg = CONFIGS[name]()
  decls = declare(cfg)
  sizes = P.estimate_bytes(decls)
  return cfg, decls, sizes


@functools.lru_cache(maxsize=None)
def base_plan(name, batch=1):
  cfg, decls, sizes = model(name)
  return P.plan(cfg, decls, sizes, 0, P.Policy(batch=batch))


def host_set(p):
  return {u.unit for u, k in zip(p.units, p.kinds) if k == HOST}


def jittered(name, seed):
  """model(name) with its sizes as other quantization recipes might give them: each unit
  scaled by 1/4..4."""
  cfg, decls, sizes = model(name)
  rng = random.Random(seed)
  return cfg, decls, {u: max(1, int(b * rng.uniform(0.25, 4.0))) for u, b in sizes.items()}
