"""Shared building blocks: linear over quantized weights, RMSNorm, RoPE, attention, SwiGLU.

Letters in einsum strings: b batch, t query tokens, s cached positions, h query heads,
k kv heads, g query heads per kv head, d head dim, m model dim.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.ffi import attn as attn_ffi  # importing registers the custom calls
from jaxvt.ffi import ops
from jaxvt.ffi.backend import KERNELS, REFERENCE
from jaxvt.ffi.tuning import Products
from jaxvt.model.config import ModelConfig
from jaxvt.model.axes import AXES, TP
from jaxvt.qweight import QWeight


NUMERICS = ("ggml", "llamacpp", "f32", "q8")
# The query-token count whose attention recipe every row takes under "ggml" numerics, whatever
# its call holds: llama.cpp's batched products (tinyBLAS order), which its prompts take, so the
# prompt logits stay llama.cpp's bit for bit (docs/NUMERICS.md).
ATTN_RECIPE_ROWS = 2


@dataclasses.dataclass(frozen=True)
class Exec:
  """How to execute: static, hashable, passed beside the ModelConfig.

  kernels: run matrices (and, on CPU, the ggml-exact norm / RoPE / attention / SwiGLU steps)
    through jaxvt.ffi's custom calls (required for host-tier weights); False runs the jnp
    references, which read device-tier weights only.
  numerics: the arithmetic contract (jaxvt.ffi.numerics, docs/NUMERICS.md). "ggml" (default):
    llama.cpp's CPU arithmetic: activations quantized to each weight format's vec-dot type and
    dotted in integers; RMSNorm, RoPE, softmax and SwiGLU rounded as ggml rounds them; q and the
    attention probabilities rounded to the KV-cache dtype. With kernels on CPU this reproduces
    llama.cpp's logits bit for bit (Q4_0/Q4_1/Q8_0/F16/F32 weights, f16 or f32 cache). "f32":
    exact dequantization and float32 math throughout (what a float framework computes). "q8":
    the matrix products in ggml's integer arithmetic, every other step as "f32" (the GPU default).
    "llamacpp": "ggml" with llama.cpp's choice of attention recipe by the number of query tokens
    in a call (its batched products for >= 2, its decode products for one), so its prompt
    logits and its decode steps both equal llama.cpp's; a row's bits then depend on how many
    rows its call holds. "ggml" takes llama.cpp's batched recipe for every query row whatever
    the call holds (ATTN_RECIPE_ROWS), so a request's tokens do not depend on how it was
    scheduled (docs/NUMERICS.md).
  par: the jaxvt.model.sharding.Par the forward runs on (a shard_map over its mesh, one device
    being the 1 x 1 mesh): each device computes on its own shards, and `reduce` sums
    row-parallel partial products over the mesh. None: the decoder called directly, outside a
    mesh (on whole weights).
  products: which kernel each matrix product takes, by its rows and bytes, and how host-tier
    layers move (jaxvt.ffi.tuning.Products, the device's row of its TUNING table; with kernels
    only).
  deterministic: compile with XLA's algorithm choices fixed (jaxvt.programs): the same bits in
    every process and for every placement. The model code never reads it; jaxvt's jitted
    programs pick their compiler options from it.
  concurrent: compile with XLA:GPU's concurrent command-buffer scheduling (jaxvt.programs
    CONCURRENT_OPTIONS): kernels with no buffer in common run side by side. Also read by no
    model code.
  schedule: the offload schedule around the MoE block (jaxvt.offload.schedule.ExpertSchedule:
    where host-tier routed experts are read from, what moves ahead of its use), or None. The
    model calls its hooks and carries its state without looking into either.
  """

  kernels: bool = False
  numerics: str = "ggml"
  par: object = None
  products: Products = Products()
  deterministic: bool = True
  concurrent: bool = False
  schedule: object = None

  def __post_init__(self):
    if self.numerics not in NUMERICS:
      raise ValueError(f"Exec.numerics must be one of {', '.join(NUMERICS)}, "
                       f"got {self.numerics!r}")

  @property
  def ggml(self) -> bool:
    """ggml's roundings in the steps between the products ("ggml" and "llamacpp")."""
    return self.numerics in ("ggml", "llamacpp")

  @property
  def mode(self) -> str:
    """The matrix products' arithmetic (jaxvt.ffi.numerics.MODES): "llamacpp" computes
    "ggml"'s."""
    return "ggml" if self.numerics == "llamacpp" else self.numerics

  @property
  def backend(self):
    """The ops the model computes through (jaxvt.ffi.backend): the kernels, or the jnp
    references."""
    return KERNELS if self.kernels else REFERENCE


