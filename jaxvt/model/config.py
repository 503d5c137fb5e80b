"""Model configuration: one frozen dataclass for every supported architecture.

Built at the edge (from GGUF metadata by `from_gguf_metadata`, or directly for weightless
configurations) and passed explicitly. Layer heterogeneity is data: `layer_types[i]` is
"attention" or "deltanet" for trunk layer i; `ffn_kind` says whether the FFN is dense or MoE.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Mapping

from jaxvt.errors import JaxvtError, escape
from jaxvt.gguf.arith import check_arithmetic
from jaxvt.gguf.names import gguf_name

ARCHITECTURES = ("llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: str
  n_layers: int  # trunk layers (an appended MTP block is excluded)
  d_model: int
  n_heads: int
  n_kv_heads: int
  head_dim: int  # key/query head dim
  v_head_dim: int
  ffn_dim: int  # dense FFN hidden size (0 for pure MoE)
  vocab_size: int
  rms_eps: float
  rope_theta: float
  rope_dim: int  # rotary dims per head (partial RoPE when < head_dim)
  context_length: int
  tied_embeddings: bool
  # The llama converter permutes q/k rows so GGUF RoPE pairs are (2i, 2i+1) ("interleaved");
  # Qwen converters keep HF order and llama.cpp applies NEOX-style rotate-half. See rope().
  rope_interleaved: bool = True
  qk_norm: bool = False  # per-head RMSNorm on q and k (qwen3, qwen35)
  attn_output_gate: bool = False  # qwen35: attn_q yields [q | gate] per head
  layer_types: tuple[str, ...] = ()  # "attention" | "deltanet", len == n_layers
  # MoE (0 experts == dense FFN)
  n_experts: int = 0
  n_experts_used: int = 0
  expert_ffn_dim: int = 0
  shared_ffn_dim: int = 0
  norm_topk_prob: bool = True
  # Gated DeltaNet
  ssm_conv_kernel: int = 0
  ssm_k_heads: int = 0
  ssm_v_heads: int = 0
  ssm_k_dim: int = 0
  ssm_v_dim: int = 0
  ssm_value_order: str = "tiled"  # "tiled" (qwen35 GGUF) or "grouped" (HF, qwen3next GGUF)
  n_nextn: int = 0  # MTP layers appended after the trunk in the file
  # tokenizer-facing ids (kept here so generation needs no tokenizer object)
  bos_id: int = -1
  eos_id: int = -1

  def __post_init__(self):
    if not self.layer_types:
      object.__setattr__(self, "layer_types", ("attention",) * self.n_layers)
    if len(self.layer_types) != self.n_layers:
      raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")

  @property
  def is_moe(self) -> bool:
    return self.n_experts > 0

  @property
  def attention_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.layer_types) if t == "attention")

  @property
  def deltanet_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.layer_types) if t == "deltanet")

  @property
  def q_dim(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.n_kv_heads * self.head_dim

  @property
  def q_rows(self) -> int:
    """Rows of the query projection: the heads' queries, then (qwen35) their output gates."""
    return self.q_dim * (2 if self.attn_output_gate else 1)

  @property
  def ssm_qk_dim(self) -> int:
    """DeltaNet: channels of q (and of k), key heads x key dim."""
    return self.ssm_k_heads * self.ssm_k_dim

  @property
  def ssm_inner_dim(self) -> int:
    """DeltaNet: channels of v (and of z and the output), value heads x value dim."""
    return self.ssm_v_heads * self.ssm_v_dim

  @property
  def conv_dim(self) -> int:
    """DeltaNet: channels of the causal convolution, [q | k | v]."""
    return 2 * self.ssm_qk_dim + self.ssm_inner_dim


