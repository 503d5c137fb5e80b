"""Sharding rules: how each declared weight, the decode state and the forward split over a mesh.

One `Rule` per declaration, from its role and canonical name (never from GGUF names):

  replicate  embeddings, norms, routers, the shared expert's gate, q/k norms: whole on every device
  rows       column-parallel projections split their output rows (GGUF rows are contiguous, so a
             shard is a byte range of each row set): q/k/v by (query / KV) heads, FFN gate/up
             and shared-expert gate/up by hidden units, DeltaNet in-projections by heads, the
             output head by vocab rows (when the vocab divides tp; its logits are gathered)
  cols       row-parallel projections split their input columns (attention output by query
             heads, FFN / shared-expert down by hidden units, DeltaNet out by value heads); the
             loader keeps whole blocks, so every column range must be whole blocks of the
             layer's format (32 elements, 256 for K-quants); the partial sums are psum'ed
  experts    routed expert stacks split over ("ep", "tp") by expert id
  vector     small per-head vectors (DeltaNet conv kernel, dt bias, decay) follow their heads

Every shard has the same shape, so every device has the same per-device unit bytes and one plan
serves every device. Inside `forward` (a `jax.shard_map` over the mesh) the model runs on a
per-device `local_config` (heads, KV heads, FFN and DeltaNet heads divided by tp; the expert
count stays global, it is the router's width) and reads its own shards only.

DeltaNet heads: value head j reads key head j % n_k in the qwen35 GGUF ("tiled") order, so a tp
shard takes key heads [s*n_k/tp, (s+1)*n_k/tp) and the value heads that read them, ordered so
the same tiled rule holds inside the shard; the conv state and recurrent state of a shard are
its own heads' (the global state arrays are the shards side by side, an opaque order).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxvt.errors import JaxvtError
from jaxvt.gguf import names, quants
from jaxvt.model import decoder
from jaxvt.model.config import ModelConfig
from jaxvt.model.declare import Role, UnitBytes, WeightDecl, declare
from jaxvt.model.axes import AXES, TP
from jaxvt.parallel.mesh import MeshSpec, Par
from jaxvt.qweight import QWeight


@dataclasses.dataclass(frozen=True)
class Rule:
  """kind: "replicate" | "rows" | "cols" | "experts" | "vector"; axes: the mesh axes the shard
  index runs over (major first); index(s): the rows / column elements / experts / vector entries
  (along per-layer axis `axis`) that shard s holds, in their order inside the shard."""
  kind: str
  axes: tuple[str, ...] = ()
  index: Callable[[int], np.ndarray] | None = None
  axis: int = 0


REPLICATE = Rule("replicate")


def _part(n: int, parts: int, s: int) -> np.ndarray:
  return np.arange(s * n // parts, (s + 1) * n // parts)


def _expand(units: np.ndarray, size: int) -> np.ndarray:
  """Unit indices -> element indices, `size` elements per unit."""
  return (units[:, None] * size + np.arange(size)[None, :]).reshape(-1)


def gdn_heads(cfg: ModelConfig, tp: int, s: int) -> tuple[np.ndarray, np.ndarray]:
  """(key heads, value heads) of DeltaNet shard s, in their order inside the shard."""
  nk, nv = cfg.ssm_k_heads, cfg.ssm_v_heads
  kh = _part(nk, tp, s)
  if cfg.ssm_value_order == "tiled":  # value head j reads key head j % nk
    vh = (kh[None, :] + nk * np.arange(nv // nk)[:, None]).reshape(-1)
  else:  # grouped: value head j reads key head j // (nv / nk)
    vh = _part(nv, tp, s)
  return kh, vh


def _gdn_qkv(cfg: ModelConfig, tp: int, s: int) -> np.ndarray:
  kh, vh = gdn_heads(cfg, tp, s)
  qk, dk, dv = cfg.ssm_qk_dim, cfg.ssm_k_dim, cfg.ssm_v_dim
  return np.concatenate([_expand(kh, dk), qk + _expand(kh, dk), 2 * qk + _expand(vh, dv)])


def rule(d: WeightDecl, cfg: ModelConfig, par: Par | MeshSpec) -> Rule:
  """The sharding rule of declaration `d` on a mesh of `par`'s sizes."""
  tp = par.tp
  name = d.name
  if d.role in (Role.NORM, Role.ROUTER, Role.EMBEDDING) or name in ("shexp.gate", "gdn.norm"):
    return REPLICATE
  if d.role is Role.ROUTED_EXPERTS:
    n = par.tp * par.ep
    return Rule("experts", AXES, lambda s: _part(cfg.n_experts, n, s))
  if d.role is Role.OUTPUT:
    if not head_sharded(cfg, par):
      return REPLICATE
    return Rule("rows", (TP,), lambda s: _part(cfg.vocab_size, tp, s))
  H, K = cfg.n_heads, cfg.n_kv_heads
  q_unit = d.shape[0] // H if name == "attn.wq" else 0
  gdn = lambda f: (lambda s: f(*gdn_heads(cfg, tp, s)))
  table = {
      "attn.wq": ("rows", lambda s: _expand(_part(H, tp, s), q_unit)),
      "attn.wk": ("rows", lambda s: _expand(_part(K, tp, s), cfg.head_dim)),
      "attn.wv": ("rows", lambda s: _expand(_part(K, tp, s), cfg.v_head_dim)),
      "attn.wo": ("cols", lambda s: _expand(_part(H, tp, s), cfg.v_head_dim)),
      "ffn.w_gate": ("rows", lambda s: _part(cfg.ffn_dim, tp, s)),
      "ffn.w_up": ("rows", lambda s: _part(cfg.ffn_dim, tp, s)),
      "ffn.w_down": ("cols", lambda s: _part(cfg.ffn_dim, tp, s)),
      "shexp.w_gate": ("rows", lambda s: _part(cfg.shared_ffn_dim, tp, s)),
      "shexp.w_up": ("rows", lambda s: _part(cfg.shared_ffn_dim, tp, s)),
      "shexp.w_down": ("cols", lambda s: _part(cfg.shared_ffn_dim, tp, s)),
      "gdn.w_qkv": ("rows", lambda s: _gdn_qkv(cfg, tp, s)),
      "gdn.conv": ("vector", lambda s: _gdn_qkv(cfg, tp, s)),
      "gdn.w_z": ("rows", gdn(lambda kh, vh: _expand(vh, cfg.ssm_v_dim))),
      "gdn.w_beta": ("rows", gdn(lambda kh, vh: vh)),
      "gdn.w_alpha": ("rows", gdn(lambda kh, vh: vh)),
      "gdn.dt_bias": ("vector", gdn(lambda kh, vh: vh)),
      "gdn.a": ("vector", gdn(lambda kh, vh: vh)),
      "gdn.w_out": ("cols", gdn(lambda kh, vh: _expand(vh, cfg.ssm_v_dim))),
  }
  if name not in table:
    raise ValueError(f"no sharding rule for weight {name!r} ({d.role.value})")
  kind, index = table[name]
  return Rule(kind, (TP,), index)


