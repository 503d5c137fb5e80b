"""Every weight of a model, declared once.

`declare(cfg)` lists the model's weights as `WeightDecl`s: canonical name, the trunk layers the
weight is stacked over (None for global tensors), the per-layer logical shape in numpy order
(rows = output features, cols = input features, experts first), its role and whether it is a
matrix (kept in its GGUF block format as a QWeight) or a small vector (a float32 array). A model
with tied embeddings declares no output head (the embedding serves). Loading, placement and byte
accounting all derive from this list, and so does sharding: each declaration carries its
`Split`, how a layer of it divides over a mesh's devices. A placement unit is one weight in one
layer; `UnitBytes` is what it holds in the file.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable

import numpy as np

from jaxvt.model.config import ModelConfig


class Role(str, enum.Enum):
  ROUTED_EXPERTS = "routed_experts"
  SHARED_EXPERT = "shared_expert"
  DENSE_FFN = "dense_ffn"
  DELTANET = "deltanet"
  ATTENTION = "attention"
  OUTPUT = "output"
  EMBEDDING = "embedding"
  ROUTER = "router"
  NORM = "norm"
  SMALL = "small"  # biases, conv kernels, decay vectors, gates


# Roles whose tensors may live in the host tier; the others always stay on the device.
OFFLOADABLE = (Role.ROUTED_EXPERTS, Role.SHARED_EXPERT, Role.DENSE_FFN, Role.DELTANET,
               Role.ATTENTION, Role.OUTPUT, Role.EMBEDDING)


@dataclasses.dataclass(frozen=True)
class Split:
  """How one layer of a weight splits over a mesh's devices (jaxvt.model.sharding.rule resolves
  it for a mesh; on one device everything is whole).

  kind: "replicate" (whole on every device: embeddings, norms, routers, q/k norms, gates);
    "rows" (column-parallel projections: output rows; GGUF rows are contiguous, so a shard is a
    byte range of each row set); "cols" (row-parallel projections: input columns, whole blocks
    of the layer's format, partial products psum'ed); "experts" (routed experts, over the
    ("ep", "tp") axes together); "vector" (a small per-head vector's entries along `axis`).
  index(parts, s): the rows / columns / experts / entries that shard s of `parts` holds, in
    their order inside the shard (parts: tp, or ep * tp for experts).
  divides: split only when the mesh's parts divide this count (the output head's vocab rows,
    whose logits are gathered), else replicate; 0: always split (`check` guarantees it).
  """
  kind: str = "replicate"
  index: Callable[[int, int], np.ndarray] | None = dataclasses.field(default=None, compare=False)
  axis: int = 0
  divides: int = 0


REPLICATE = Split()


@dataclasses.dataclass(frozen=True)
class WeightDecl:
  name: str
  layers: tuple[int, ...] | None  # trunk layer indices of the stack; None = one global tensor
  shape: tuple[int, ...]  # per layer: (rows, cols) | (experts, rows, cols) | (n,) | (rows, cols) small
  role: Role
  matrix: bool  # True: QWeight in GGUF block format; False: float32 array
  split: Split = REPLICATE

  @property
  def n_stack(self) -> int:
    return 1 if self.layers is None else len(self.layers)

  @property
  def numel(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class UnitBytes:
  """One placement unit: a weight in one layer (layer None for global tensors), its bytes as
  stored and its ggml type (-1 where estimated without a file)."""
  name: str
  layer: int | None
  nbytes: int
  type_id: int


# ---------------------------------------------------------------------------------------------
# Index sets of the splits


def part(n: int, parts: int, s: int) -> np.ndarray:
  """Shard s of `parts` equal contiguous ranges of range(n)."""
  return np.arange(s * n // parts, (s + 1) * n // parts)


def expand(units: np.ndarray, size: int) -> np.ndarray:
  """Unit indices -> element indices, `size` elements per unit."""
  return (units[:, None] * size + np.arange(size)[None, :]).reshape(-1)


def gdn_heads(cfg: ModelConfig, tp: int, s: int) -> tuple[np.ndarray, np.ndarray]:
  """(key heads, value heads) of DeltaNet shard s of tp, in their order inside the shard.

  Value head j reads key head j % n_k in the qwen35 GGUF ("tiled") order, so a shard takes key
  heads [s*n_k/tp, (s+1)*n_k/tp) and the value heads that read them, ordered so that the same
  tiled rule holds inside the shard; "grouped" (j // (n_v / n_k)) takes contiguous ranges."""
  nk, nv = cfg.ssm_k_heads, cfg.ssm_v_heads
  kh = part(nk, tp, s)
  if cfg.ssm_value_order == "tiled":
    vh = (kh[None, :] + nk * np.arange(nv // nk)[:, None]).reshape(-1)
  else:
    vh = part(nv, tp, s)
  return kh, vh


def _gdn_qkv(cfg: ModelConfig, tp: int, s: int) -> np.ndarray:
  """The [q | k | v] channels of DeltaNet shard s (its key heads' q and k, its value heads' v)."""
  kh, vh = gdn_heads(cfg, tp, s)
  qk, dk, dv = cfg.ssm_qk_dim, cfg.ssm_k_dim, cfg.ssm_v_dim
  return np.concatenate([expand(kh, dk), qk + expand(kh, dk), 2 * qk + expand(vh, dv)])


def _heads(n: int, size: int) -> Split:
  """Rows of `n` heads of `size` rows each, split by heads."""
  return Split("rows", lambda p, s: expand(part(n, p, s), size))


def _units(kind: str, n: int) -> Split:
  return Split(kind, lambda p, s: part(n, p, s))


# ---------------------------------------------------------------------------------------------


def declare(cfg: ModelConfig) -> list[WeightDecl]:
  """All weights of `cfg`'s architecture, in a fixed order, each with its split."""
  d = cfg.d_model
  M, V = True, False
  every = tuple(range(cfg.n_layers))
  attn = cfg.attention_layers
  gdn = cfg.deltanet_layers
  out: list[WeightDecl] = [
      WeightDecl("embed", None, (cfg.vocab_size, d), Role.EMBEDDING, M),
      WeightDecl("final_norm", None, (d,), Role.NORM, V),
  ]
  if not cfg.tied_embeddings:  # vocab rows over tp, the logits gathered
    out.append(WeightDecl("lm_head", None, (cfg.vocab_size, d), Role.OUTPUT, M,
                          dataclasses.replace(_units("rows", cfg.vocab_size),
                                              divides=cfg.vocab_size)))

  def add(name, layers, shape, role, matrix, split=REPLICATE):
    if layers:
      out.append(WeightDecl(name, layers, tuple(shape), role, matrix, split))

  # Attention layers (all layers for llama/qwen3; every interval-th for qwen35): by heads.
  H, K = cfg.n_heads, cfg.n_kv_heads
  add("attn_norm", every, (d,), Role.NORM, V)
  add("attn.wq", attn, (cfg.q_rows, d), Role.ATTENTION, M, _heads(H, cfg.q_rows // H))
  add("attn.wk", attn, (K * cfg.head_dim, d), Role.ATTENTION, M, _heads(K, cfg.head_dim))
  add("attn.wv", attn, (K * cfg.v_head_dim, d), Role.ATTENTION, M, _heads(K, cfg.v_head_dim))
  add("attn.wo", attn, (d, H * cfg.v_head_dim), Role.ATTENTION, M,
      Split("cols", lambda p, s: expand(part(H, p, s), cfg.v_head_dim)))
  if cfg.qk_norm:
    add("attn.q_norm", attn, (cfg.head_dim,), Role.NORM, V)
    add("attn.k_norm", attn, (cfg.head_dim,), Role.NORM, V)

  # Gated DeltaNet layers: by key heads and the value heads that read them.
  if gdn:
    nv, dv = cfg.ssm_v_heads, cfg.ssm_v_dim
    qkv = lambda kind: Split(kind, lambda p, s: _gdn_qkv(cfg, p, s))
    vheads = lambda kind, size: Split(kind, lambda p, s: expand(gdn_heads(cfg, p, s)[1], size))
    add("gdn.w_qkv", gdn, (cfg.conv_dim, d), Role.DELTANET, M, qkv("rows"))
    add("gdn.w_z", gdn, (cfg.ssm_inner_dim, d), Role.DELTANET, M, vheads("rows", dv))
    add("gdn.w_beta", gdn, (nv, d), Role.DELTANET, M, vheads("rows", 1))
    add("gdn.w_alpha", gdn, (nv, d), Role.DELTANET, M, vheads("rows", 1))
    add("gdn.conv", gdn, (cfg.conv_dim, cfg.ssm_conv_kernel), Role.SMALL, V, qkv("vector"))
    add("gdn.dt_bias", gdn, (nv,), Role.SMALL, V, vheads("vector", 1))
    add("gdn.a", gdn, (nv,), Role.SMALL, V, vheads("vector", 1))
    add("gdn.norm", gdn, (dv,), Role.NORM, V)
    add("gdn.w_out", gdn, (d, cfg.ssm_inner_dim), Role.DELTANET, M, vheads("cols", dv))

  # FFN: dense or mixture of experts (+ optional shared expert), by hidden units.
  add("ffn_norm", every, (d,), Role.NORM, V)
  if cfg.is_moe:
    E, f = cfg.n_experts, cfg.expert_ffn_dim
    add("moe.router", every, (E, d), Role.ROUTER, M)
    for name, shape in (("moe.w_gate", (E, f, d)), ("moe.w_up", (E, f, d)),
                        ("moe.w_down", (E, d, f))):
      add(name, every, shape, Role.ROUTED_EXPERTS, M, _units("experts", E))
    if cfg.shared_ffn_dim:
      s = cfg.shared_ffn_dim
      add("shexp.gate", every, (d,), Role.SMALL, V)
      add("shexp.w_gate", every, (s, d), Role.SHARED_EXPERT, M, _units("rows", s))
      add("shexp.w_up", every, (s, d), Role.SHARED_EXPERT, M, _units("rows", s))
      add("shexp.w_down", every, (d, s), Role.SHARED_EXPERT, M, _units("cols", s))
  else:
    f = cfg.ffn_dim
    add("ffn.w_gate", every, (f, d), Role.DENSE_FFN, M, _units("rows", f))
    add("ffn.w_up", every, (f, d), Role.DENSE_FFN, M, _units("rows", f))
    add("ffn.w_down", every, (d, f), Role.DENSE_FFN, M, _units("cols", f))
  return out


def by_name(decls: list[WeightDecl]) -> dict[str, WeightDecl]:
  return {w.name: w for w in decls}
