"""The model over a mesh of devices: its axes, each weight's rule, per-device shapes and the
sharded forward. One device is the 1 x 1 mesh, where every rule is "replicate".

The mesh has two axes, "ep" (major) and "tp" (minor). Attention heads (and the KV cache), FFN
and shared-expert hidden units, DeltaNet heads (and their conv / recurrent state) and the output
head's vocab rows split over "tp"; routed experts split over ("ep", "tp") together.

`rule(d, mesh)` resolves a declaration's `Split` (jaxvt.model.declare) for a mesh's sizes: the
indices each shard holds along the split axis. A split into one part is "replicate". Every
shard has the same shape, so every device has the same per-device unit bytes and one plan serves
every device. Inside `forward` (a `jax.shard_map` over the mesh) the model runs on a per-device
`local_config` (heads, KV heads, FFN and DeltaNet heads divided by tp; the expert count stays
global, it is the router's width) and reads its own shards only; the collectives are written
once, in the model (layers.reduce, moe.local_experts, the head's all-gather in the decoder).

Weights over the mesh: a replicated matrix is a QWeight as on one device (its arrays replicated
on every device); a sharded one carries a leading shard axis on `data` [S, n_dev, stride],
`table` [S, L, 2] (each shard's own device slot or pinned-buffer address) and `fmts` [S, L],
split over the rule's mesh axes, and a `meta` of one shard's shape; the shard_map body drops
the axis. Vectors are float32 arrays split along their head axis, or replicated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxvt.errors import JaxvtError
from jaxvt.gguf import names, quants
from jaxvt.model import decoder
from jaxvt.model.axes import AXES, EP, TP
from jaxvt.model.config import ModelConfig
from jaxvt.model.declare import UnitBytes, WeightDecl, declare
from jaxvt.qweight import QWeight

class Sizes(Protocol):
  """A mesh's axis sizes (jaxvt.parallel.mesh.MeshSpec, or Par for a built mesh)."""
  tp: int
  ep: int


@dataclasses.dataclass(frozen=True)
class Par:
  """Where a model runs, fixed at load time (static, hashable: part of `Exec`).

  mesh: the jax Mesh (axes "ep", "tp"; one device: 1 x 1); head_sharded: the output head's vocab
  rows are split over "tp" (its logits are all-gathered), else it is replicated.
  """
  mesh: jax.sharding.Mesh
  head_sharded: bool = False

  @property
  def tp(self) -> int:
    return int(self.mesh.shape[TP])

  @property
  def ep(self) -> int:
    return int(self.mesh.shape[EP])

  @property
  def size(self) -> int:
    return self.tp * self.ep

  @property
  def devices(self) -> list:
    """The mesh's devices, "ep"-major."""
    return list(self.mesh.devices.flat)


def one_device(device=None) -> Par:
  """The 1 x 1 mesh on `device` (default: JAX's first)."""
  grid = np.empty((1, 1), dtype=object)
  grid[0, 0] = device or jax.devices()[0]
  return Par(jax.sharding.Mesh(grid, AXES))


@dataclasses.dataclass(frozen=True)
class Rule:
  """A declaration's split on a mesh. kind: "replicate" | "rows" | "cols" | "experts" |
  "vector"; axes: the mesh axes the shard index runs over (major first); index(s): the rows /
  column elements / experts / vector entries (along per-layer axis `axis`) that shard s holds,
  in their order inside the shard."""
  kind: str
  axes: tuple[str, ...] = ()
  index: Callable[[int], np.ndarray] | None = None
  axis: int = 0


REPLICATE = Rule("replicate")


def rule(d: WeightDecl, mesh: Sizes) -> Rule:
  """The rule of declaration `d` on a mesh of `mesh`'s sizes."""
  sp = d.split
  if sp.kind == "replicate":
    return REPLICATE
  axes = AXES if sp.kind == "experts" else (TP,)
  parts = mesh.tp * mesh.ep if sp.kind == "experts" else mesh.tp
  if parts == 1 or sp.divides and sp.divides % parts:
    return REPLICATE
  return Rule(sp.kind, axes, lambda s: sp.index(parts, s), sp.axis)


def n_shards(r: Rule, mesh: Sizes) -> int:
  """How many distinct shards the rule cuts a tensor into (1: replicated)."""
  return int(np.prod([mesh.tp if a == TP else mesh.ep for a in r.axes])) if r.axes else 1


def head_sharded(cfg: ModelConfig, mesh: Sizes) -> bool:
  """Whether the output head splits its vocab rows over tp (an untied head whose vocab divides)."""
  return any(d.name == "lm_head" and rule(d, mesh).kind == "rows" for d in declare(cfg))


def check(cfg: ModelConfig, spec) -> None:
  """JaxvtError when the model does not split over the mesh `spec` (a MeshSpec)."""
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