def head_sharded(cfg: ModelConfig, par: Par | MeshSpec) -> bool:
  """Whether the output head splits its vocab rows over tp (an untied head whose vocab divides)."""
  return par.tp > 1 and not cfg.tied_embeddings and cfg.vocab_size % par.tp == 0


def n_shards(r: Rule, par: Par | MeshSpec) -> int:
  """How many distinct shards the rule cuts a tensor into."""
  return int(np.prod([par.tp if a == TP else par.ep for a in r.axes])) if r.axes else 1


def check(cfg: ModelConfig, spec: MeshSpec) -> None:
  """JaxvtError when the model does not split over the mesh."""
  tp, ep = spec.tp, spec.ep
  if ep > 1 and not cfg.is_moe:
    raise JaxvtError(f"--mesh {spec}: ep splits routed experts and this {cfg.arch} model has "
                     "none; use tp")
  counts = []
  if cfg.attention_layers:
    counts += [("attention heads", cfg.n_heads), ("KV heads", cfg.n_kv_heads)]
  if cfg.deltanet_layers:
    counts += [("DeltaNet key heads", cfg.ssm_k_heads), ("DeltaNet value heads", cfg.ssm_v_heads)]
  if cfg.is_moe and cfg.shared_ffn_dim:
    counts.append(("shared-expert hidden units", cfg.shared_ffn_dim))
  if not cfg.is_moe:
    counts.append(("FFN hidden units", cfg.ffn_dim))
  for what, n in counts:
    if n % tp:
      raise JaxvtError(f"--mesh {spec}: the model's {n} {what} do not split over tp={tp}; "
                       f"use a tp that divides {n}")
  if cfg.is_moe and cfg.n_experts % (tp * ep):
    raise JaxvtError(f"--mesh {spec}: the model's {cfg.n_experts} experts do not split over "
                     f"ep*tp={tp * ep} devices; use a mesh whose size divides {cfg.n_experts}")


