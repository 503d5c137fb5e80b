"""Per-architecture name tables: canonical weight name -> GGUF tensor name.

This is the only place GGUF tensor names appear. `{i}` stands for the block index. Model code,
placement and byte accounting speak canonical names only (see jaxvt.model.declare).
"""

from __future__ import annotations

from jaxvt.errors import JaxvtError

_GLOBAL = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}

_ATTN = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "attn.wq": "blk.{i}.attn_q.weight",
    "attn.wk": "blk.{i}.attn_k.weight",
    "attn.wv": "blk.{i}.attn_v.weight",
    "attn.wo": "blk.{i}.attn_output.weight",
}
_QK_NORM = {
    "attn.q_norm": "blk.{i}.attn_q_norm.weight",
    "attn.k_norm": "blk.{i}.attn_k_norm.weight",
}
_DENSE_FFN = {
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn.w_gate": "blk.{i}.ffn_gate.weight",
    "ffn.w_up": "blk.{i}.ffn_up.weight",
    "ffn.w_down": "blk.{i}.ffn_down.weight",
}
_MOE = {
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "moe.router": "blk.{i}.ffn_gate_inp.weight",
    "moe.w_gate": "blk.{i}.ffn_gate_exps.weight",
    "moe.w_up": "blk.{i}.ffn_up_exps.weight",
    "moe.w_down": "blk.{i}.ffn_down_exps.weight",
}
_SHARED_EXPERT = {
    "shexp.gate": "blk.{i}.ffn_gate_inp_shexp.weight",
    "shexp.w_gate": "blk.{i}.ffn_gate_shexp.weight",
    "shexp.w_up": "blk.{i}.ffn_up_shexp.weight",
    "shexp.w_down": "blk.{i}.ffn_down_shexp.weight",
}
_DELTANET = {
    "gdn.w_qkv": "blk.{i}.attn_qkv.weight",
    "gdn.w_z": "blk.{i}.attn_gate.weight",
    "gdn.w_beta": "blk.{i}.ssm_beta.weight",
    "gdn.w_alpha": "blk.{i}.ssm_alpha.weight",
    "gdn.conv": "blk.{i}.ssm_conv1d.weight",
    "gdn.dt_bias": "blk.{i}.ssm_dt.bias",
    "gdn.a": "blk.{i}.ssm_a",
    "gdn.norm": "blk.{i}.ssm_norm.weight",
    "gdn.w_out": "blk.{i}.ssm_out.weight",
}
# Qwen3.5/Next blocks name the pre-FFN norm post_attention_norm.
_POST_ATTN_NORM = {"ffn_norm": "blk.{i}.post_attention_norm.weight"}

TABLES: dict[str, dict[str, str]] = {
    "llama": {**_GLOBAL, **_ATTN, **_DENSE_FFN},
    "qwen3": {**_GLOBAL, **_ATTN, **_QK_NORM, **_DENSE_FFN},
    "qwen3moe": {**_GLOBAL, **_ATTN, **_QK_NORM, **_MOE},
    "qwen35": {**_GLOBAL, **_ATTN, **_QK_NORM, **_DENSE_FFN, **_DELTANET, **_POST_ATTN_NORM},
    "qwen35moe": {**_GLOBAL, **_ATTN, **_QK_NORM, **_MOE, **_SHARED_EXPERT, **_DELTANET,
                  **_POST_ATTN_NORM},
}


def gguf_name(arch: str, canonical: str, layer: int | None = None) -> str:
  """The GGUF tensor name of `canonical` (in block `layer` for per-layer weights)."""
  try:
    template = TABLES[arch][canonical]
  except KeyError:
    raise JaxvtError(f"architecture '{arch}' has no weight '{canonical}'") from None
  if "{i}" in template:
    if layer is None:
      raise ValueError(f"{canonical} is per-layer; pass its layer index")
    return template.format(i=layer)
  return template
