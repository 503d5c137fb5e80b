"""Configurations of models without their files: `--plan --model NAME` plans them weightless.

`PRESETS` maps a name to (a description, a function building its ModelConfig).
"""

from __future__ import annotations

from typing import Callable

from jaxvt.model.config import ModelConfig


def qwen36_35b_a3b_config(n_nextn: int = 1) -> ModelConfig:
  """The shape of Qwen3.6-35B-A3B: 40 layers (three Gated-DeltaNet layers, then one attention
  layer, repeated), 256 routed experts of which 8 are used, a shared expert, vocab 248320;
  `n_nextn` MTP blocks after the trunk."""
  return ModelConfig(
      arch="qwen35moe", n_layers=40, d_model=2048, n_heads=16, n_kv_heads=2, head_dim=256,
      v_head_dim=256, ffn_dim=0, vocab_size=248320, rms_eps=1e-6, rope_theta=1e7, rope_dim=64,
      context_length=262144, tied_embeddings=False, rope_interleaved=False, qk_norm=True,
      attn_output_gate=True,
      layer_types=tuple("attention" if (i + 1) % 4 == 0 else "deltanet" for i in range(40)),
      n_experts=256, n_experts_used=8, expert_ffn_dim=512, shared_ffn_dim=512,
      ssm_conv_kernel=4, ssm_k_heads=16, ssm_v_heads=32, ssm_k_dim=128, ssm_v_dim=128,
      n_nextn=n_nextn)


PRESETS: dict[str, tuple[str, Callable[[], ModelConfig]]] = {
    "qwen3.6-35b-a3b": ("a Qwen3.6-35B-A3B-shaped model, Q4_K_S-like formats",
                        lambda: qwen36_35b_a3b_config(n_nextn=0)),
}