def linear(x: jax.Array, w: QWeight, layer, ex: Exec) -> jax.Array:
  """x [..., cols] -> float32 [..., rows] with layer `layer` (int32, may be traced) of stack w."""
  w, layer = w.layer_view(layer)
  return ex.backend.matmul(x, w, layer, ex)


def linear_many(x: jax.Array, ws, layer, ex: Exec) -> list[jax.Array]:
  """[linear(x, w, layer, ex) for w in ws] for matrices that share their input: one launch where
  the backend can (the same bits)."""
  ws = list(ws)
  views = [w.layer_view(layer) for w in ws]  # a weight read where it lives returns (w, layer)
  if (any(l is not layer for _, l in views)
      or not ex.backend.shares_input(x, [v for v, _ in views], ex)):
    return [linear(x, w, layer, ex) for w in ws]
  return ex.backend.matmul_many(x, [v for v, _ in views], layer, ex)


def reduce(x: jax.Array, ex: Exec, experts: bool = False) -> jax.Array:
  """Sums the partial products of a row-parallel projection over the mesh: over "tp", or over
  ("ep", "tp") for routed experts (jaxvt.model.sharding); an axis of size 1 holds nothing to
  add, so on one device (or outside a mesh, `ex.par` None) this is the identity."""
  sizes = {} if ex.par is None else dict(ex.par.mesh.shape)
  axes = tuple(a for a in (AXES if experts else (TP,)) if sizes.get(a, 1) > 1)
  return jax.lax.psum(x, axes) if axes else x


def embed(ids: jax.Array, w: QWeight, ex: Exec) -> jax.Array:
  """ids int32 [...] -> float32 [..., cols]: rows of a (quantized) embedding table."""
  return ex.backend.embed(ids, w, ex)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float, ex: Exec | None = None) -> jax.Array:
  """RMSNorm over the last axis in float32; `w` multiplies (GGUF norms already hold any +1).
  With a ggml-numerics `ex`, ggml's rounding (the backend's rms_norm); with another `ex`, the
  backend's factor (rms_scale)."""
  if ex is not None and ex.ggml:
    return ex.backend.rms_norm(x, w, eps, ex)
  x32 = x.astype(jnp.float32)
  if ex is not None:
    y = x32 * ex.backend.rms_scale(x32, eps, ex)
  else:
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y if w is None else y * w


class Terms(NamedTuple):
  """A block's output as the residual add takes it (add_norm): y [..., d]; or with c [..., K],
  y [..., K, d] and the output sum_k c_k y_k (a MoE's routed experts, weighted); with s [..., d]
  and g [...], plus sigmoid(g) * s (its shared expert behind its gate)."""
  y: jax.Array
  c: jax.Array | None = None
  s: jax.Array | None = None
  g: jax.Array | None = None

  def total(self) -> jax.Array:
    """The output itself, in XLA's steps: the slots added in slot order, then the gated term."""
    y = self.y if self.c is None else ops.combine(self.c, self.y, ordered=True)
    return y if self.s is None else y + jax.nn.sigmoid(self.g)[..., None] * self.s


