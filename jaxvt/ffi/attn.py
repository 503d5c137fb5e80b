"""The fused attention decode step: one custom call (`jaxvt_attn_step`, csrc/common/attn.h) for
everything between an attention layer's q/k/v projections and its output projection at t == 1,
on whole cache stacks: it reads layer `layer` of the norm stacks and writes the new keys and
values into layer `layer` of the cache stacks in place (the stacks are aliased to the results:
no slice or update-slice around it).

  attn_step(q [b, H*2D] (gated: per head [q | gate]) or [b, H*D], k [b, K*D], v [b, K*Dv],
            q_norm [An, D], k_norm [An, D] (or None without qk_norm), k_cache [A, b, S, K, D],
            v_cache [A, b, S, K, Dv], layer, positions [b], kv_len=, theta=, rope_dim=,
            interleaved=, eps=, gate=, qk_norm=, split=None)
    -> (o [b, H*Dv] float32, k_cache [A, ...], v_cache [A, ...])

`layer` is an int32 scalar (traced: a scan's layer index), clamped into each stack. Row r writes
its new key / value at positions[r] (a position >= S is dropped, as the jnp path's scatter drops
it) and attends to the cached positions s < kv_len with s <= positions[r]; o is already
multiplied by sigmoid(gate) when gated. H, K, D, Dv come from the operands (a device of a mesh
passes its own heads). The positions are summed in splits of `split` positions (None:
chunk(kv_len)); a row's result depends on kv_len only through the split's size, since the combine
reads only the splits that hold the row's visible positions (csrc/common/attn.h): a fixed `split`
makes it depend on the row's own positions alone. float32 throughout, each sum in a fixed order:
deterministic, and within float32 rounding of the reference. The caches must be float32 stacks
(what the engine makes outside ggml numerics) to be updated in place; others are converted, then
copied back (the documented fallback: correct, not in place).

The jnp reference is jaxvt.model.layers.attn_step_ref: it is made of the model's own functions
(rms_norm, rope and the attention of layers.attention), and jaxvt.model sits above this package
(tests/test_layering.py), so it lives there; tests/test_attn_step.py compares them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi as _ffi
from jaxvt.errors import JaxvtError

_ffi.register()

MAX_DIM = 256    # D and Dv at most (attn.h kMaxDim)
MAX_GROUP = 16   # query heads per kv head at most (attn.h kMaxGroup)
MAX_CHUNK = 256  # positions of one split at most (attn.h kMaxChunk)
TARGET_SPLITS = 128  # b * K * 128 blocks at most below kv_len 32768 (H200: 132 SMs)


def inv_freq(theta: float, rope_dim: int) -> np.ndarray:
  """RoPE's inverse frequencies theta^(-2i / rope_dim), i < rope_dim / 2, as float32: a float64
  power rounded once, so every backend (and the kernel) reads the same constants. The model's
  jnp rope (jaxvt.model.layers.rope) uses them too."""
  half = rope_dim // 2
  return (float(theta) ** (-np.arange(half, dtype=np.float64) * 2.0 / rope_dim)).astype(np.float32)


def chunk(kv_len: int) -> int:
  """Positions of one split: the smallest power of two from 16 with at most TARGET_SPLITS splits
  of kv_len, at most MAX_CHUNK. It depends on the static kv_len alone, so the order of every sum
  does too."""
  c = 16
  while c < MAX_CHUNK and -(-kv_len // c) > TARGET_SPLITS:
    c *= 2
  return c


def attn_step(q, k, v, q_norm, k_norm, k_cache, v_cache, layer, positions, *, kv_len: int,
              theta: float, rope_dim: int, interleaved: bool, eps: float, gate: bool,
              qk_norm: bool, split: int | None = None):
  """One attention decode step on layer `layer` of the stacks (the module docstring has the
  shapes); `split`: positions of one split (None: chunk(kv_len); at most MAX_CHUNK). Returns
  (o, k_cache stack, v_cache stack)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  q, k, v = f32(q), f32(k), f32(v)
  kc_dtype, vc_dtype = jnp.asarray(k_cache).dtype, jnp.asarray(v_cache).dtype
  k_cache, v_cache = f32(k_cache), f32(v_cache)
  positions = jnp.asarray(positions).astype(jnp.int32)
  layer = jnp.asarray(layer).astype(jnp.int32)
  if q.ndim != 2 or k_cache.ndim != 5 or v_cache.ndim != 5:
    raise JaxvtError(f"attn_step: q {q.shape} must be [b, H*D], k_cache {k_cache.shape} "
                     f"[A, b, S, K, D], v_cache {v_cache.shape} [A, b, S, K, Dv]")
  A, b, S, K, D = k_cache.shape
  Dv = v_cache.shape[-1]
  if qk_norm:
    q_norm, k_norm = f32(q_norm), f32(k_norm)
  else:  # not read
    q_norm = k_norm = jnp.ones((1, D), jnp.float32)
  per = (2 if gate else 1) * D
  H = q.shape[1] // per
  if (q.shape != (b, H * per) or H < 1 or H % K or H // K > MAX_GROUP or max(D, Dv) > MAX_DIM
      or k.shape != (b, K * D) or v.shape != (b, K * Dv) or v_cache.shape != (A, b, S, K, Dv)
      or q_norm.ndim != 2 or q_norm.shape[1] != D or k_norm.shape != q_norm.shape
      or positions.shape != (b,) or layer.shape != () or (gate and D != Dv)
      or rope_dim % 2 or not 0 <= rope_dim <= D or not 1 <= kv_len <= S
      or (split is not None and not 1 <= split <= MAX_CHUNK)):
    raise JaxvtError(
        f"attn_step: shapes do not fit one another (q {q.shape}, k {k.shape}, v {v.shape}, "
        f"k_cache {k_cache.shape}, v_cache {v_cache.shape}, q_norm {q_norm.shape}, k_norm "
        f"{k_norm.shape}, positions {positions.shape}, layer {layer.shape}, gate {gate}, "
        f"rope_dim {rope_dim}, kv_len {kv_len}, split {split}; D, Dv at most {MAX_DIM}, at most "
        f"{MAX_GROUP} query heads per kv head, a chunk of 1..{MAX_CHUNK} positions)")
  c = chunk(kv_len) if split is None else int(split)
  splits = -(-kv_len // c)
  G = H // K
  inv = jnp.asarray(inv_freq(theta, rope_dim) if rope_dim >= 2 else np.ones(1, np.float32))
  out = (jax.ShapeDtypeStruct((b, H * Dv), jnp.float32),
         jax.ShapeDtypeStruct(k_cache.shape, jnp.float32),
         jax.ShapeDtypeStruct(v_cache.shape, jnp.float32),
         jax.ShapeDtypeStruct((b * K * splits * G * (Dv + 2),), jnp.float32))  # the partials
  # Both stacks are updated in place (layer `layer`, each row's position only): the block that
  # writes a position is the only one that reads it (csrc/common/attn.h).
  call = jax.ffi.ffi_call("jaxvt_attn_step", out, input_output_aliases={6: 1, 7: 2},
                          vmap_method="sequential")
  o, k_cache, v_cache, _ = call(
      q, k, v, q_norm, k_norm, inv, k_cache, v_cache, layer, positions, kv_len=np.int64(kv_len),
      rope_dim=np.int64(rope_dim), chunk=np.int64(c), gate=bool(gate), qk_norm=bool(qk_norm),
      interleaved=bool(interleaved), eps=np.float32(eps),
      scale=np.float32(D ** -0.5))
  return o, k_cache.astype(kc_dtype), v_cache.astype(vc_dtype)
