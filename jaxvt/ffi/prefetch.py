"""Host-tier layers copied to the device ahead of use: a ring per stack (csrc/common/prefetch.h).

In prefill every routed expert of a layer is read (512 tokens choose nearly all 256), so a
host-tier layer costs its whole bytes over the bus. Read in place, the kernels wait on the bus
while nothing else runs. Here a layer's bytes are copied into a device buffer of the program (the
ring) on a stream of jaxvt's own (a DMA where the host tier registered the table, else a copy
kernel) while earlier layers compute on XLA's stream; when the layer's turn comes its kernels
read the ring, from HBM, with the same bytes (the same bits).

  first, after = schedule(w.meta)
  ring = fetch(new_ring(w.meta), w, first, first=True)  # the copy starts; nothing waits
  for each layer l, in order (a scan):
    ring, w_l = take(ring, w, l)                 # w_l reads layer l from the ring if it is there
    y = kernels(..., w_l, l)
    ring = fetch(ring, w, after[l], after=y)     # after y: the ring's last reader is done
  x = join(x, ring)                              # no copy outlives the program

A ring is free for its next layer only once its layer has run, so a host-tier layer right after
another one gets no lead; two rings can take a stack's host-tier layers in turns
(`schedule(meta, part, parts)`, Products.prefetch_rings), each copy then overlapping the layer
before it. A ring is a temporary of the program, so XLA's memory analysis (and the planner's
check of it) counts it. Everything stays correct whatever the schedule: take only redirects a
layer the ring holds (or is receiving); any other layer is read where it lives.

The reference is the identity: take's weight reads the same bytes as `w` (tests compare products
and the ring's bytes against the file's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi as _ffi
from jaxvt.gguf.formats import row_bytes
from jaxvt.qweight import QMeta, QWeight

_ffi.register()

HEADER = 1024  # bytes after the layer's (prefetch.h: Header)


def layer_bytes(meta: QMeta) -> int:
  """Bytes of the stack's largest layer (any of its formats)."""
  per_row = max(row_bytes(f, meta.cols) for f in meta.formats)
  return per_row * meta.rows * max(meta.experts, 1)