def add_norm(x: jax.Array, terms: Terms, w: jax.Array, li, eps: float, ex: Exec,
             dot: jax.Array | None = None):
  """The residual stream at a block boundary: x' = x + the block's output (`terms`),
  h = rms_norm(x') times layer li of the norm stack w [L, d], and with `dot` (a stack of vectors
  [L, d]) h's dot with layer li's. Returns (x', h, the dot or None). One custom call where the
  backend fuses the step (jaxvt.ffi.norm), else the same math in XLA's steps (`dot` must then
  be None: the caller computes it where XLA does not fuse it into the norm)."""
  if ex.backend.fused("norm", ex):
    x, h, d = ex.backend.add_norm(x, terms.y, w, li, eps, ex, c=terms.c, s=terms.s, g=terms.g,
                                  v=dot)
    return x, h, None if dot is None else d
  if dot is not None:
    raise ValueError("add_norm: a dot is the fused step's; compute it after an unfused norm")
  x = x + terms.total()
  return x, rms_norm(x, w[li], eps, ex), None


def rope(x: jax.Array, positions: jax.Array, theta: float, rope_dim: int,
         interleaved: bool, ex: Exec | None = None) -> jax.Array:
  """Rotary embedding on the first `rope_dim` dims of each head.

  x [b, t, h, d], positions int32 [b, t]. `interleaved` rotates pairs (2i, 2i+1) (llama GGUF,
  whose converter permuted q/k rows); otherwise pairs (i, i + rope_dim/2) (NEOX, Qwen). With a
  ggml-numerics `ex`, ggml_rope_ext's angles and rounding (the backend's rope).
  """
  if ex is not None and ex.ggml:
    return ex.backend.rope(x, positions, rope_dim, theta, not interleaved, ex)
  half = rope_dim // 2
  inv = jnp.asarray(attn_ffi.inv_freq(theta, rope_dim))  # the fused step's constants too
  ang = positions.astype(jnp.float32)[..., None, None] * inv  # [b, t, 1, half]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  xr, rest = x[..., :rope_dim], x[..., rope_dim:]
  if interleaved:
    x1, x2 = xr[..., 0::2], xr[..., 1::2]
    y = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xr.shape)
  else:
    x1, x2 = xr[..., :half], xr[..., half:]
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return jnp.concatenate([y, rest], axis=-1) if rest.shape[-1] else y


def attention(x: jax.Array, w: dict, ai, k_cache: jax.Array, v_cache: jax.Array,
              positions: jax.Array, cfg: ModelConfig, ex: Exec, kv_len: int,
              n_query: jax.Array | None = None):
  """Causal GQA self-attention with a KV cache (llama; qwen3 q/k norm; qwen35 output gate).

  x [b, t, m] (already normed); ai: this layer's index in the attention stacks (traced);
  k_cache/v_cache [n_attn, b, S, k, d]: the whole stacked cache, updated in place at
  [ai, row, positions]; positions int32 [b, t] (absolute). Only the first `kv_len` (static)
  cached positions are read: the caller picks a bucket >= max(positions) + 1. n_query int32 [b]:
  real query tokens per row ("llamacpp" numerics: llama.cpp's products for >= 2 tokens add in
  another order than for one; "ggml" takes one order for every row); None means t.
  Returns (out [b, t, m], k_cache, v_cache).

  Decode (t == 1) under a rule with `attn_fused` (jaxvt.ffi.tuning.Products; the GPUs' row) outside ggml
  numerics runs everything between the projections as one custom call on the stacks
  (jaxvt.ffi.attn.attn_step), and so does each token of a prefill in turn where the rule says
  so (Products.attn_steps; `attn_steps`); otherwise `attend`'s jnp (or ggml) steps.
  """
  b, t, _ = x.shape
  q, k, v = linear_many(x, [w["attn.wq"], w["attn.wk"], w["attn.wv"]], ai, ex)
  params = dict(kv_len=kv_len, theta=cfg.rope_theta, rope_dim=cfg.rope_dim,
                interleaved=cfg.rope_interleaved, eps=cfg.rms_eps, gate=cfg.attn_output_gate,
                qk_norm=cfg.qk_norm)
  if ex.backend.fused("attn", ex, tokens=t) and not ex.ggml:
    norms = (w["attn.q_norm"], w["attn.k_norm"]) if cfg.qk_norm else (None, None)
    with jax.named_scope("attn_step"):
      o, k_cache, v_cache = attn_steps(q, k, v, *norms, k_cache, v_cache, ai, positions,
                                       split=ex.backend.attn_split(ex), **params)
  else:
    norms = (w["attn.q_norm"][ai], w["attn.k_norm"][ai]) if cfg.qk_norm else (None, None)
    o, k_cache, v_cache = attend(q, k, v, *norms, k_cache, v_cache, ai, positions, ex=ex,
                                 n_query=n_query, **params)
  return linear(o, w["attn.wo"], ai, ex), k_cache, v_cache


