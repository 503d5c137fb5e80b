"""Host-tier layers copied to the device ahead of use: a ring per stack (csrc/prefetch.h).

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

The ring is a temporary of the program, so XLA's memory analysis (and the planner's check of it)
counts it. Everything stays correct whatever the schedule: take only redirects a layer the ring
holds (or is receiving); any other layer is read where it lives.

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


def fetch(ring: jax.Array, w: QWeight, target, after=None, *, first: bool = False) -> jax.Array:
  """Starts copying layer `target` (int32 scalar, may be traced) of `w` into `ring` if it is a
  host-tier layer; target < 0 leaves the ring as it is (its copy goes on), any other target
  marks it empty. Returns the ring. `after`: an array the program must have computed before the
  copy may overwrite the ring (the output of the ring's last reader).

  The GPU copies with a DMA where it can address the layer on the host (HostTier.register_tables)
  and where the calls follow `schedule(w.meta)`: `first=True` (target then a Python int) for the
  ring's first fetch in the program, then one call a layer in order with target
  `schedule(w.meta)[1][l]`. Calls in any other pattern still give the same results (the device
  checks the host's reckoning; a ring that does not hold a layer is never read for it)."""
  m = w.meta
  after = jnp.zeros((), jnp.int32) if after is None else after
  call = jax.ffi.ffi_call("jaxvt_prefetch_fetch", jax.ShapeDtypeStruct(ring.shape, jnp.uint8),
                          input_output_aliases={0: 0})
  return call(ring, w.table, w.fmts, _i32(target), after, rows=np.int64(m.rows),
              cols=np.int64(m.cols), experts=np.int64(m.experts),
              first=np.int64(int(target) if first else -1), schedule=schedule(m)[1])


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


def schedule(meta: QMeta) -> tuple[int, np.ndarray]:
  """(first, after): the host-tier layer a ring fetches before the layers run (-1: none), and
  int32 [L] the layer it fetches once layer l is done: the next host-tier layer where l is one
  (its ring just freed), else -1 (nothing: a copy under way goes on)."""
  host = sorted(meta.host_layers)
  after = np.full((meta.n_layers,), -1, np.int32)
  for a, b in zip(host, host[1:]):
    after[a] = b
  return (host[0] if host else -1), after
