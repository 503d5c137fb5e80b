"""The decoder shared by every architecture: `forward(weights, cache, tokens, positions, ...)`.

Layer kinds are data (`cfg.layer_types`). The trunk is scanned over *periods*: the shortest
repeating pattern of layer kinds (llama/qwen3: one attention layer; qwen35: three Gated-DeltaNet
layers then one attention layer), so one compiled body serves every period. Weights stay whole
stacks; each block receives its layer's index in its stack as a traced int32 and the kernels pick
the layer on the device (no per-layer slicing or copying of weights).

Block: h = x + mixer(norm(x)); out = h + ffn(norm(h)), the FFN dense SwiGLU or MoE. Each
residual add is computed with the norm after it (layers.add_norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxvt.model import deltanet, layers, moe
from jaxvt.model.config import ModelConfig
from jaxvt.model.layers import Exec
from jaxvt.model.axes import TP


def layer_period(cfg: ModelConfig) -> tuple[str, ...]:
  """The shortest pattern P with layer_types == P * (n_layers / len(P))."""
  lt = cfg.layer_types
  for p in range(1, len(lt) + 1):
    if len(lt) % p == 0 and lt == lt[:p] * (len(lt) // p):
      return lt[:p]
  return lt


def init_cache(cfg: ModelConfig, batch: int, max_len: int, kv_dtype=jnp.float32) -> dict:
  """Decode state: KV cache for attention layers, conv + recurrent state for DeltaNet layers.

  k, v: [n_attn, batch, max_len, n_kv, head_dim]; conv: [n_gdn, batch, kernel-1, conv_dim];
  ssm: [n_gdn, batch, n_v, d_k, d_v] float32.
  """
  na, ng = len(cfg.attention_layers), len(cfg.deltanet_layers)
  cache = {
      "k": jnp.zeros((na, batch, max_len, cfg.n_kv_heads, cfg.head_dim), kv_dtype),
      "v": jnp.zeros((na, batch, max_len, cfg.n_kv_heads, cfg.v_head_dim), kv_dtype),
  }
  if ng:
    cache["conv"] = jnp.zeros((ng, batch, cfg.ssm_conv_kernel - 1, cfg.conv_dim), jnp.float32)
    cache["ssm"] = jnp.zeros((ng, batch, cfg.ssm_v_heads, cfg.ssm_k_dim, cfg.ssm_v_dim),
                             jnp.float32)
  return cache


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, kv_bytes: int = 4) -> int:
  """Bytes of `init_cache(cfg, batch, max_len)` without allocating it."""
  na, ng = len(cfg.attention_layers), len(cfg.deltanet_layers)
  kv = na * batch * max_len * cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim) * kv_bytes
  st = ng * batch * 4 * ((cfg.ssm_conv_kernel - 1) * cfg.conv_dim
                         + cfg.ssm_v_heads * cfg.ssm_k_dim * cfg.ssm_v_dim) if ng else 0
  return kv + st


def _ffn(h: jax.Array, w: dict, li, cfg: ModelConfig, ex: Exec, state, slot: int, valid,
         gate_logit):
  """(the FFN's output as layers.Terms, the offload schedule's state; see moe.moe_block)."""
  if cfg.is_moe:
    return moe.moe_block(h, w, li, cfg, ex, state, slot, valid, gate_logit)
  return layers.Terms(y=layers.reduce(
      layers.swiglu(h, w["ffn.w_gate"], w["ffn.w_up"], w["ffn.w_down"], li, ex), ex)), state


def _no_terms(x: jax.Array, cfg: ModelConfig, ex: Exec) -> layers.Terms:
  """The FFN's terms adding nothing, in their form (the scan's first carry)."""
  return moe.no_terms(x, cfg, ex) if cfg.is_moe else layers.Terms(y=jnp.zeros_like(x))


def forward(weights: dict, cache: dict, tokens: jax.Array, positions: jax.Array,
            cfg: ModelConfig, ex: Exec, kv_len: int, valid: jax.Array | None = None,
            logits_at: jax.Array | None = None):
  """One pass over `tokens` [b, t] at absolute `positions` [b, t] (int32).

  valid [b, t] bool marks real tokens, a prefix of each row (padding of bucketed prefill is
  False: it must not touch recurrent state, attention leaves its queries' output zero, and its
  KV entries lie beyond every real position and are overwritten later).
  logits_at [b] int32: return logits only at that token index of each row ([b, vocab]);
  None returns all positions ([b, t, vocab]). Returns (logits float32, new cache).
  """
  b, t = tokens.shape
  padded = valid  # a prefill's padding routes to no expert (moe.moe_block)
  if valid is None:
    valid = jnp.ones((b, t), bool)
  x = layers.embed(tokens, weights["embed"], ex)
  n_query = jnp.sum(valid, axis=1, dtype=jnp.int32)  # real tokens per row in this call
  period = layer_period(cfg)
  P = len(period)
  n_att = period.count("attention")
  n_gdn = P - n_att
  # the offload schedule (Exec.schedule) may read the weights through views of its own and
  # carries a state of its own through the scan
  w, state = weights, None
  if ex.schedule is not None:
    w, state = ex.schedule.begin(weights, cfg, ex, b * t, P)

  # The residual stream is added at the next norm (layers.add_norm: one custom call where the
  # backend fuses it): the scan carries the last FFN's terms beside x.
  gated = cfg.is_moe and moe.gated_terms(cfg, ex)
  gate_v = w["shexp.gate"] if ex.backend.fused("norm", ex) and gated else None

  def body(carry, p):
    x, terms, cache, state = carry
    cache = dict(cache)
    a_j = g_j = 0
    for j, kind in enumerate(period):
      li = p * P + j
      x, h, _ = layers.add_norm(x, terms, w["attn_norm"], li, cfg.rms_eps, ex)
      with jax.named_scope(kind):
        if kind == "attention":
          ai = p * n_att + a_j
          a_j += 1
          o, cache["k"], cache["v"] = layers.attention(
              h, w, ai, cache["k"], cache["v"], positions, cfg, ex, kv_len, n_query)
        else:
          gi = p * n_gdn + g_j
          g_j += 1
          # the whole state stacks: layer gi is updated (in place on the fused decode path)
          o, cache["conv"], cache["ssm"] = deltanet.deltanet_block(
              h, w, gi, cache["conv"], cache["ssm"], valid, cfg, ex)
      # sharded: o is this device's heads' partial sum
      x, h, gl = layers.add_norm(x, layers.Terms(y=layers.reduce(o, ex)), w["ffn_norm"], li,
                                 cfg.rms_eps, ex, dot=gate_v)
      with jax.named_scope("ffn"):
        terms, state = _ffn(h, w, li, cfg, ex, state, j, padded, gl)
    return (x, terms, cache, state), None

  (x, terms, cache, state), _ = jax.lax.scan(body, (x, _no_terms(x, cfg, ex), cache, state),
                                             jnp.arange(cfg.n_layers // P, dtype=jnp.int32))
  if ex.schedule is not None:
    x = ex.schedule.end(x, state)
  if logits_at is not None:
    at = logits_at.astype(jnp.int32)
    x, terms = jax.tree.map(
        lambda a: jnp.take_along_axis(a, at.reshape(-1, *[1] * (a.ndim - 1)), axis=1)[:, 0],
        (x, terms))
  _, x, _ = layers.add_norm(x, terms, w["final_norm"][None], 0, cfg.rms_eps, ex)
  head = w["lm_head"] if "lm_head" in w else w["embed"]
  logits = layers.linear(x, head, jnp.int32(0), ex)
  if ex.par is not None and ex.par.head_sharded and "lm_head" in w:  # this device's vocab rows
    logits = jax.lax.all_gather(logits, TP, axis=logits.ndim - 1, tiled=True)
  return logits, cache