def attn_steps(q, k, v, q_norm, k_norm, k_cache, v_cache, ai, positions, *, split, **params):
  """The fused decode step (jaxvt.ffi.attn.attn_step) at each of the t tokens in turn, on the
  whole cache stacks: q, k, v [b, t, ...], positions [b, t]. Token i writes its key and value,
  then attends to the positions up to its own, as decode does: a token's arithmetic is the same
  in a prefill of any length, after a prefix hit and in decode, and (with a fixed `split`) for
  any kv_len and beside any other rows. Returns (o [b, t, H*Dv] float32, k_cache, v_cache)."""
  def step(carry, xs):
    kc, vc = carry
    q_t, k_t, v_t, p_t = xs
    o_t, kc, vc = attn_ffi.attn_step(q_t, k_t, v_t, q_norm, k_norm, kc, vc, ai, p_t,
                                     split=split, **params)
    return (kc, vc), o_t

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, positions))
  if q.shape[1] == 1:  # decode: no loop
    (k_cache, v_cache), o = step((k_cache, v_cache), tuple(x[0] for x in xs))
    return o[:, None], k_cache, v_cache
  (k_cache, v_cache), o = jax.lax.scan(step, (k_cache, v_cache), xs)
  return jnp.moveaxis(o, 0, 1), k_cache, v_cache