# The numbers from_gguf_metadata reads, as (key under "{arch}.", low, high): the metadata is
# untrusted, and a wrong type, a NaN or an absurd size must be the one-line error, not a
# ZeroDivisionError or an allocation of billions of layers. High bounds are far beyond any model.
_DIM = 1 << 24
_INT_KEYS = (("block_count", 1, 1 << 16), ("nextn_predict_layers", 0, 1 << 16),
             ("embedding_length", 1, _DIM), ("feed_forward_length", 0, _DIM),
             ("attention.head_count", 1, 1 << 16), ("attention.head_count_kv", 1, 1 << 16),
             ("attention.key_length", 1, 1 << 16), ("attention.value_length", 1, 1 << 16),
             ("vocab_size", 1, _DIM), ("full_attention_interval", 0, 1 << 16),
             ("rope.dimension_count", 0, 1 << 16), ("context_length", 1, 1 << 31),
             ("expert_count", 0, 1 << 16), ("expert_used_count", 0, 1 << 16),
             ("expert_feed_forward_length", 0, _DIM),
             ("expert_shared_feed_forward_length", 0, _DIM), ("ssm.conv_kernel", 0, 1 << 10),
             ("ssm.group_count", 0, 1 << 16), ("ssm.time_step_rank", 0, 1 << 16),
             ("ssm.state_size", 0, 1 << 16), ("ssm.inner_size", 0, _DIM))
_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base")


def check_metadata(md: Mapping[str, Any]) -> None:
  """Raises JaxvtError, naming the key, for metadata from_gguf_metadata cannot build a config
  from: an unsupported architecture, a number of the wrong type or out of range, a value that
  is not finite, more trunk layers than blocks, a value the math divides by, takes a power or
  a root of that it cannot use (jaxvt.gguf.arith)."""
  arch = md.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise JaxvtError(f"unsupported architecture {escape(repr(arch), 60)}: jaxvt runs "
                     f"{', '.join(ARCHITECTURES)}")
  fix = "the file is corrupt or not a model file; re-convert it"
  for key, lo, hi in _INT_KEYS:
    v = md.get(f"{arch}.{key}")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
      raise JaxvtError(f"GGUF metadata '{arch}.{key}' is {escape(repr(v), 60)}, not a whole "
                       f"number in {lo}..{hi}; {fix}")
  for key in _FLOAT_KEYS:
    v = md.get(f"{arch}.{key}")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                          not 0 <= v < float("inf")):
      raise JaxvtError(f"GGUF metadata '{arch}.{key}' is {escape(repr(v), 60)}, not a finite "
                       f"number >= 0; {fix}")
  blocks, nextn = md.get(f"{arch}.block_count"), md.get(f"{arch}.nextn_predict_layers", 0)
  if isinstance(blocks, int) and nextn >= blocks:
    raise JaxvtError(f"GGUF metadata gives {blocks} blocks of which {nextn} are MTP layers, "
                     f"leaving no trunk; {fix}")
  heads = md.get(f"{arch}.attention.head_count")
  kv = md.get(f"{arch}.attention.head_count_kv", heads)
  if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
    raise JaxvtError(f"GGUF metadata gives {heads} attention heads for {kv} KV heads, which do "
                     f"not divide them; {fix}")
  d_model = md.get(f"{arch}.embedding_length")
  head_dim = md.get(f"{arch}.attention.key_length",
                    d_model // heads if isinstance(d_model, int) and isinstance(heads, int)
                    else None)
  rope = md.get(f"{arch}.rope.dimension_count")
  if isinstance(rope, int) and isinstance(head_dim, int) and (rope > head_dim or rope % 2):
    raise JaxvtError(f"GGUF metadata gives {rope} rotary dimensions for heads of {head_dim}: "
                     f"not an even number up to the head size; {fix}")
  used, experts = md.get(f"{arch}.expert_used_count", 0), md.get(f"{arch}.expert_count", 0)
  if used > experts or (experts and not used):
    raise JaxvtError(f"GGUF metadata routes each token to {used} of {experts} experts; {fix}")
  recurrent = md.get(f"{arch}.attention.recurrent_layers")
  if recurrent is not None and not (isinstance(recurrent, list) and all(
      isinstance(r, (bool, int)) for r in recurrent)):
    raise JaxvtError(f"GGUF metadata '{arch}.attention.recurrent_layers' is not an array of "
                     f"flags; {fix}")
  for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
    v = md.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
      raise JaxvtError(f"GGUF metadata '{key}' is {escape(repr(v), 60)}, not a token id; {fix}")
  check_arithmetic(md, arch)  # values in range that the math still cannot use


