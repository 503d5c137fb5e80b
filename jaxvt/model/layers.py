"""Shared building blocks: linear over quantized weights, RMSNorm, RoPE, attention, SwiGLU.

Letters in einsum strings: b batch, t query tokens, s cached positions, h query heads,
k kv heads, g query heads per kv head, d head dim, m model dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.ffi import attn as attn_ffi, grouped, ops, steps  # importing registers the custom calls
from jaxvt.model.config import ModelConfig
from jaxvt.model.axes import AXES, TP
from jaxvt.qweight import QMeta, QWeight

# Which kernel multiplies a quantized weight by n activation rows on a GPU (prefill). Measured on
# the 35B-shaped model, all in HBM, by tools/prefill_rules.py (warm prefills under each rule in one
# process; H200, docs/BENCHMARKS.md "2026-12-01 night"): with the routed experts on the per-slot
# kernel and integer products, the 16-row program took 24.6 ms with dense layers staged, 30.3 in
# place, 55.4 on the tile kernel; the 64-row one 48.7 staged, 83.5 on the tile kernel, and (dense
# tiled) 82.7 with its 512 routed slots per slot against 98.9 on the grouped kernel.
# dense: stage bf16 (ops.qdequant) + XLA's GEMM from this many rows. The rule does not look at the
# tier: a weight takes the same path, so gives the same bits, from HBM and from the host tier, and
# tokens do not depend on the offload budget.
STAGE_ROWS = 16
STAGE_MAX_BYTES = 512 << 20  # never stage a layer whose bf16 copy is larger (its workspace)
TILED_ROWS = 32  # dense layers too large to stage: the tile kernel (grouped.qmatmul_tiled) from here
# routed experts: the grouped kernel (grouped.moe_grouped) from this many T*k slots; below it the
# per-slot kernel of ops.qmatmul_experts, which reads each slot's expert on its own. In HBM per
# slot won at 128 slots (the 16-row program at top 8: 31.3 against 48.2 ms) and at 512 (82.7
# against 98.9 ms). But the rule cannot look at the tier, and from a host tier the link decides:
# S slots over E experts read S experts per slot against about E (1 - (1 - 1/E)^S) distinct ones
# grouped, 1.3x the bytes at 128 of 256 experts, 2.3x at 512 (an estimate; not measured). So per
# slot up to the 16-row program, grouped from the 64-row one.
GROUPED_SLOTS = 256
# host-tier routed experts copied ahead of their layer (Products.prefetch_per_expert) in calls of at
# least 4 routed slots per expert: there a uniform router picks 1 - (1 - 1/E)^(4E) ~ 98% of a
# layer's experts, so the copy of the whole layer moves the bytes the router picked (nearly all)
# and no others worth counting; it overlaps the layers before it instead of stalling the layer.
# The 35B-shaped model (256 experts, top 8): prompts of 128 tokens or more.
PREFETCH_PER_EXPERT = 4
# decode: the next host-tier layer's likeliest experts copied ahead (Products.predict_after_*):
# the 2 likeliest, after a host-tier layer or a device-tier one, two ring sets, the copy inline
# (a kernel of 8 blocks an expert on XLA's stream, run beside the other work by the concurrent
# command-buffer scheduling, Exec.concurrent). On the H200 (2026-12-03, tools/predict_rate.py,
# 35B-shaped file, 16 GiB card, same tokens every time): every routed expert in the host tier
# 67.2 tok/s without, 71.9-72.6 with; auto 154.1 without, 158.5-159.5 with. The copy on a stream
# of jaxvt's own was slower than none (60.7-63.3 / 123.7-137.6: each fetch broke XLA's command
# buffers); more blocks or more experts were slower too (docs/BENCHMARKS.md "Decode: the next
# layer's experts copied ahead, inline").
# Those counts are for a host-tier layer holding all 3 routed stacks (gate, up, down); a layer
# holding fewer (the planner takes down stacks first) gets proportionally more experts of each,
# copied by fewer blocks (Products.predict_scale: the extension's per-layer rule, prefetch.h
# expert_count): auto's 4.06 GiB as 27 layers' down stacks, 6 experts at 4 blocks 170.2-171.8
# tok/s (8 blocks 167.3; 4, 5, 7 and 8 experts 164.2-171.3), against 160.5 as 9 whole layers
# with 2 (H200, 2026-12-03).
PREDICT_AFTER_HOST = 2
PREDICT_AFTER_DEVICE = 2
PREDICT_BLOCKS = 8
PREDICT_SCALE = 3
# prefill: two rings a stack whose host-tier layers include adjacent ones (Products.prefetch_rings):
# H200, 512 tokens, 16 GiB card: every routed expert in the host tier 1227 -> 1477 tok/s (3 rings
# 1429); auto's bytes as down stacks 3728 -> 5139 (whole layers, not adjacent: 5068).
PREFETCH_RINGS = 2


@dataclasses.dataclass(frozen=True)
class Products:
  """The per-product kernel rule: how x [n, cols] times one layer of a stack is computed.

  Dense matrices: "matvec" (ops.qmatmul: reads the layer in place once per 4 rows of x under
  integer products, per 16 in float32; CUDA cores), "tiled" (grouped.qmatmul_tiled: once per 32
  rows, tensor cores, bf16 arithmetic) or "staged" (ops.qdequant writes the whole layer as bf16,
  then XLA's GEMM). Routed experts: "matvec" (ops.moe_experts; on a GPU, calls of up to 1023
  slots stream each slot's expert on its own) or "grouped" (grouped.moe_grouped). Each field is
  the row (slot) count from which its path is taken; 0 never takes it. Products() (every field 0)
  is the CPU's rule: the matvec kernels, which are the CPU's arithmetic contract.
  fused_route: the MoE router's softmax, top k and renormalisation as one custom call
  (ops.moe_route) instead of its jnp reference's XLA kernels (the same ids, weights to float32
  rounding); the CPU's rule keeps the reference, whose arithmetic the llama.cpp checks match.

  gdn_fused: a DeltaNet layer's decode step (t == 1) runs everything between its projections as
  one custom call (jaxvt.ffi.gdn.gdn_step) instead of about a dozen small XLA kernels; float32
  like the jnp path, summed in another order. False on the CPU, whose jnp path is matched
  against llama.cpp.

  attn_fused: an attention layer's decode step (t == 1) outside ggml numerics runs everything
  between its q/k/v projections and its output projection (q/k RMSNorm, RoPE, the cache write,
  the attention and the output gate) as one custom call (jaxvt.ffi.attn.attn_step) on the whole
  cache stacks instead of about 25 small XLA kernels; float32 like the jnp path, summed in
  another order. False on the CPU (its ggml path is matched against llama.cpp).

  prefetch_per_expert: from this many routed slots per expert (T*k >= this * E) a call copies
  each host-tier layer of the routed experts' stacks to the device ahead of its turn, while the
  layers before it compute (jaxvt.ffi.prefetch: a ring per stack in the program's workspace, the
  copy on a stream of jaxvt's own); the layer's kernels then read the copy, with the same bytes.
  0 never (the CPU: its ops run one after another, nothing to overlap). prefetch_rings: rings a
  stack whose host-tier layers include adjacent ones takes them in turns (moe.ring_parts: the
  copy of the second then overlaps the first's compute instead of waiting for it), at the cost
  of that many rings of workspace; 1: one ring a stack.

  predict_after_host / predict_after_device: at one token (decode), layer l + 1's router
  applied to layer l's MoE input names most of the experts layer l + 1 will use; where layer
  l + 1 is a host-tier layer, that many of its likeliest experts (at most 8) are copied to the
  device while the layers between compute (after a host-tier layer the bus is busy with that
  layer's own experts: fewer), and its per-slot experts kernels read those from the copy, the
  same bytes (jaxvt.ffi.prefetch.fetch_experts). 0 and 0: never (the CPU). predict_sets: 2
  rings a stack that alternate by layer (the next layer's fetch need not wait for this layer's
  experts; a period of an odd number of layers always has 1), or 1. predict_inline: the copy
  runs on XLA's stream as a kernel XLA may capture in its command buffers (no break a layer;
  under the concurrent scheduling mode it runs beside the work that does not touch the rings)
  with predict_blocks blocks an expert (0: the extension's default), instead of on a stream of
  jaxvt's own. predict_scale > 0: the counts are for a target layer with that many of the
  routed stacks in the host tier, and one with k of them gets count * predict_scale / k (at
  most 8), each copied by proportionally fewer blocks (at least 4): about the same bytes a
  layer, decided per layer on the device (prefetch.h expert_count); 0: the counts as given.
  """

  tiled_rows: int = 0
  stage_rows: int = 0
  stage_max_bytes: int = 0  # 0: no limit
  grouped_slots: int = 0
  fused_route: bool = False
  gdn_fused: bool = False
  attn_fused: bool = False
  prefetch_per_expert: int = 0
  prefetch_rings: int = 1
  predict_after_host: int = 0
  predict_after_device: int = 0
  predict_sets: int = 2
  predict_inline: bool = False
  predict_blocks: int = 0
  predict_scale: int = 0

  def predicted_ids(self) -> int:
    """How many of the next layer's likeliest experts a decode fetch is given: the most any
    target layer can copy."""
    n = max(self.predict_after_host, self.predict_after_device)
    return min(8, n * max(1, self.predict_scale))

  def dense(self, n: int, meta: QMeta) -> str:
    """The path for x of n rows times a layer of the (non-expert) stack described by meta."""
    stage = self.stage_rows
    staged_bytes = 2 * meta.rows * meta.cols * max(meta.experts, 1)
    if stage and n >= stage and not (self.stage_max_bytes and staged_bytes > self.stage_max_bytes):
      return "staged"
    if self.tiled_rows and n >= self.tiled_rows:
      return "tiled"
    return "matvec"

  def experts(self, slots: int) -> str:
    """The path for the routed experts of T*k = `slots` slots."""
    return "grouped" if self.grouped_slots and slots >= self.grouped_slots else "matvec"


# What jaxvt.load runs on a GPU: dense products of 16 rows or more staged (bf16 + XLA's GEMM), or
# on the tile kernel from 32 rows where a layer's bf16 copy is too large; routed experts of 256
# slots or more on the grouped kernel, fewer on the per-slot kernel; the MoE router as one custom
# call, DeltaNet and attention decode steps fused (gdn_fused, attn_fused), prefill's host-tier
# copies in two rings where layers are adjacent, decode's predicted copies sized by the stacks
# each host-tier layer holds (predict_scale). (Their GPU tests first
# failed on the H200 on 2026-12-01 because the jnp references lost their bf16 rounding to
# XLA:GPU's excess precision, not the kernels: numerics.round_to.)
GPU_PRODUCTS = Products(tiled_rows=TILED_ROWS, stage_rows=STAGE_ROWS, stage_max_bytes=STAGE_MAX_BYTES,
                        grouped_slots=GROUPED_SLOTS, fused_route=True, gdn_fused=True,
                        attn_fused=True, prefetch_per_expert=PREFETCH_PER_EXPERT,
                        prefetch_rings=PREFETCH_RINGS,
                        predict_after_host=PREDICT_AFTER_HOST,
                        predict_after_device=PREDICT_AFTER_DEVICE, predict_inline=True,
                        predict_blocks=PREDICT_BLOCKS, predict_scale=PREDICT_SCALE)


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
  par: the jaxvt.model.sharding.Par the forward runs on (a shard_map over its mesh, one device
    being the 1 x 1 mesh): each device computes on its own shards, and `reduce` sums
    row-parallel partial products over the mesh. None: the decoder called directly, outside a
    mesh (on whole weights).
  products: which kernel each matrix product takes, by its rows and bytes (Products; with
    kernels only). Products() on the CPU (the matvec kernels are the arithmetic contract);
    GPU_PRODUCTS on GPUs, where prefill's products of many rows take the tile kernels (bf16 on
    tensor cores) or stage the layer as bf16 for XLA's GEMM.
  deterministic: compile with XLA's algorithm choices fixed (jaxvt.programs): the same bits in
    every process and for every placement. The model code never reads it; jaxvt's jitted
    programs pick their compiler options from it.
  concurrent: compile with XLA:GPU's concurrent command-buffer scheduling (jaxvt.programs
    CONCURRENT_OPTIONS): kernels with no buffer in common run side by side. Also read by no
    model code.
  """

  kernels: bool = False
  numerics: str = "ggml"
  par: object = None
  products: Products = Products()
  deterministic: bool = True
  concurrent: bool = False

  def __post_init__(self):
    if self.numerics not in ("ggml", "f32", "q8"):
      raise ValueError(f"Exec.numerics must be 'ggml', 'f32' or 'q8', got {self.numerics!r}")

  @property
  def ggml(self) -> bool:
    return self.numerics == "ggml"


def linear(x: jax.Array, w: QWeight, layer, ex: Exec) -> jax.Array:
  """x [..., cols] -> float32 [..., rows] with layer `layer` (int32, may be traced) of stack w."""
  w, layer = w.layer_view(layer)
  if not ex.kernels:
    return ops.qmatmul_ref(x.astype(jnp.float32), w, layer, ex.numerics)
  path = ex.products.dense(x.size // x.shape[-1], w.meta)
  if path == "staged":
    return jnp.dot(x.astype(jnp.bfloat16), ops.qdequant(w, layer).T,
                   preferred_element_type=jnp.float32)
  if path == "tiled":
    return grouped.qmatmul_tiled(x, w, layer)
  return ops.qmatmul(x.astype(jnp.float32), w, layer, ex.numerics)


def linear_many(x: jax.Array, ws, layer, ex: Exec) -> list[jax.Array]:
  """[linear(x, w, layer, ex) for w in ws] for matrices that share their input: where every one
  takes the matvec kernels, one launch on a GPU (ops.qmatmul_multi; the same bits)."""
  ws = list(ws)
  rows = x.size // x.shape[-1]
  views = [w.layer_view(layer) for w in ws]  # a weight read where it lives returns (w, layer)
  if (not ex.kernels or any(l is not layer for _, l in views)
      or any(ex.products.dense(rows, w.meta) != "matvec" for w in ws)):
    return [linear(x, w, layer, ex) for w in ws]
  return ops.qmatmul_multi(x.astype(jnp.float32), [v for v, _ in views], layer, ex.numerics)


def reduce(x: jax.Array, ex: Exec, experts: bool = False) -> jax.Array:
  """Sums the partial products of a row-parallel projection over the mesh: over "tp", or over
  ("ep", "tp") for routed experts (jaxvt.model.sharding); an axis of size 1 holds nothing to
  add, so on one device (or outside a mesh, `ex.par` None) this is the identity."""
  sizes = {} if ex.par is None else dict(ex.par.mesh.shape)
  axes = tuple(a for a in (AXES if experts else (TP,)) if sizes.get(a, 1) > 1)
  return jax.lax.psum(x, axes) if axes else x


def embed(ids: jax.Array, w: QWeight, ex: Exec) -> jax.Array:
  """ids int32 [...] -> float32 [..., cols]: rows of a (quantized) embedding table."""
  fn = ops.qembed if ex.kernels else ops.qembed_ref
  return fn(ids, w, jnp.int32(0))


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float, ex: Exec | None = None) -> jax.Array:
  """RMSNorm over the last axis in float32; `w` multiplies (GGUF norms already hold any +1).
  With a ggml-numerics `ex`, ggml's rounding (jaxvt.ffi.steps.rms_norm)."""
  if ex is not None and ex.ggml:
    return steps.rms_norm(x, w, eps, kernels=ex.kernels)
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y if w is None else y * w


def rope(x: jax.Array, positions: jax.Array, theta: float, rope_dim: int,
         interleaved: bool, ex: Exec | None = None) -> jax.Array:
  """Rotary embedding on the first `rope_dim` dims of each head.

  x [b, t, h, d], positions int32 [b, t]. `interleaved` rotates pairs (2i, 2i+1) (llama GGUF,
  whose converter permuted q/k rows); otherwise pairs (i, i + rope_dim/2) (NEOX, Qwen). With a
  ggml-numerics `ex`, ggml_rope_ext's angles and rounding (jaxvt.ffi.steps.rope).
  """
  if ex is not None and ex.ggml:
    return steps.rope(x, positions, rope_dim, theta, neox=not interleaved, kernels=ex.kernels)
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
  real query tokens per row (ggml numerics: llama.cpp's products for >= 2 tokens add in another
  order than for one); None means t.
  Returns (out [b, t, m], k_cache, v_cache).

  Decode (t == 1) under a rule with `attn_fused` (layers.Products; the GPUs') outside ggml
  numerics runs everything between the projections as one custom call on the stacks
  (jaxvt.ffi.attn.attn_step); otherwise `attend`'s jnp (or ggml) steps.
  """
  b, t, _ = x.shape
  q, k, v = linear_many(x, [w["attn.wq"], w["attn.wk"], w["attn.wv"]], ai, ex)
  params = dict(kv_len=kv_len, theta=cfg.rope_theta, rope_dim=cfg.rope_dim,
                interleaved=cfg.rope_interleaved, eps=cfg.rms_eps, gate=cfg.attn_output_gate,
                qk_norm=cfg.qk_norm)
  if t == 1 and ex.kernels and ex.products.attn_fused and not ex.ggml:
    norms = (w["attn.q_norm"], w["attn.k_norm"]) if cfg.qk_norm else (None, None)
    with jax.named_scope("attn_step"):
      o, k_cache, v_cache = attn_ffi.attn_step(q[:, 0], k[:, 0], v[:, 0], *norms, k_cache,
                                               v_cache, ai, positions[:, 0], **params)
    o = o[:, None]
  else:
    norms = (w["attn.q_norm"][ai], w["attn.k_norm"][ai]) if cfg.qk_norm else (None, None)
    o, k_cache, v_cache = attend(q, k, v, *norms, k_cache, v_cache, ai, positions, ex=ex,
                                 n_query=n_query, **params)
  return linear(o, w["attn.wo"], ai, ex), k_cache, v_cache


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
    nq = jnp.full((b,), t, jnp.int32) if n_query is None else n_query
    scale = float(np.float32(1) / np.sqrt(np.float32(D)))  # llama.cpp: 1.0f/sqrtf(head_dim)
    o = steps.attention(q, k_cache, v_cache, ai, positions, nq, kv_len, scale,
                      kernels=ex.kernels).reshape(b, t, H * Dv)
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
  """The second half of swiglu: down(silu(g) * u) from the gate and up products."""
  if ex.ggml:
    h = steps.swiglu(g, u, kernels=ex.kernels)
  else:
    h = jax.nn.silu(g) * u
  return linear(h, w_down, li, ex)
