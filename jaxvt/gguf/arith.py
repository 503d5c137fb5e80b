"""What the model's arithmetic needs of GGUF metadata, beyond the ranges the config checks.

A value can be in range and still break the math: RoPE raises `rope.freq_base` to negative
powers (0 divides by zero, a denormal overflows float32), RMSNorm divides by the square root of
mean + `layer_norm_rms_epsilon` (0 or less is a NaN on a zero row), a head of 0 dimensions is
scaled by 0 ** -0.5, a DeltaNet layer divides its value heads among its key heads. Each such
value is checked here, against what the computation does with it in float32, and refused with
the one-line JaxvtError naming the key (jaxvt.model.config.check_metadata calls this last).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxvt.errors import JaxvtError, escape

DELTANET_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
_FIX = "the file is corrupt or not a model file; re-convert it"


def _f32(x: float) -> float:
  with np.errstate(over="ignore", under="ignore"):
    return float(np.float32(x))


def _finite_power(base: float, exponent: float) -> bool:
  """base ** exponent (base > 0), rounded to float32, is finite."""
  with np.errstate(all="ignore"):
    return bool(np.isfinite(np.float32(np.float64(base) ** exponent)))


def _number(md: Mapping[str, Any], key: str, default: float) -> float:
  v = md.get(key, default)
  return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _int(md: Mapping[str, Any], key: str, default: int) -> int:
  v = md.get(key, default)
  return v if isinstance(v, int) and not isinstance(v, bool) else default


def _deltanet_layers(md: Mapping[str, Any], arch: str, n_layers: int) -> bool:
  """Whether any trunk layer is a DeltaNet layer (as jaxvt.model.config reads the file)."""
  if arch not in DELTANET_ARCHS:
    return False
  recurrent = md.get(f"{arch}.attention.recurrent_layers")
  if isinstance(recurrent, list):
    return any(bool(r) for r in recurrent[:n_layers])
  interval = _int(md, f"{arch}.full_attention_interval", 0) or 4
  return any((i + 1) % interval for i in range(min(n_layers, interval)))


def check_arithmetic(md: Mapping[str, Any], arch: str) -> None:
  """Raises JaxvtError for a metadata value that passes the range checks but that the model's
  arithmetic cannot use (see the module docstring). `md` passed those range checks."""
  p = f"{arch}."
  d_model = _int(md, p + "embedding_length", 0)
  heads = _int(md, p + "attention.head_count", 0)
  head_dim = _int(md, p + "attention.key_length", d_model // heads if heads else 0)
  if heads and head_dim < 1:
    raise JaxvtError(f"GGUF metadata gives {d_model} embedding dimensions for {heads} heads: "
                     f"heads of {head_dim} dimensions (attention scales by head size ** -0.5); "
                     f"{_FIX}")
  rope = _int(md, p + "rope.dimension_count", head_dim)
  if head_dim >= 1 and rope < 2:
    raise JaxvtError(f"GGUF metadata '{p}rope.dimension_count' is {rope}: RoPE divides by it "
                     f"and rotates pairs of dimensions, so it must be at least 2; {_FIX}")
  theta = _number(md, p + "rope.freq_base", 10000.0)
  # inverse frequencies theta ** (-2i / rope), i < rope / 2: the largest, and ggml's scale
  if rope >= 2 and not (_f32(theta) > 0 and _finite_power(theta, -(rope - 2) / rope)
                        and _finite_power(theta, -2.0 / rope)):
    raise JaxvtError(f"GGUF metadata '{p}rope.freq_base' is {escape(repr(theta), 40)}: RoPE "
                     "raises it to negative powers, so it must be above 0 and its powers finite "
                     f"in float32; {_FIX}")
  eps = _number(md, p + "attention.layer_norm_rms_epsilon", 1e-6)
  if not _f32(eps) > 0:
    raise JaxvtError(f"GGUF metadata '{p}attention.layer_norm_rms_epsilon' is "
                     f"{escape(repr(eps), 40)}: RMSNorm divides by sqrt(mean + epsilon), so it "
                     f"must be above 0 in float32; {_FIX}")
  n_layers = _int(md, p + "block_count", 0) - _int(md, p + "nextn_predict_layers", 0)
  if _deltanet_layers(md, arch, n_layers):
    sizes = {k: _int(md, p + f"ssm.{k}", 0) for k in ("conv_kernel", "group_count",
                                                       "time_step_rank", "state_size",
                                                       "inner_size")}
    for k, v in sizes.items():
      if v < 1:
        raise JaxvtError(f"GGUF metadata '{p}ssm.{k}' is {v} (or missing), which a DeltaNet "
                         f"layer cannot use: it must be at least 1; {_FIX}")
    if sizes["inner_size"] % sizes["time_step_rank"]:
      raise JaxvtError(f"GGUF metadata gives a DeltaNet inner size of {sizes['inner_size']} for "
                       f"{sizes['time_step_rank']} value heads, which do not divide it; {_FIX}")
    if sizes["time_step_rank"] % sizes["group_count"]:
      raise JaxvtError(f"GGUF metadata gives {sizes['time_step_rank']} DeltaNet value heads for "
                       f"{sizes['group_count']} key heads, which do not divide them; {_FIX}")
