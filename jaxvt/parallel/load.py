"""Placing a GGUF file's tensors over a mesh: every device gets its own shard of each weight.

A sharded matrix is a QWeight whose `data`, `table` and `fmts` carry a leading shard axis
(sharded over the rule's mesh axes; size 1 and replicated for a replicated weight) and whose
`meta` describes one shard (rows, cols, experts of the shard):

  data   uint8 [S, n_device_layers, stride]   shard s's device-tier layers, on the devices that
                                             hold shard s (built there layer by layer)
  table  uint32 [S, L, 2]                    per shard: device slot, or the address of that
                                             shard's own pinned host buffer
  fmts   int32 [S, L]                        the same on every shard (one plan for all devices)

Inside the shard_map'ed forward (jaxvt.parallel.shard.forward) each device sees [1, ...] of each
and drops the axis, so the kernels read exactly the QWeight of the single-device code. A
replicated weight in the host tier has one pinned buffer that every device reads; a sharded one
has one buffer per shard (a tp shard replicated over ep is one buffer read by its ep devices).
Vectors are float32 arrays sharded along their head axis (or replicated).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxvt import loader
from jaxvt.gguf import quants
from jaxvt.model.declare import WeightDecl
from jaxvt.parallel import shard
from jaxvt.parallel.mesh import Par
from jaxvt.qweight import FMT_MASK, HOST_BIT, QMeta, QWeight, split_u64


@functools.partial(jax.jit, donate_argnums=0)
def _set_row(buf, i, row):
  return jax.lax.dynamic_update_index_in_dim(buf, row, i, 0)


def _vector(model: loader.Model, d: WeightDecl, r: shard.Rule, par: Par) -> jax.Array:
  rows = [np.asarray(t.data, dtype=np.float32).reshape(d.shape) for t in model.tensors(d)]
  arr = rows[0] if d.layers is None else np.stack(rows)
  if r.kind != "replicate":
    ax = r.axis + (0 if d.layers is None else 1)
    arr = np.concatenate([np.take(arr, r.index(s), axis=ax) for s in range(par.tp)], axis=ax)
  return jax.device_put(arr, NamedSharding(par.mesh, shard.vector_spec(d, r)))


def _device_rows(tensors, dev_pos, d, r, s, stride, device) -> jax.Array:
  """Shard s of the device-tier layers as uint8 [1, len(dev_pos), stride] on `device`."""
  if not dev_pos:
    return jnp.zeros((1, 1, 1), jnp.uint8, device=device)
  buf = jnp.zeros((len(dev_pos), stride), jnp.uint8, device=device)
  for slot, i in enumerate(dev_pos):
    t = tensors[i]
    row = np.zeros(stride, np.uint8)
    part = shard.shard_bytes(t.raw(), t.type_id, d, r, s, t.name)
    row[:part.size] = part
    buf = _set_row(buf, jnp.int32(slot), jax.device_put(row, device))
  return buf[None]


def _matrix(model: loader.Model, d: WeightDecl, r: shard.Rule, par: Par, placement,
            host) -> QWeight:
  tensors = model.tensors(d)
  S = shard.n_shards(r, par)
  lshape = shard.local_shape(d, r)
  L = len(tensors)
  fmts = np.array([t.type_id for t in tensors], np.int32)
  table = np.zeros((S, L), np.uint64)
  host_pos, dev_pos, sizes = [], [], {}
  experts = d.shape[0] if len(d.shape) == 3 else 0
  for i, (l, t) in enumerate(zip(loader.layers_of(d), tensors)):
    sizes[i] = int(np.prod(lshape[:-1])) * quants.row_bytes(t.type_id, lshape[-1])
    if placement(d.name, l) == "host":
      loader.need_host_tier(host)
      for s in range(S):
        fill = lambda a, t=t, s=s: a.__setitem__(
            slice(None), shard.shard_bytes(t.raw(), t.type_id, d, r, s, t.name))
        buf = host.copy(t.name if S == 1 else f"{t.name}#{s}", sizes[i], fill)
        table[s, i] = buf.device_address
      fmts[i] |= HOST_BIT
      host_pos.append(i)
    else:
      dev_pos.append(i)
  stride = max((sizes[i] for i in dev_pos), default=1)
  for slot, i in enumerate(dev_pos):
    table[:, i] = slot
  sharding = NamedSharding(par.mesh, shard.qweight_spec(r))
  gshape = (S, max(len(dev_pos), 1), stride)
  arrays = []
  for device, index in sharding.addressable_devices_indices_map(gshape).items():
    s = index[0].start or 0
    arrays.append(_device_rows(tensors, dev_pos, d, r, s, stride, device))
  data = jax.make_array_from_single_device_arrays(gshape, sharding, arrays)
  meta = QMeta(rows=lshape[-2], cols=lshape[-1], experts=lshape[0] if experts else 0,
               formats=tuple(sorted(set(int(f) & FMT_MASK for f in fmts))), n_layers=L,
               host_layers=tuple(host_pos))
  table = split_u64(table.reshape(-1)).reshape(S, L, 2)
  return QWeight(data, jax.device_put(table, sharding),
                 jax.device_put(np.broadcast_to(fmts, (S, L)).copy(), sharding), meta)


def load_weights(model: loader.Model, par: Par, placement: loader.Placement = loader.all_device,
                 host=None, progress: loader.Progress | None = None) -> dict:
  """Places every declared weight's shards over `par.mesh`; {canonical name: QWeight | array}."""
  weights = {}
  for d in model.decls:
    r = shard.rule(d, model.cfg, par)
    if d.matrix:
      weights[d.name] = _matrix(model, d, r, par, placement, host)
    else:
      weights[d.name] = _vector(model, d, r, par)
    if progress:
      for t in model.tensors(d):
        progress(t.n_bytes)
  return weights
