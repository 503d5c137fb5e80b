"""Every weight of a model, declared once.

`declare(cfg)` lists the model's weights as `WeightDecl`s: canonical name, the trunk layers the
weight is stacked over (None for global tensors), the per-layer logical shape in numpy order
(rows = output features, cols = input features, experts first), its role and whether it is a
matrix (kept in its GGUF block format as a QWeight) or a small vector (a float32 array). A model
with tied embeddings declares no output head (the embedding serves). Loading, placement and byte
accounting all derive from this list; a placement unit is one weight in one layer, and
`UnitBytes` is what it holds in the file.
"""

from __future__ import annotations

import dataclasses
import enum
import math

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
class WeightDecl:
  name: str
  layers: tuple[int, ...] | None  # trunk layer indices of the stack; None = one global tensor
  shape: tuple[int, ...]  # per layer: (rows, cols) | (experts, rows, cols) | (n,) | (rows, cols) small
  role: Role
  matrix: bool  # True: QWeight in GGUF block format; False: float32 array

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


def declare(cfg: ModelConfig) -> list[WeightDecl]:
  """All weights of `cfg`'s architecture, in a fixed order."""
  d = cfg.d_model
  M, V = True, False
  every = tuple(range(cfg.n_layers))
  attn = cfg.attention_layers
  gdn = cfg.deltanet_layers
  out: list[WeightDecl] = [
      WeightDecl("embed", None, (cfg.vocab_size, d), Role.EMBEDDING, M),
      WeightDecl("final_norm", None, (d,), Role.NORM, V),
  ]
  if not cfg.tied_embeddings:
    out.append(WeightDecl("lm_head", None, (cfg.vocab_size, d), Role.OUTPUT, M))
  add = lambda name, layers, shape, role, matrix: out.append(
      WeightDecl(name, layers, tuple(shape), role, matrix)) if layers else None

  # Attention layers (all layers for llama/qwen3; every interval-th for qwen35).
  add("attn_norm", every, (d,), Role.NORM, V)
  add("attn.wq", attn, (cfg.q_rows, d), Role.ATTENTION, M)
  add("attn.wk", attn, (cfg.n_kv_heads * cfg.head_dim, d), Role.ATTENTION, M)
  add("attn.wv", attn, (cfg.n_kv_heads * cfg.v_head_dim, d), Role.ATTENTION, M)
  add("attn.wo", attn, (d, cfg.n_heads * cfg.v_head_dim), Role.ATTENTION, M)
  if cfg.qk_norm:
    add("attn.q_norm", attn, (cfg.head_dim,), Role.NORM, V)
    add("attn.k_norm", attn, (cfg.head_dim,), Role.NORM, V)

  # Gated DeltaNet layers.
  if gdn:
    nv, dv = cfg.ssm_v_heads, cfg.ssm_v_dim
    add("gdn.w_qkv", gdn, (cfg.conv_dim, d), Role.DELTANET, M)
    add("gdn.w_z", gdn, (cfg.ssm_inner_dim, d), Role.DELTANET, M)
    add("gdn.w_beta", gdn, (nv, d), Role.DELTANET, M)
    add("gdn.w_alpha", gdn, (nv, d), Role.DELTANET, M)
    add("gdn.conv", gdn, (cfg.conv_dim, cfg.ssm_conv_kernel), Role.SMALL, V)
    add("gdn.dt_bias", gdn, (nv,), Role.SMALL, V)
    add("gdn.a", gdn, (nv,), Role.SMALL, V)
    add("gdn.norm", gdn, (dv,), Role.NORM, V)
    add("gdn.w_out", gdn, (d, cfg.ssm_inner_dim), Role.DELTANET, M)

  # FFN: dense or mixture of experts (+ optional shared expert).
  add("ffn_norm", every, (d,), Role.NORM, V)
  if cfg.is_moe:
    E, f = cfg.n_experts, cfg.expert_ffn_dim
    add("moe.router", every, (E, d), Role.ROUTER, M)
    add("moe.w_gate", every, (E, f, d), Role.ROUTED_EXPERTS, M)
    add("moe.w_up", every, (E, f, d), Role.ROUTED_EXPERTS, M)
    add("moe.w_down", every, (E, d, f), Role.ROUTED_EXPERTS, M)
    if cfg.shared_ffn_dim:
      s = cfg.shared_ffn_dim
      add("shexp.gate", every, (d,), Role.SMALL, V)
      add("shexp.w_gate", every, (s, d), Role.SHARED_EXPERT, M)
      add("shexp.w_up", every, (s, d), Role.SHARED_EXPERT, M)
      add("shexp.w_down", every, (d, s), Role.SHARED_EXPERT, M)
  else:
    add("ffn.w_gate", every, (cfg.ffn_dim, d), Role.DENSE_FFN, M)
    add("ffn.w_up", every, (cfg.ffn_dim, d), Role.DENSE_FFN, M)
    add("ffn.w_down", every, (d, cfg.ffn_dim), Role.DENSE_FFN, M)
  return out


def by_name(decls: list[WeightDecl]) -> dict[str, WeightDecl]:
  return {w.name: w for w in decls}