def local_config(cfg: ModelConfig, par: Par | MeshSpec) -> ModelConfig:
  """The model as one device of the mesh runs it (heads and hidden units divided by tp)."""
  tp = par.tp
  return dataclasses.replace(
      cfg, n_heads=cfg.n_heads // tp, n_kv_heads=cfg.n_kv_heads // tp,
      ffn_dim=cfg.ffn_dim // tp, shared_ffn_dim=cfg.shared_ffn_dim // tp,
      ssm_k_heads=cfg.ssm_k_heads // tp, ssm_v_heads=cfg.ssm_v_heads // tp)


# ---------------------------------------------------------------------------------------------
# Bytes of one shard (the loader and the per-device planner)


def _col_blocks(idx: np.ndarray, block_elems: int, what: str) -> np.ndarray:
  """Column element indices -> the block indices they are made of; JaxvtError unless whole."""
  ok = idx.size % block_elems == 0
  if ok:
    runs = idx.reshape(-1, block_elems)
    ok = bool(np.all(runs[:, 0] % block_elems == 0)) and bool(
        np.all(runs - runs[:, :1] == np.arange(block_elems)))
  if not ok:
    raise JaxvtError(f"{what}: a device's share of its columns is not whole blocks of "
                     f"{block_elems}, so it cannot be split column-wise; use a smaller tp")
  return runs[:, 0] // block_elems


def local_shape(d: WeightDecl, r: Rule) -> tuple[int, ...]:
  """Per-layer shape of one shard."""
  shape = list(d.shape)
  if r.kind == "replicate":
    return tuple(shape)
  n = len(r.index(0))
  axis = {"rows": -2, "cols": -1, "experts": 0, "vector": r.axis}[r.kind]
  shape[axis] = n
  return tuple(shape)


def shard_bytes(raw: np.ndarray, type_id: int, d: WeightDecl, r: Rule, s: int,
                label: str = "") -> np.ndarray:
  """uint8 [n] bytes of shard s of one layer's matrix (`raw`: its GGUF bytes, any shape)."""
  raw = np.asarray(raw).reshape(-1)
  if r.kind == "replicate":
    return raw
  idx = r.index(s)
  rows, cols = d.shape[-2], d.shape[-1]
  if r.kind == "experts":
    return raw.reshape(d.shape[0], -1)[idx].reshape(-1)
  rb = quants.row_bytes(type_id, cols)
  if r.kind == "rows":
    return raw.reshape(-1, rows, rb)[:, idx].reshape(-1)
  f = quants.FORMATS[type_id]
  blocks = _col_blocks(idx, f.block_elems, f"tensor '{label or d.name}' ({f.name})")
  return raw.reshape(rows, cols // f.block_elems, f.block_bytes)[:, blocks].reshape(-1)


def device_units(units, decls: list[WeightDecl], cfg: ModelConfig, par: Par | MeshSpec):
  """The file's units (jaxvt.model.declare.UnitBytes) -> (one device's units for the planner,
  {unit: distinct shards}, the pinned host copies a host-tier unit needs).

  A shard's bytes are its share of the elements (every split is whole rows, experts or blocks).
  Checks that every column split is whole blocks of the unit's format (JaxvtError naming the
  tensor otherwise; weightless units, type_id < 0, are not checked)."""
  decl = {d.name: d for d in decls}
  out, copies = [], {}
  for u in units:
    d = decl[u.name]
    r = rule(d, cfg, par)
    if r.kind == "cols" and u.type_id in quants.FORMATS:
      f = quants.FORMATS[u.type_id]
      label = names.gguf_name(cfg.arch, d.name, u.layer)
      _col_blocks(r.index(0), f.block_elems, f"tensor '{label}' ({f.name})")
    share = int(np.prod(local_shape(d, r)))
    out.append(UnitBytes(u.name, u.layer, u.nbytes * share // d.numel, u.type_id))
    copies[(u.name, u.layer)] = n_shards(r, par) if d.matrix else 1
  return out, copies


# ---------------------------------------------------------------------------------------------
# Specs, the decode state and the sharded forward


def vector_spec(d: WeightDecl, r: Rule) -> P:
  if r.kind == "replicate":
    return P()
  lead = 0 if d.layers is None else 1
  return P(*([None] * (lead + r.axis)), TP)


def qweight_spec(r: Rule) -> P:
  """Spec of a sharded QWeight's data / table / fmts: their leading axis is the shard index."""
  return P(r.axes if len(r.axes) > 1 else r.axes[0]) if r.axes else P()


@functools.lru_cache(maxsize=16)
def _specs(cfg: ModelConfig, par: Par) -> dict:
  out = {}
  for d in declare(cfg):
    r = rule(d, cfg, par)
    out[d.name] = qweight_spec(r) if d.matrix else vector_spec(d, r)
  return out


def weight_specs(weights: dict, cfg: ModelConfig, par: Par) -> dict:
  specs = _specs(cfg, par)
  return {k: QWeight(specs[k], specs[k], specs[k], w.meta) if isinstance(w, QWeight) else specs[k]
          for k, w in weights.items()}


def _local(weights: dict) -> dict:
  """Inside shard_map: drop each QWeight's leading shard axis (size 1 on every device)."""
  return {k: QWeight(w.data[0], w.table[0], w.fmts[0], w.meta) if isinstance(w, QWeight) else w
          for k, w in weights.items()}


CACHE_SPECS = {"k": P(None, None, None, TP), "v": P(None, None, None, TP),
               "conv": P(None, None, None, TP), "ssm": P(None, None, TP)}


def init_cache(cfg: ModelConfig, par: Par, batch: int, max_len: int, kv_dtype=jnp.float32) -> dict:
  """The decode state over the mesh: each device holds its own heads' KV cache / DeltaNet state
  (the shards of `decoder.init_cache(local_config(cfg))` side by side along the head axis)."""
  lc = local_config(cfg, par)
  local = jax.eval_shape(lambda: decoder.init_cache(lc, batch, max_len, kv_dtype))

  def global_shape(k, s):
    return tuple(n * par.tp if a == TP else n for n, a in
                 zip(s.shape, tuple(CACHE_SPECS[k]) + (None,) * s.ndim))

  shapes = tuple((k, global_shape(k, s), jnp.dtype(s.dtype)) for k, s in local.items())
  return _zeros(par, shapes)()


@functools.lru_cache(maxsize=16)
def _zeros(par: Par, shapes: tuple) -> Callable:
  """One jitted initializer per (mesh, shapes): a new cache (every generate makes one) compiles
  nothing after the first."""
  out = {k: NamedSharding(par.mesh, CACHE_SPECS[k]) for k, _, _ in shapes}
  return jax.jit(lambda: {k: jnp.zeros(s, d) for k, s, d in shapes}, out_shardings=out)


def forward(weights: dict, cache: dict, tokens, positions, cfg: ModelConfig, ex, kv_len: int,
            valid=None, logits_at=None):
  """`decoder.forward` as a shard_map over `ex.par.mesh`: each device runs the local model on
  its own shards (custom calls included); tokens, positions and the logits are replicated."""
  par = ex.par
  lc = local_config(cfg, par)
  if valid is None:
    valid = jnp.ones(tokens.shape, bool)

  def body(w, c, tokens, positions, valid, *at):
    return decoder.forward(_local(w), c, tokens, positions, lc, ex, kv_len, valid=valid,
                           logits_at=at[0] if at else None)

  cspecs = {k: CACHE_SPECS[k] for k in cache}
  extra = () if logits_at is None else (logits_at,)
  fn = jax.shard_map(body, mesh=par.mesh,
                     in_specs=(weight_specs(weights, cfg, par), cspecs, P(), P(), P(),
                               *(P() for _ in extra)),
                     out_specs=(P(), cspecs), check_vma=False)
  return fn(weights, cache, tokens, positions, valid, *extra)
