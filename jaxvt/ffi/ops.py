"""Ops over quantized weight stacks (`QWeight`), each beside its jnp reference (`*_ref`).

Kernels (XLA FFI custom calls, `jaxvt.ffi._jaxvt_ffi`) read a layer's raw GGUF blocks where they
are: device-tier layers inside `w.data`, host-tier layers in place in pinned host memory at the
address in `w.table`. The layer index is an operand the kernel reads on the device, so every op
works inside `lax.scan` / `fori_loop` with a traced layer and under CUDA-graph replay. All
accumulation is float32 (see csrc/kernels_cpu.h and csrc/kernels/gpu/matvec.cuh for the order).

Arithmetic (`mode`, jaxvt.ffi.numerics): "ggml" (default) is llama.cpp's CPU arithmetic: each
activation row is quantized to the weight format's ggml vec-dot type (Q8_0 for Q4_0/Q8_0, Q8_1
for Q4_1, Q8_K for K formats, F16/BF16 for F16/BF16 weights), dotted in integers and scaled in
float32; the CPU kernels add in the order of ggml's AVX2 build (bit-identical to llama.cpp for
Q4_0/Q4_1/Q8_0/F16/F32), the references in XLA's. ggml mode has CPU kernels only (XLA names the
missing CUDA/ROCm handler if one is compiled for a GPU; numerics.default_mode(platform) is the
mode to pass there). "f32" dequantizes exactly and takes an f32 dot product. References pick the layer's format with `lax.switch` over `w.meta.formats` and use jnp
math. They read device-tier layers only: for a host-tier layer they return NaN.

Model steps in ggml arithmetic (`rms_norm`, `swiglu`, `rope`, `attention`) are in
jaxvt.ffi.steps, the MoE router's softmax-top-k in jaxvt.ffi.route.

Shapes (rows x cols is one layer's matrix, E = w.meta.experts):
  qmatmul(x f32 [..., cols], w, layer)                 -> f32 [..., rows]
  qmatmul_experts(x [T, cols] | [T, k, cols], w, layer, ids int32 [T, k]) -> f32 [T, k, rows]
  moe_experts(x [T, cols], w_gate, w_up, w_down, layer, ids [T, k], weights [T, k]) -> [T, cols]
  qembed(ids int32 [...], w, layer=0)                  -> f32 [..., cols]
  qdequant(w, layer)                                   -> bf16 [rows, cols] or [E, rows, cols]
  qmatmul_grouped(x [T, cols] | [T, k, cols], w, layer, ids [T, k])  -> f32 [T, k, rows]  (bf16)
  qmatmul_tiled(x f32 [..., cols], w, layer)           -> f32 [..., rows]                 (bf16)
  moe_grouped(x [T, cols], w_gate, w_up, w_down, layer, ids, weights) -> [T, cols]        (bf16)
Expert ids and embedding ids are clamped into range, like JAX gathers. The grouped ops (prefill on
a GPU) compute in bf16 arithmetic: bf16-rounded weights and activations, float32 sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi as _ffi
from jaxvt.errors import JaxvtError
from jaxvt.ffi import numerics
from jaxvt.gguf.formats import FORMATS
from jaxvt.gguf.quants import dequantize
from jaxvt.qweight import FMT_MASK, HOST_BIT, QWeight

_ffi.register()

def _row_bytes(fmt: int, cols: int) -> int:
  """Bytes of a row as the kernels step through it (whole k-blocks; `_check` has run)."""
  f = FORMATS[fmt]
  return cols // f.kblock_elems * f.kblock_bytes


def _check(w: QWeight, op: str, experts: bool | None = None) -> None:
  m = w.meta
  for f in m.formats:
    if f not in FORMATS:
      raise JaxvtError(f"{op}: weight format ggml type {f} has no jaxvt kernel; use a GGUF whose "
                       f"matrices are {', '.join(x.name for x in FORMATS.values())}")
    if m.cols % FORMATS[f].kblock_elems:
      raise JaxvtError(f"{op}: {m.cols} columns are not whole {FORMATS[f].name} blocks of "
                       f"{FORMATS[f].kblock_elems}; the tensor is mis-shaped")
  if experts is True and not m.experts:
    raise JaxvtError(f"{op} needs a stacked-experts weight (experts > 0); use qmatmul for a matrix")
  if experts is False and m.experts:
    raise JaxvtError(f"{op} got a stacked-experts weight; use qmatmul_experts")


def _mode(mode: str) -> str:
  if mode not in numerics.MODES:
    raise JaxvtError(f"arithmetic mode {mode!r} is not one of {', '.join(numerics.MODES)}")
  return mode


def _act_bytes(w: QWeight) -> int:
  return max(numerics.act_row_bytes(f, w.meta.cols) for f in w.meta.formats)


def _check_x_ids(x, ids, cols: int, name: str) -> None:
  """x [T, cols] or [T, k, cols] with ids [T, k] (an experts product's operands)."""
  if ids.ndim != 2 or x.shape[-1] != cols or x.shape[:-1] not in ((ids.shape[0],), ids.shape):
    raise JaxvtError(f"{name}: x {x.shape} and ids {ids.shape} must be [T, {cols}] or "
                     f"[T, k, {cols}] with ids [T, k]")


def _dense_x(x, w: QWeight, name: str) -> jax.Array:
  """x as float32 [..., cols] for a dense product with `w` (checked: a dense weight, x's last
  axis its columns)."""
  _check(w, name, experts=False)
  x = jnp.asarray(x, jnp.float32)
  if x.shape[-1:] != (w.meta.cols,):
    raise JaxvtError(f"{name}: x has {x.shape[-1:]} columns, the weight {w.meta.cols}")
  return x


def _layer(layer) -> jax.Array:
  layer = jnp.asarray(layer)
  if layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
    raise JaxvtError(f"the layer index must be an integer scalar, got {layer.dtype}{layer.shape}")
  return layer.astype(jnp.int32)


def _ids(ids) -> jax.Array:
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise JaxvtError(f"ids must be integers, got {ids.dtype}")
  return ids.astype(jnp.int32)


def _vmappable(fn, fast):
  """custom_vmap around fn(*args): `fast(axis_size, in_batched, *args)` handles the batchings it
  can in one call (returns None otherwise); the rest run one element at a time with lax.map."""
  fn = jax.custom_batching.custom_vmap(fn)

  @fn.def_vmap
  def rule(axis_size, in_batched, *args):
    out = fast(fn, axis_size, in_batched, *args)
    if out is not None:
      return out, True
    batched = tuple(a for a, b in zip(args, in_batched) if b)

    def one(sliced):
      it = iter(sliced)
      return fn(*(next(it) if b else a for a, b in zip(args, in_batched)))

    return jax.lax.map(one, batched), True

  return fn


# ---------------------------------------------------------------------------------------------
# qmatmul


@functools.cache
def _qmatmul_call(rows: int, cols: int):
  def call(x2, data, table, fmts, layer):
    out = jax.ShapeDtypeStruct((x2.shape[0], rows), jnp.float32)
    return jax.ffi.ffi_call("jaxvt_qmatmul", out)(
        x2, data, table, fmts, layer, rows=np.int64(rows), cols=np.int64(cols))

  def fast(fn, n, in_batched, x2, data, table, fmts, layer):
    if any(in_batched[1:]):
      return None
    return fn(x2.reshape(-1, cols), data, table, fmts, layer).reshape(n, -1, rows)

  return _vmappable(call, fast)


@functools.cache
def _qmatmul_q8_call(rows: int, cols: int, act_bytes: int, swiglu: bool = False):
  """swiglu: the operands start with the gate and up rows (jaxvt_swiglu_qmatmul_q8)."""
  nx = 2 if swiglu else 1
  target = "jaxvt_swiglu_qmatmul_q8" if swiglu else "jaxvt_qmatmul_q8"

  def call(*args):  # x2 (and u2), data, table, fmts, layer
    out = (jax.ShapeDtypeStruct((args[0].shape[0], rows), jnp.float32),
           jax.ShapeDtypeStruct((args[0].shape[0], act_bytes), jnp.uint8))  # activation scratch
    return jax.ffi.ffi_call(target, out)(*args, rows=np.int64(rows), cols=np.int64(cols))[0]

  def fast(fn, n, in_batched, *args):
    if any(in_batched[nx:]):
      return None
    xs = [a.reshape(-1, cols) if b else jnp.broadcast_to(a, (n, *a.shape)).reshape(-1, cols)
          for a, b in zip(args[:nx], in_batched)]
    return fn(*xs, *args[nx:]).reshape(n, -1, rows)

  return _vmappable(call, fast)


def qmatmul(x: jax.Array, w: QWeight, layer, mode: str = "ggml",
            up: jax.Array | None = None) -> jax.Array:
  """x f32 [..., cols] -> f32 [..., rows]: x @ W[layer].T in arithmetic `mode`, reading W's
  blocks in place. up (integer products: "ggml", "q8"): the product of swiglu(x, up), x the gate,
  formed by the kernel as it reads x: on the CPU jaxvt_swiglu's rows (ggml's), on a GPU
  numerics.swiglu's expression with the device's expf (swiglu_qmatmul_ref: the composition)."""
  x = _dense_x(x, w, "qmatmul")
  m = w.meta
  lead = x.shape[:-1]
  args = (x.reshape(-1, m.cols), w.data, w.table, w.fmts, _layer(layer))
  if up is not None:
    _swiglu_mode(mode, x, up, "qmatmul")
    u = jnp.asarray(up, jnp.float32).reshape(-1, m.cols)
    y = _qmatmul_q8_call(m.rows, m.cols, _act_bytes(w), True)(args[0], u, *args[1:])
  elif numerics.integer_products(_mode(mode)):
    y = _qmatmul_q8_call(m.rows, m.cols, _act_bytes(w))(*args)
  else:
    y = _qmatmul_call(m.rows, m.cols)(*args)
  return y.reshape(*lead, m.rows)


def _swiglu_mode(mode: str, g, u, name: str) -> None:
  """The swiglu products' checks: integer products ("ggml", "q8"), g and u of one shape."""
  if not numerics.integer_products(_mode(mode)):
    raise JaxvtError(f"{name}: swiglu's product (up=) takes integer products (the 'ggml' or "
                     f"'q8' mode), not {mode!r}")
  if jnp.shape(g) != jnp.shape(u):
    raise JaxvtError(f"{name}: the gate {jnp.shape(g)} and up {jnp.shape(u)} differ in shape")


def swiglu_qmatmul_ref(g: jax.Array, u: jax.Array, w: QWeight, layer,
                       mode: str = "ggml") -> jax.Array:
  """Reference for qmatmul(g, w, layer, mode, up=u): numerics.swiglu, then qmatmul_ref."""
  return qmatmul_ref(numerics.swiglu(g, u), w, layer, mode)


@functools.cache
def _multi_call(rows: tuple[int, ...], cols: int, act_bytes: tuple[int, ...] | None):
  """(fused GPU call, separate calls); act_bytes: per matrix, the activation scratch of ggml's
  arithmetic (None: float32)."""
  def fused(x2, layer, *bufs):
    out = tuple(jax.ShapeDtypeStruct((x2.shape[0], r), jnp.float32) for r in rows)
    return jax.ffi.ffi_call("jaxvt_qmatmul_multi", out)(
        x2, layer, *bufs, cols=np.int64(cols), ggml=np.int64(act_bytes is not None))

  def separate(x2, layer, *bufs):
    one = lambda i, r: (_qmatmul_call(r, cols) if act_bytes is None else
                        _qmatmul_q8_call(r, cols, act_bytes[i]))
    return tuple(one(i, r)(x2, *bufs[3 * i:3 * i + 3], layer) for i, r in enumerate(rows))

  return fused, separate


MAX_MULTI = 4  # matrices one qmatmul_multi launch takes (csrc/kernels_gpu.h kMaxMulti)


def qmatmul_multi(x: jax.Array, ws, layer, mode: str = "ggml") -> list[jax.Array]:
  """[qmatmul(x, w, layer, mode) for w in ws]: several matrices with the same input (each in its
  own format and tier). On a GPU, up to MAX_MULTI of them ("f32" or "q8") run as one launch,
  which gives the same bits as separate launches; elsewhere (and in ggml mode) they are separate
  calls."""
  ws = list(ws)
  if _mode(mode) == "ggml" or len(ws) == 1:  # ggml mode is the CPU's: separate calls
    return [qmatmul(x, w, layer, mode) for w in ws]
  if len(ws) > MAX_MULTI:
    return (qmatmul_multi(x, ws[:MAX_MULTI], layer, mode)
            + qmatmul_multi(x, ws[MAX_MULTI:], layer, mode))
  cols = ws[0].meta.cols
  for w in ws:
    _check(w, "qmatmul_multi", experts=False)
    if w.meta.cols != cols:
      raise JaxvtError(f"qmatmul_multi: the matrices have {w.meta.cols} and {cols} columns; "
                       "they must share their input")
  x = jnp.asarray(x, jnp.float32)
  if x.shape[-1:] != (cols,):
    raise JaxvtError(f"qmatmul_multi: x has {x.shape[-1:]} columns, the weights {cols}")
  lead = x.shape[:-1]
  acts = (tuple(_act_bytes(w) for w in ws) if numerics.integer_products(mode) else None)
  fused, separate = _multi_call(tuple(w.meta.rows for w in ws), cols, acts)
  bufs = [b for w in ws for b in (w.data, w.table, w.fmts)]
  args = (x.reshape(-1, cols), _layer(layer), *bufs)
  if _ffi.available("cpu"):
    ys = jax.lax.platform_dependent(*args, cpu=separate, default=fused)
  else:
    ys = fused(*args)
  return [y.reshape(*lead, w.meta.rows) for y, w in zip(ys, ws)]


def _layer_bytes(w: QWeight, layer: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(raw uint8 [stride'] of the layer's device slot, format index into meta.formats, is_host)."""
  m = w.meta
  l = jnp.clip(layer, 0, m.n_layers - 1)
  f = w.fmts[l]
  slot = w.table[l, 0].astype(jnp.int32)
  raw = jax.lax.dynamic_index_in_dim(w.data, jnp.where((f & HOST_BIT) != 0, 0, slot), 0,
                                     keepdims=False)
  need = max(max(m.experts, 1) * m.rows * _row_bytes(t, m.cols) for t in m.formats)
  if raw.shape[0] < need:  # every layer in the host tier: data is a [1, 1] placeholder
    raw = jnp.pad(raw, (0, need - raw.shape[0]))
  fmt = f & FMT_MASK
  index = sum(jnp.where(fmt == t, i, 0) for i, t in enumerate(m.formats))
  return raw, jnp.asarray(index, jnp.int32), (f & HOST_BIT) != 0


def _switch_formats(w: QWeight, layer, fn):
  """fn(raw uint8 [E*rows, row_bytes], fmt) per format of the stack, chosen by the layer's."""
  m = w.meta
  raw, index, is_host = _layer_bytes(w, _layer(layer))

  def branch(fmt):
    rb = _row_bytes(fmt, m.cols)
    return lambda r: fn(r[:max(m.experts, 1) * m.rows * rb].reshape(-1, rb), fmt)

  out = jax.lax.switch(index, [branch(f) for f in m.formats], raw)
  return jnp.where(is_host, jnp.nan, out)


def qmatmul_ref(x: jax.Array, w: QWeight, layer, mode: str = "ggml") -> jax.Array:
  """Reference for qmatmul (jaxvt.ffi.numerics.qdot on the device-tier layer)."""
  _check(w, "qmatmul_ref", experts=False)
  m = w.meta
  x = jnp.asarray(x, jnp.float32)
  mode = _mode(mode)
  return _switch_formats(w, layer, lambda r, f: numerics.qdot(x, r, f, m.cols, mode))


# ---------------------------------------------------------------------------------------------
# experts


@functools.cache
def _experts_call(rows: int, cols: int, experts: int, act_bytes: int, cslot: int | None = None,
                  swiglu: bool = False):
  """cslot None: the plain call (operands end with the ring, if any); else the expert cache's
  (where, ctab, then the ring), a slot of `cslot` bytes. swiglu: the operands start with the
  gate and up rows (ggml's arithmetic)."""
  plain, q8 = (("jaxvt_qmatmul_experts", "jaxvt_qmatmul_experts_q8") if cslot is None else
               ("jaxvt_qmatmul_experts_cached", "jaxvt_qmatmul_experts_cached_q8"))
  if swiglu:
    q8 = "jaxvt_swiglu_experts_q8" if cslot is None else "jaxvt_swiglu_experts_cached_q8"
  nx = 2 if swiglu else 1

  def call(*args):  # x (and u), data, table, fmts, layer, ids, [where, ctab,] () or a ring
    x, ids = args[0], args[nx + 4]
    out = jax.ShapeDtypeStruct((*ids.shape, rows), jnp.float32)
    attrs = dict(rows=np.int64(rows), cols=np.int64(cols), experts=np.int64(experts))
    if cslot is not None:
      attrs["cslot"] = np.int64(cslot)
    if act_bytes == 0:
      return jax.ffi.ffi_call(plain, out)(*args, **attrs)
    scratch = jax.ShapeDtypeStruct((x.size // cols, act_bytes), jnp.uint8)
    return jax.ffi.ffi_call(q8, (out, scratch))(*args, **attrs)[0]

  return _vmappable(call, lambda *a: None)


def qmatmul_experts(x: jax.Array, w: QWeight, layer, ids: jax.Array,
                    mode: str = "ggml", ring: jax.Array | None = None,
                    cache: tuple | None = None, up: jax.Array | None = None) -> jax.Array:
  """x f32 [T, cols] or [T, k, cols], ids int32 [T, k] -> f32 [T, k, rows].

  out[t, j] = W[layer, ids[t, j]] @ (x[t] or x[t, j]); only routed experts' bytes are read, each
  distinct routed expert once per call (per 16 slots on GPU). Ids above range are clamped into
  it; a negative id routes its slot nowhere: out[t, j] = 0 and nothing is read for it (a sharded
  MoE marks the slots of other devices' experts so). ring: a decode expert ring
  (prefetch.fetch_experts): the experts it holds for `layer` are read from it (the same bytes).
  cache: (where int32 [T, k], ctab, cslot), the expert cache's decisions for this call and the
  stack's table (jaxvt.ffi.expert_cache): hits are read from the cache, fills written to it
  (the same bytes). up (integer products): the products of swiglu(x, up), x the gate, formed by
  the kernels as they read x (as qmatmul's up=).
  """
  _check(w, "qmatmul_experts", experts=True)
  m = w.meta
  x = jnp.asarray(x, jnp.float32)
  ids = _ids(ids)
  _check_x_ids(x, ids, m.cols, "qmatmul_experts")
  act = _act_bytes(w) if numerics.integer_products(_mode(mode)) else 0
  extra = () if cache is None else (cache[0].reshape(ids.shape), cache[1])
  xs = (x,)
  if up is not None:
    _swiglu_mode(mode, x, up, "qmatmul_experts")
    xs = (x, jnp.asarray(up, jnp.float32))
  return _experts_call(m.rows, m.cols, m.experts, act, None if cache is None else cache[2],
                       up is not None)(
      *xs, w.data, w.table, w.fmts, _layer(layer), ids, *extra, *_rings(ring))


def _rings(*rings) -> tuple:  # an experts call's ring operands: none, or every one given
  return () if any(r is None for r in rings) else rings


@functools.cache
def _experts2_call(rows: int, cols: int, experts: int, acts: tuple[int, int] | None,
                   cslots: tuple[int, int] | None = None):
  """(fused GPU call, separate calls); acts: the two stacks' activation scratch bytes under
  ggml's arithmetic (None: float32); cslots: the expert cache's slot bytes of the two stacks
  (None: no cache; else the operands after ids are where, ctab0, ctab1, then the rings)."""
  def fused(x, d0, t0, f0, d1, t1, f1, layer, ids, *rest):
    out = jax.ShapeDtypeStruct((*ids.shape, rows), jnp.float32)
    attrs = dict(rows=np.int64(rows), cols=np.int64(cols), experts=np.int64(experts),
                 ggml=np.int64(acts is not None))
    name = "jaxvt_qmatmul_experts2"
    if cslots is not None:
      name = "jaxvt_qmatmul_experts2_cached"
      attrs.update(cslot0=np.int64(cslots[0]), cslot1=np.int64(cslots[1]))
    return jax.ffi.ffi_call(name, (out, out))(x, d0, t0, f0, d1, t1, f1, layer, ids, *rest,
                                              **attrs)

  def separate(x, d0, t0, f0, d1, t1, f1, layer, ids, *rest):
    a0, a1 = acts if acts is not None else (0, 0)
    c0 = c1 = None
    if cslots is not None:
      (where, ct0, ct1), rest = rest[:3], rest[3:]
      c0, c1 = cslots
    r0, r1 = (rest[:1], rest[1:]) if rest else ((), ())
    e0 = () if cslots is None else (where, ct0)
    e1 = () if cslots is None else (where, ct1)
    return (_experts_call(rows, cols, experts, a0, c0)(x, d0, t0, f0, layer, ids, *e0, *r0),
            _experts_call(rows, cols, experts, a1, c1)(x, d1, t1, f1, layer, ids, *e1, *r1))

  return fused, separate


def qmatmul_experts2(x: jax.Array, w0: QWeight, w1: QWeight, layer, ids: jax.Array,
                     mode: str = "ggml", rings=(None, None),
                     caches=(None, None)) -> tuple[jax.Array, jax.Array]:
  """(qmatmul_experts(x, w0, ...), qmatmul_experts(x, w1, ...)) for two expert stacks of one shape
  (a MoE's gate and up): one launch on a GPU ("f32" or "q8"), with the same bits as two. rings:
  the two stacks' decode expert rings (both or neither); caches: their expert cache operands
  (both or neither, one `where`)."""
  if _mode(mode) == "ggml":  # the CPU's mode: separate calls
    return (qmatmul_experts(x, w0, layer, ids, mode, rings[0], caches[0]),
            qmatmul_experts(x, w1, layer, ids, mode, rings[1], caches[1]))
  _check(w0, "qmatmul_experts2", experts=True)
  _check(w1, "qmatmul_experts2", experts=True)
  if w0.shape != w1.shape:
    raise JaxvtError(f"qmatmul_experts2: stacks of shapes {w0.shape} and {w1.shape} differ")
  m = w0.meta
  x = jnp.asarray(x, jnp.float32)
  ids = _ids(ids)
  _check_x_ids(x, ids, m.cols, "qmatmul_experts2")
  acts = (_act_bytes(w0), _act_bytes(w1)) if numerics.integer_products(mode) else None
  cached = caches[0] is not None
  fused, separate = _experts2_call(m.rows, m.cols, m.experts, acts,
                                   (caches[0][2], caches[1][2]) if cached else None)
  extra = (caches[0][0].reshape(ids.shape), caches[0][1], caches[1][1]) if cached else ()
  args = (x, w0.data, w0.table, w0.fmts, w1.data, w1.table, w1.fmts, _layer(layer), ids, *extra,
          *_rings(*rings))
  if _ffi.available("cpu"):
    return jax.lax.platform_dependent(*args, cpu=separate, default=fused)
  return fused(*args)


def qmatmul_experts_ref(x: jax.Array, w: QWeight, layer, ids: jax.Array,
                        mode: str = "ggml") -> jax.Array:
  """Reference for qmatmul_experts: gathers the routed experts' bytes, numerics.qdot."""
  _check(w, "qmatmul_experts_ref", experts=True)
  m = w.meta
  x = jnp.asarray(x, jnp.float32)
  routed = _ids(ids) >= 0  # negative: routed nowhere, output 0
  ids = jnp.clip(_ids(ids), 0, m.experts - 1)
  mode = _mode(mode)
  xs = x[:, None] if x.ndim == 2 else x  # [T, 1 or k, cols]

  def fn(raw, fmt):
    per_expert = raw.reshape(m.experts, -1)[ids]  # [T, k, rows * row_bytes]
    return numerics.qdot(xs, per_expert.reshape(*ids.shape, m.rows, -1), fmt, m.cols, mode)

  return jnp.where(routed[..., None], _switch_formats(w, layer, fn), 0.0)


def silu_mul(g: jax.Array, u: jax.Array, mode: str = "ggml") -> jax.Array:
  """silu(g) * u: ggml's formula in ggml mode (numerics.swiglu), jax.nn.silu in f32 mode."""
  return numerics.swiglu(g, u) if mode == "ggml" else jax.nn.silu(g) * u  # "q8": float32


def combine(weights, d, ordered: bool = False) -> jax.Array:
  """sum_j weights[..., j] * d[..., j, :]: weights [..., k], d [..., k, cols] -> f32 [..., cols].
  `ordered`: k - 1 elementwise adds in slot order (a token's sum then has one order whatever T
  is; XLA picks a contraction's algorithm by its shapes), else XLA's contraction."""
  weights = jnp.asarray(weights, jnp.float32)
  if not ordered:
    return jnp.einsum("...k,...kd->...d", weights, d)
  y = weights[..., 0, None] * d[..., 0, :]
  for j in range(1, d.shape[-2]):
    y = y + weights[..., j, None] * d[..., j, :]
  return y


def _moe(x, w_gate, w_up, w_down, layer, ids, weights, mm, mode, mm2=None, on_read=None,
         rings=None, cache=None, ordered=False, combined=True, swiglu=False):
  """on_read(stage, out): sees the output of the products that read gate and up ("gate_up", the
  activation h) and of the one that reads down ("down"): prefetch orders a ring's next copy after
  the ring's last reader. rings: decode expert rings of the three stacks; cache: the expert
  cache's operands of the three stacks (expert_cache.CacheTables.operands; kernels only).
  ordered: the k slots added in slot order (combine). combined=False: the k slots' outputs
  [T, k, cols], unweighted and unsummed. swiglu: down's product forms silu(g) * u itself (mm's
  up=; on_read then sees g)."""
  x = jnp.asarray(x, jnp.float32)

  def kw(k):  # only mm that take them
    return {**({"ring": rings.get(k)} if rings else {}),
            **({"cache": cache[k]} if cache else {})}

  if mm2 is None:
    g, u = mm(x, w_gate, layer, ids, mode, **kw("gate")), mm(x, w_up, layer, ids, mode, **kw("up"))
  else:
    g, u = mm2(x, w_gate, w_up, layer, ids, mode,
               **({"rings": (rings.get("gate"), rings.get("up"))} if rings else {}),
               **({"caches": (cache["gate"], cache["up"])} if cache else {}))
  if swiglu:
    h, down_kw = g, {"up": u, **kw("down")}
  else:
    h, down_kw = silu_mul(g, u, mode), kw("down")  # [T, k, ffn]
  if on_read is not None:
    on_read("gate_up", h)
  d = mm(h, w_down, layer, ids, mode, **down_kw)  # [T, k, cols]
  if on_read is not None:
    on_read("down", d)
  return combine(weights, d, ordered) if combined else d


def moe_experts(x, w_gate: QWeight, w_up: QWeight, w_down: QWeight, layer, ids, weights,
                mode: str = "ggml", on_read=None, rings=None, cache=None, ordered: bool = False,
                combined: bool = True, swiglu: bool = False):
  """x f32 [T, d], ids int32 [T, k], weights f32 [T, k] -> f32 [T, d]: sum over the k routed
  experts of weights * down(silu(gate x) * up x), each routed expert's matrices read once.
  on_read(stage, out): sees the products' outputs, gate/up's then down's (see _moe; for
  jaxvt.model.moe's prefetch). rings: {"gate", "up", "down"} decode expert rings
  (prefetch.fetch_experts): experts they hold for `layer` are read from them, the same bytes.
  cache: {"gate", "up", "down"}: (where, ctab, cslot) each (jaxvt.ffi.expert_cache): the
  expert cache's hits read from it, its fills written to it, the same bytes. ordered: the k
  slots' outputs added in slot order (combine), so a token's sum does not depend on T.
  combined=False: the k slots' outputs f32 [T, k, cols], for the caller to weight and sum
  (jaxvt.ffi.norm.add_norm does, with the residual). swiglu (integer products): the down
  product forms silu(gate x) * up x as it reads them (qmatmul_experts' up=), one step fewer."""
  return _moe(x, w_gate, w_up, w_down, layer, ids, weights, qmatmul_experts, _mode(mode),
              qmatmul_experts2, on_read, rings, cache, ordered, combined, swiglu)


def moe_experts_ref(x, w_gate: QWeight, w_up: QWeight, w_down: QWeight, layer, ids, weights,
                    mode: str = "ggml"):
  """Reference for moe_experts."""
  return _moe(x, w_gate, w_up, w_down, layer, ids, weights, qmatmul_experts_ref, _mode(mode))


# ---------------------------------------------------------------------------------------------
# qembed


@functools.cache
def _embed_call(rows: int, cols: int):
  def call(ids, data, table, fmts, layer):
    out = jax.ShapeDtypeStruct((*ids.shape, cols), jnp.float32)
    return jax.ffi.ffi_call("jaxvt_qembed", out)(
        ids, data, table, fmts, layer, rows=np.int64(rows), cols=np.int64(cols))

  def fast(fn, n, in_batched, ids, *rest):
    return None if any(in_batched[1:]) else fn(ids, *rest)

  return _vmappable(call, fast)


def qembed(ids: jax.Array, w: QWeight, layer=0) -> jax.Array:
  """ids int32 [...] -> f32 [..., cols]: rows of W[layer] (only those rows are read)."""
  _check(w, "qembed", experts=False)
  m = w.meta
  return _embed_call(m.rows, m.cols)(_ids(ids), w.data, w.table, w.fmts, _layer(layer))


def qembed_ref(ids: jax.Array, w: QWeight, layer=0) -> jax.Array:
  """Reference for qembed: gather raw rows, dequantize."""
  _check(w, "qembed_ref", experts=False)
  m = w.meta
  ids = jnp.clip(_ids(ids), 0, m.rows - 1)
  return _switch_formats(w, layer, lambda raw, f: dequantize(raw[ids], f, m.cols))


# ---------------------------------------------------------------------------------------------
# qdequant


@functools.cache
def _dequant_call(rows: int, cols: int, experts: int):
  shape = (experts, rows, cols) if experts else (rows, cols)

  def call(data, table, fmts, layer):
    out = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    return jax.ffi.ffi_call("jaxvt_qdequant", out)(
        data, table, fmts, layer, rows=np.int64(rows), cols=np.int64(cols),
        experts=np.int64(experts))

  return _vmappable(call, lambda *a: None)


def qdequant(w: QWeight, layer) -> jax.Array:
  """W[layer] as bf16 [rows, cols] ([E, rows, cols] for experts): staging for large batches."""
  _check(w, "qdequant")
  m = w.meta
  return _dequant_call(m.rows, m.cols, m.experts)(w.data, w.table, w.fmts, _layer(layer))


def qdequant_ref(w: QWeight, layer) -> jax.Array:
  """Reference for qdequant."""
  _check(w, "qdequant_ref")
  m = w.meta
  return _switch_formats(
      w, layer, lambda raw, f: dequantize(raw, f, m.cols).reshape(w.shape)).astype(jnp.bfloat16)