def _req(md: Mapping[str, Any], key: str):
  if key not in md:
    raise JaxvtError(f"GGUF metadata lacks '{key}': the file is incomplete or not a model file; "
                     "re-convert it with llama.cpp's convert_hf_to_gguf.py")
  return md[key]


def from_gguf_metadata(md: Mapping[str, Any],
                       tensor_names: Collection[str] | None = None) -> ModelConfig:
  """Builds a ModelConfig from GGUF key/value metadata (values already decoded to Python) and
  the file's tensor names: the output head is the token embedding (`tied_embeddings`) when the
  file has no output head tensor. Without `tensor_names` the head is taken as untied."""
  arch = md.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise JaxvtError(f"unsupported architecture '{arch}': jaxvt runs {', '.join(ARCHITECTURES)}")
  check_metadata(md)
  p = arch + "."
  g = lambda k, d=None: md.get(p + k, d)
  n_blocks = int(_req(md, p + "block_count"))
  n_nextn = int(g("nextn_predict_layers", 0))
  n_layers = n_blocks - n_nextn
  d_model = int(_req(md, p + "embedding_length"))
  n_heads = int(_req(md, p + "attention.head_count"))
  n_kv = int(g("attention.head_count_kv", n_heads))
  head_dim = int(g("attention.key_length", d_model // n_heads))
  v_head_dim = int(g("attention.value_length", head_dim))
  tokens = md.get("tokenizer.ggml.tokens")
  vocab = int(g("vocab_size", len(tokens) if tokens is not None else 0))
  if vocab <= 0:
    raise JaxvtError("GGUF metadata gives no vocabulary size: the file is incomplete")
  interval = int(g("full_attention_interval", 0))
  recurrent = g("attention.recurrent_layers")  # per block (MTP included); newer converters
  if arch in ("qwen35", "qwen35moe", "qwen3next") and recurrent is not None:
    if len(recurrent) < n_layers:
      raise JaxvtError(f"'{p}attention.recurrent_layers' has {len(recurrent)} entries for "
                       f"{n_layers} layers: the file is inconsistent; re-convert it")
    layer_types = tuple("deltanet" if r else "attention" for r in list(recurrent)[:n_layers])
  elif arch in ("qwen35", "qwen35moe", "qwen3next"):
    interval = interval or 4
    layer_types = tuple("attention" if (i + 1) % interval == 0 else "deltanet"
                        for i in range(n_layers))
  else:
    layer_types = ("attention",) * n_layers
  qwen = arch.startswith("qwen")
  kw = dict(
      arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv,
      head_dim=head_dim, v_head_dim=v_head_dim, ffn_dim=int(g("feed_forward_length", 0)),
      vocab_size=vocab, rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
      rope_theta=float(g("rope.freq_base", 10000.0)),
      rope_dim=int(g("rope.dimension_count", head_dim)),
      context_length=int(g("context_length", 4096)),
      tied_embeddings=(tensor_names is not None
                       and gguf_name(arch, "lm_head") not in tensor_names),
      rope_interleaved=not qwen,
      qk_norm=arch in ("qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next"),
      attn_output_gate=arch in ("qwen35", "qwen35moe", "qwen3next"),
      layer_types=layer_types,
      n_experts=int(g("expert_count", 0)), n_experts_used=int(g("expert_used_count", 0)),
      expert_ffn_dim=int(g("expert_feed_forward_length", 0)),
      shared_ffn_dim=int(g("expert_shared_feed_forward_length", 0)),
      ssm_conv_kernel=int(g("ssm.conv_kernel", 0)),
      ssm_k_heads=int(g("ssm.group_count", 0)), ssm_v_heads=int(g("ssm.time_step_rank", 0)),
      ssm_k_dim=int(g("ssm.state_size", 0)),
      ssm_v_dim=(int(g("ssm.inner_size", 0)) // max(int(g("ssm.time_step_rank", 1)), 1)),
      ssm_value_order="grouped" if arch == "qwen3next" else "tiled",
      n_nextn=n_nextn,
      bos_id=int(md.get("tokenizer.ggml.bos_token_id", -1)),
      eos_id=int(md.get("tokenizer.ggml.eos_token_id", -1)),
  )
  return ModelConfig(**kw)