def ring_bytes(meta: QMeta) -> int:
  """A ring's bytes for a stack: its largest layer rounded up to 256 bytes, then the header."""
  return -(-layer_bytes(meta) // 256) * 256 + HEADER


def new_ring(meta: QMeta) -> jax.Array:
  """An empty ring (zeros: no copy asked for)."""
  return jnp.zeros((ring_bytes(meta),), jnp.uint8)


def _i32(v) -> jax.Array:
  return jnp.asarray(v).astype(jnp.int32).reshape(())


def fetch(ring: jax.Array, w: QWeight, target, after=None, *, first: bool = False,
          part: int = 0, parts: int = 1) -> jax.Array:
  """Starts copying layer `target` (int32 scalar, may be traced) of `w` into `ring` if it is a
  host-tier layer; target < 0 leaves the ring as it is (its copy goes on), any other target
  marks it empty. Returns the ring. `after`: an array the program must have computed before the
  copy may overwrite the ring (the output of the ring's last reader).

  The GPU copies with a DMA where it can address the layer on the host (HostTier.register_tables)
  and where the calls follow `schedule(w.meta, part, parts)` (the ring's share of the stack's
  host-tier layers): `first=True` (target then a Python int) for the ring's first fetch in the
  program, then one call a layer in order with target `schedule(w.meta, part, parts)[1][l]`.
  Calls in any other pattern still give the same results (the device checks the host's
  reckoning; a ring that does not hold a layer is never read for it)."""
  m = w.meta
  after = jnp.zeros((), jnp.int32) if after is None else after
  call = jax.ffi.ffi_call("jaxvt_prefetch_fetch", jax.ShapeDtypeStruct(ring.shape, jnp.uint8),
                          input_output_aliases={0: 0})
  return call(ring, w.table, w.fmts, _i32(target), after, rows=np.int64(m.rows),
              cols=np.int64(m.cols), experts=np.int64(m.experts),
              first=np.int64(int(target) if first else -1), schedule=schedule(m, part, parts)[1])


def take(ring: jax.Array, w: QWeight, layer) -> tuple[jax.Array, QWeight]:
  """(ring, w') where w' reads layer `layer` from the ring when the ring holds (or is receiving)
  it, waiting on the device for the copy, and everything else where `w` does."""
  call = jax.ffi.ffi_call("jaxvt_prefetch_take",
                          (jax.ShapeDtypeStruct(ring.shape, jnp.uint8),
                           jax.ShapeDtypeStruct(w.table.shape, jnp.uint32)),
                          input_output_aliases={0: 0})
  ring, table = call(ring, w.table, w.fmts, _i32(layer))
  return ring, dataclasses.replace(w, table=table)


def join(x: jax.Array, ring: jax.Array) -> jax.Array:
  """x, once (on the device) every copy started so far is done and `ring`'s last reader has run:
  pass something the program goes on to use (the hidden state), so the join is part of its
  dataflow. (No call here is marked side-effecting: a program with JAX effects leaves its error
  in JAX's runtime tokens when it fails, to be raised again by later work.)"""
  call = jax.ffi.ffi_call("jaxvt_prefetch_join", jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={0: 0})
  return call(x, ring)


def schedule(meta: QMeta, part: int = 0, parts: int = 1) -> tuple[int, np.ndarray]:
  """(first, after) of ring `part` of `parts` that take the stack's host-tier layers in turns
  (ring k the k-th, (k + parts)-th, ... of them): the layer it fetches before the layers run
  (-1: none), and int32 [L] the layer it fetches once layer l is done: its next layer where l is
  one of its layers (the ring just freed), else -1 (nothing: a copy under way goes on)."""
  host = sorted(meta.host_layers)[part::parts]
  after = np.full((meta.n_layers,), -1, np.int32)
  for a, b in zip(host, host[1:]):
    after[a] = b
  return (host[0] if host else -1), after


# ---------------------------------------------------------------------------------------------
# Decode: the experts the next host-tier layer's router will most likely pick, copied ahead
# (prefetch.h, XHeader). At one token, layer l + 1's router applied to layer l's MoE input names
# most of the experts layer l + 1 then routes to; jaxvt.offload.schedule asks
# for them once layer l's experts are read, and layer l + 1's per-slot experts kernels read the
# ones that came from the ring (ops.moe_experts(rings=...)): the same bytes, so the same bits.
#
#   rings = {n: new_expert_ring(w[n].meta) for n in stacks}
#   for each layer l (a scan):
#     y = ops.moe_experts(..., rings=rings)                 # layer l reads what its ring holds
#     rings = fetch_experts(rings, w, l + 1, predicted_ids, after=y, n_host=2, n_device=4)
#   x = join(x, any ring)
#
# With two rings a stack (layer l reads ring l % 2) the fetch into the other ring need not wait
# for layer l's experts: after a device-tier layer (the bus idle) it comes right after the router
# (when="after_device"), after a host-tier one after the down product (when="after_host").

XHEADER = 4096  # prefetch.h kXHeader
XSLOTS = 8  # prefetch.h kXSlotsMax


def expert_slot_bytes(meta: QMeta) -> int:
  """Bytes of one slot: an expert of the stack in its largest format, rounded up to 256."""
  per_row = max(row_bytes(f, meta.cols) for f in meta.formats)
  return -(-per_row * meta.rows // 256) * 256


def new_expert_ring(meta: QMeta) -> jax.Array:
  """An empty expert ring (zeros: no copy asked for)."""
  return jnp.zeros((XHEADER + XSLOTS * expert_slot_bytes(meta),), jnp.uint8)


WHEN = {"any": 0, "after_host": 1, "after_device": 2}  # prefetch.h expert_count


def fetch_experts(rings: dict, ws: dict, target, ids, after=None, *, n_host: int,
                  n_device: int, when: str = "any", inline: bool = False,
                  blocks: int = 0, scale: int = 0) -> dict:
  """Starts copying, into each stack's ring, the first n of `ids` (int32 [m], most likely first)
  of layer `target` (int32 scalar, may be traced) of that stack, where it is a host-tier layer:
  n = n_host when layer target - 1 of the stack is host-tier too, else n_device; scale > 0: those
  are for a target where `scale` of the call's stacks are host-tier, and one where k are gets
  n * scale // k, each copied by proportionally fewer blocks (at least 4: prefetch.h
  copy_blocks); n at most 8 and at most m. Any other target empties the ring. when="after_host" /
  "after_device": only targets of that kind are fetched, any other leaves the ring as it is.
  `after`: what the program must have computed before the rings may be overwritten (their last
  reader's output). inline: on a GPU the copy is a kernel on XLA's stream that XLA may capture in
  a command buffer (else on a stream of jaxvt's own), `blocks` blocks an expert (0: the
  default). Returns the rings."""
  names = tuple(rings)
  metas = [ws[n].meta for n in names]
  if len({m.experts for m in metas}) != 1 or not metas[0].experts:
    raise ValueError("fetch_experts: expert stacks with one expert count")
  after = jnp.zeros((), jnp.int32) if after is None else after
  ids = jnp.asarray(ids).astype(jnp.int32).reshape(-1)
  call = jax.ffi.ffi_call("jaxvt_prefetch_experts_inline" if inline else "jaxvt_prefetch_experts",
                          tuple(jax.ShapeDtypeStruct(rings[n].shape, jnp.uint8) for n in names),
                          input_output_aliases={3 + 3 * i: i for i in range(len(names))})
  operands = [a for n in names for a in (rings[n], ws[n].table, ws[n].fmts)]
  out = call(_i32(target), ids, after, *operands,
             rows=np.array([m.rows for m in metas], np.int64),
             cols=np.array([m.cols for m in metas], np.int64),
             slot=np.array([expert_slot_bytes(m) for m in metas], np.int64),
             experts=np.int64(metas[0].experts), n_host=np.int64(n_host),
             n_device=np.int64(n_device), when=np.int64(WHEN[when]), blocks=np.int64(blocks),
             scale=np.int64(scale))
  return dict(zip(names, out))