def attend(q, k, v, q_norm, k_norm, k_cache, v_cache, ai, positions, *, kv_len: int,
           theta: float, rope_dim: int, interleaved: bool, eps: float, gate: bool,
           qk_norm: bool, ex: Exec, n_query=None):
  """attention's steps between the projections: q [b, t, H*2D] (gate: per head [q | gate]) or
  [b, t, H*D], k [b, t, K*D], v [b, t, K*Dv]; q_norm, k_norm [D] (this layer's; None without
  qk_norm); the whole cache stacks, layer ai written at [ai, row, positions] (positions out of
  range dropped) and read up to kv_len. Sizes come from the operands. Returns (o [b, t, H*Dv]
  float32, times sigmoid(gate) when gated; k_cache, v_cache)."""
  b, t = q.shape[:2]
  K, D = k_cache.shape[-2:]
  Dv = v_cache.shape[-1]
  H = q.shape[-1] // ((2 if gate else 1) * D)
  if gate:  # per head [q | gate]
    q = q.reshape(b, t, H, 2 * D)
    q, gate_x = q[..., :D], q[..., D:].reshape(b, t, H * D)
  else:
    q, gate_x = q.reshape(b, t, H, D), None
  k = k.reshape(b, t, K, D)
  v = v.reshape(b, t, K, Dv)
  if qk_norm:
    q = rms_norm(q, q_norm, eps, ex)
    k = rms_norm(k, k_norm, eps, ex)
  q = rope(q, positions, theta, rope_dim, interleaved, ex)
  k = rope(k, positions, theta, rope_dim, interleaved, ex)

  # Write the new keys/values at their positions (out-of-range positions are dropped).
  bidx = jnp.arange(b)[:, None]
  k_cache = k_cache.at[ai, bidx, positions].set(k.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[ai, bidx, positions].set(v.astype(v_cache.dtype), mode="drop")

  if ex.ggml:
    # the real query tokens of each row: the kernel leaves the padding queries after them
    # uncomputed, and under "llamacpp" picks llama.cpp's recipe by their count
    nq = jnp.full((b,), t, jnp.int32) if n_query is None else n_query
    if ex.numerics != "llamacpp":
      # one recipe for every row however many share the call: never fewer than ATTN_RECIPE_ROWS
      # as the kernel counts them (a 1-token call's one padding query is computed, never read)
      nq = jnp.maximum(nq, ATTN_RECIPE_ROWS)
    scale = float(np.float32(1) / np.sqrt(np.float32(D)))  # llama.cpp: 1.0f/sqrtf(head_dim)
    o = ex.backend.attention(q, k_cache, v_cache, ai, positions, nq, kv_len, scale,
                             ex).reshape(b, t, H * Dv)
  else:
    zero = jnp.zeros((), jnp.int32)
    ks = jax.lax.dynamic_slice(k_cache, (ai, zero, zero, zero, zero), (1, b, kv_len, K, D))[0]
    vs = jax.lax.dynamic_slice(v_cache, (ai, zero, zero, zero, zero), (1, b, kv_len, K, Dv))[0]
    ks, vs = ks.astype(jnp.float32), vs.astype(jnp.float32)
    qg = q.reshape(b, t, K, H // K, D) * (D ** -0.5)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, ks)
    visible = jnp.arange(kv_len)[None, None, :] <= positions[:, :, None]  # [b, t, s]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, vs).reshape(b, t, H * Dv)
  if gate_x is not None:
    o = o * jax.nn.sigmoid(gate_x)
  return o, k_cache, v_cache


def attn_step_ref(q, k, v, q_norm, k_norm, k_cache, v_cache, layer, positions, *, kv_len: int,
                  theta: float, rope_dim: int, interleaved: bool, eps: float, gate: bool,
                  qk_norm: bool):
  """The jnp reference of jaxvt.ffi.attn.attn_step (its t == 1 shapes: no token axis; whole
  stacks and the layer index, clamped into each stack): `attend` at one token on layer `layer`
  in float32 numerics."""
  one = lambda x: jnp.asarray(x, jnp.float32)[:, None]
  k_cache, v_cache = jnp.asarray(k_cache), jnp.asarray(v_cache)
  layer = jnp.asarray(layer, jnp.int32)
  ai = jnp.clip(layer, 0, k_cache.shape[0] - 1)
  if qk_norm:
    n = jnp.clip(layer, 0, jnp.shape(q_norm)[0] - 1)
    q_norm, k_norm = jnp.asarray(q_norm)[n], jnp.asarray(k_norm)[n]
  o, k_cache, v_cache = attend(
      one(q), one(k), one(v), q_norm, k_norm, k_cache, v_cache, ai,
      jnp.asarray(positions, jnp.int32)[:, None], kv_len=kv_len, theta=theta, rope_dim=rope_dim,
      interleaved=interleaved, eps=eps, gate=gate, qk_norm=qk_norm, ex=Exec(numerics="f32"))
  return o[:, 0], k_cache, v_cache


def swiglu(x: jax.Array, w_gate: QWeight, w_up: QWeight, w_down: QWeight, li,
           ex: Exec) -> jax.Array:
  """Dense SwiGLU FFN: down(silu(gate x) * up x)."""
  g, u = linear_many(x, [w_gate, w_up], li, ex)
  return swiglu_down(g, u, w_down, li, ex)


def swiglu_down(g: jax.Array, u: jax.Array, w_down: QWeight, li, ex: Exec) -> jax.Array:
  """The second half of swiglu: down(silu(g) * u) from the gate and up products (one launch
  where the backend fuses them)."""
  w, layer = w_down.layer_view(li)
  return ex.backend.swiglu_matmul(g, u, w, layer, ex)