def local_config(cfg: ModelConfig, mesh: Sizes) -> ModelConfig:
  """The model as one device of the mesh runs it (heads and hidden units divided by tp)."""
  tp = mesh.tp
  if tp == 1:
    return cfg
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


def device_units(units: list[UnitBytes], decls: list[WeightDecl], cfg: ModelConfig,
                 mesh: Sizes) -> tuple[list[UnitBytes], dict]:
  """The model's units -> (one device's units for the planner, {unit: the pinned host copies a
  host-tier unit needs (its distinct shards)}).

  A shard's bytes are its share of the elements (every split is whole rows, experts or blocks).
  Checks that every column split is whole blocks of the unit's format (JaxvtError naming the
  tensor otherwise; weightless units, type_id < 0, are not checked)."""
  decl = {d.name: d for d in decls}
  out, copies = [], {}
  for u in units:
    d = decl[u.name]
    r = rule(d, mesh)
    if r.kind == "cols" and u.type_id in quants.FORMATS:
      f = quants.FORMATS[u.type_id]
      label = names.gguf_name(cfg.arch, d.name, u.layer)
      _col_blocks(r.index(0), f.block_elems, f"tensor '{label}' ({f.name})")
    share = int(np.prod(local_shape(d, r)))
    out.append(UnitBytes(u.name, u.layer, u.nbytes * share // d.numel, u.type_id))
    copies[(u.name, u.layer)] = n_shards(r, mesh) if d.matrix else 1
  return out, copies


# ---------------------------------------------------------------------------------------------
# Specs, the decode state and the sharded forward


def vector_spec(d: WeightDecl, r: Rule) -> P:
  if r.kind == "replicate":
    return P()
  lead = 0 if d.layers is None else 1
  return P(*([None] * (lead + r.axis)), TP)


def qweight_spec(r: Rule) -> P:
  """Spec of a QWeight's data / table / fmts: a sharded one's leading axis is the shard index
  (over the rule's axes); a replicated one is whole on every device."""
  return P(r.axes if len(r.axes) > 1 else r.axes[0]) if r.axes else P()


@functools.lru_cache(maxsize=16)
def _specs(cfg: ModelConfig, mesh: Sizes) -> dict:
  out = {}
  for d in declare(cfg):
    r = rule(d, mesh)
    out[d.name] = qweight_spec(r) if d.matrix else vector_spec(d, r)
  return out


def _weight_specs(weights: dict, specs: dict) -> dict:
  """The in_specs pytree of `weights` (a QWeight's three arrays share its spec; what no
  declaration names, the expert cache's address tables, is replicated)."""
  return {k: dataclasses.replace(w, data=specs[k], table=specs[k], fmts=specs[k])
          if isinstance(w, QWeight) else specs.get(k, P()) for k, w in weights.items()}


def _local(weights: dict, specs: dict) -> dict:
  """Inside shard_map: drop each sharded QWeight's leading shard axis (size 1 on a device)."""
  return {k: dataclasses.replace(w, data=w.data[0], table=w.table[0], fmts=w.fmts[0])
          if isinstance(w, QWeight) and specs.get(k, P()) != P() else w
          for k, w in weights.items()}


CACHE_SPECS = {"k": P(None, None, None, TP), "v": P(None, None, None, TP),
               "conv": P(None, None, None, TP), "ssm": P(None, None, TP)}


def init_cache(cfg: ModelConfig, par, batch: int, max_len: int, kv_dtype=jnp.float32) -> dict:
  """The decode state over `par.mesh`: each device holds its own heads' KV cache / DeltaNet
  state (the shards of `decoder.init_cache(local_config(cfg))` side by side along the head
  axis)."""
  lc = local_config(cfg, par)
  local = jax.eval_shape(lambda: decoder.init_cache(lc, batch, max_len, kv_dtype))

  def global_shape(k, s):
    return tuple(n * par.tp if a == TP else n for n, a in
                 zip(s.shape, tuple(CACHE_SPECS[k]) + (None,) * s.ndim))

  shapes = tuple((k, global_shape(k, s), jnp.dtype(s.dtype)) for k, s in local.items())
  return _zeros(par, shapes)()


@functools.lru_cache(maxsize=16)
def _zeros(par, shapes: tuple) -> Callable:
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
  specs = _specs(cfg, par)
  if valid is None:
    valid = jnp.ones(tokens.shape, bool)

  def body(w, c, tokens, positions, valid, *at):
    return decoder.forward(_local(w, specs), c, tokens, positions, lc, ex, kv_len, valid=valid,
                           logits_at=at[0] if at else None)

  cspecs = {k: CACHE_SPECS[k] for k in cache}
  extra = () if logits_at is None else (logits_at,)
  fn = jax.shard_map(body, mesh=par.mesh,
                     in_specs=(_weight_specs(weights, specs), cspecs, P(), P(), P(),
                               *(P() for _ in extra)),
                     out_specs=(P(), cspecs), check_vma=False)
  return fn(weights, cache, tokens, positions, valid, *extra)
