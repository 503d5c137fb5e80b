"""Grouped routed experts for prefill: token slots sorted by expert, one tiled tensor-core kernel
over every expert of a layer (`csrc/kernels_gpu_grouped.cu`; a CPU handler with the same
contract), each beside its jnp reference. The same kernel multiplies a plain matrix by many rows
(`qmatmul_tiled`). Shapes as in jaxvt.ffi.ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.ffi import numerics
from jaxvt.ffi.ops import (_check, _check_x_ids, _dense_x, _ids, _layer, _moe, _switch_formats,
                           _vmappable)
from jaxvt.gguf import quants
from jaxvt.qweight import QWeight

# ---------------------------------------------------------------------------------------------
# grouped experts: slots sorted by expert, one tiled tensor-core kernel over every expert
#
# Arithmetic ("bf16"): weights dequantized exactly, then rounded to bf16 (nearest even); activations
# rounded to bf16; every product is then exact in float32, and the sums are float32 (in the
# kernel's order: k-tiles on GPU tensor cores, k order on the CPU).


def group_slots(ids: jax.Array, experts: int) -> tuple[jax.Array, jax.Array]:
  """ids int32 [T, k] -> (order int32 [T*k], offsets int32 [E' + 1]), E' = max(experts, 1): the
  slots t*k + j sorted by expert (stable), and where each expert's run of sorted positions starts.
  Slots with a negative id (routed nowhere) sort last, from offsets[E'] on; ids above range are
  clamped into it."""
  g = max(experts, 1)
  flat = _ids(ids).reshape(-1)
  key = jnp.where(flat < 0, g, jnp.minimum(flat, g - 1))
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  counts = jnp.zeros((g + 1,), jnp.int32).at[key].add(1)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts[:g], dtype=jnp.int32)])
  return order, offsets


@functools.cache
def _grouped_call(rows: int, cols: int, experts: int):
  def call(xb, data, table, fmts, layer, order, offsets):
    out = jax.ShapeDtypeStruct((order.shape[0], rows), jnp.float32)
    return jax.ffi.ffi_call("jaxvt_qmatmul_grouped", out)(
        xb, data, table, fmts, layer, order, offsets, rows=np.int64(rows), cols=np.int64(cols),
        experts=np.int64(experts))

  return _vmappable(call, lambda *a: None)


def _bf16(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)


def qmatmul_grouped(x: jax.Array, w: QWeight, layer, ids: jax.Array,
                    groups: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
  """x f32 [T, cols] or [T, k, cols], ids int32 [T, k] -> f32 [T, k, rows]: qmatmul_experts'
  contract (clamped ids; a negative id gives a zero row and reads nothing) in bf16 arithmetic.

  The slots are sorted by expert on the device (`group_slots`; pass `groups` to share one sort
  between products with the same ids) and one kernel multiplies every expert's run of slots,
  reading each routed expert's bytes once per tile of 32 slots from whichever tier holds the layer
  (tensor cores on CUDA sm_80+); rows land back in slot order. For prefill: many slots per expert.
  """
  _check(w, "qmatmul_grouped", experts=True)
  m = w.meta
  x = jnp.asarray(x, jnp.float32)
  ids = _ids(ids)
  _check_x_ids(x, ids, m.cols, "qmatmul_grouped")
  order, offsets = group_slots(ids, m.experts) if groups is None else groups
  y = _grouped_call(m.rows, m.cols, m.experts)(_bf16(x).reshape(-1, m.cols), w.data, w.table,
                                               w.fmts, _layer(layer), order, offsets)
  return y.reshape(*ids.shape, m.rows)


def _bf16_weights(raw, fmt, cols):
  """raw uint8 [..., row_bytes] -> its weights rounded to bf16, as float32 [..., cols]."""
  return numerics.round_to(quants.dequantize(raw, fmt, cols), jnp.bfloat16)


def qmatmul_grouped_ref(x: jax.Array, w: QWeight, layer, ids: jax.Array) -> jax.Array:
  """Reference for qmatmul_grouped: gathers each slot's expert (device-tier layers), bf16-rounds
  weights and activations, float32 einsum. Memory O(T k rows cols): for tests."""
  _check(w, "qmatmul_grouped_ref", experts=True)
  m = w.meta
  ids = _ids(ids)
  routed = ids >= 0
  ids = jnp.clip(ids, 0, m.experts - 1)
  xs = numerics.round_to(x, jnp.bfloat16)
  xs = xs[:, None] if xs.ndim == 2 else xs  # [T, 1 or k, cols]

  def fn(raw, fmt):
    per_expert = raw.reshape(m.experts, -1)[ids].reshape(*ids.shape, m.rows, -1)
    return jnp.einsum("tjc,tjrc->tjr", xs, _bf16_weights(per_expert, fmt, m.cols),
                      precision=jax.lax.Precision.HIGHEST)

  return jnp.where(routed[..., None], _switch_formats(w, layer, fn), 0.0)


def qmatmul_tiled(x: jax.Array, w: QWeight, layer) -> jax.Array:
  """x f32 [..., cols] -> f32 [..., rows]: x @ W[layer].T in qmatmul_grouped's bf16 arithmetic and
  kernel (one group of every row of x): W's bytes read once per 32 rows, tensor cores on CUDA."""
  x = _dense_x(x, w, "qmatmul_tiled")
  m = w.meta
  lead = x.shape[:-1]
  n = int(np.prod(lead, dtype=np.int64))
  order = jnp.arange(n, dtype=jnp.int32)
  offsets = jnp.array([0, n], jnp.int32)
  y = _grouped_call(m.rows, m.cols, 0)(_bf16(x).reshape(n, m.cols), w.data, w.table, w.fmts,
                                       _layer(layer), order, offsets)
  return y.reshape(*lead, m.rows)


def qmatmul_tiled_ref(x: jax.Array, w: QWeight, layer) -> jax.Array:
  """Reference for qmatmul_tiled (device-tier layers)."""
  _check(w, "qmatmul_tiled_ref", experts=False)
  m = w.meta
  xs = numerics.round_to(x, jnp.bfloat16)
  return _switch_formats(w, layer, lambda raw, f: jnp.einsum(
      "...c,rc->...r", xs, _bf16_weights(raw, f, m.cols), precision=jax.lax.Precision.HIGHEST))


def moe_grouped(x, w_gate: QWeight, w_up: QWeight, w_down: QWeight, layer, ids, weights,
                on_read=None):
  """moe_experts with the grouped kernel (bf16 products, float32 SwiGLU and sum): one sort of the
  slots serves gate, up and down. on_read as for ops.moe_experts."""
  groups = group_slots(ids, w_gate.meta.experts)
  mm = lambda x, w, l, i, mode: qmatmul_grouped(x, w, l, i, groups)
  return _moe(x, w_gate, w_up, w_down, layer, ids, weights, mm, "f32", on_read=on_read)


def moe_grouped_ref(x, w_gate: QWeight, w_up: QWeight, w_down: QWeight, layer, ids, weights):
  """Reference for moe_grouped."""
  mm = lambda x, w, l, i, mode: qmatmul_grouped_ref(x, w, l, i)
  return _moe(x, w_gate, w_up, w_down, layer, ids, weights, mm, "f32")


