"""Synthetic GGUF model files: any ModelConfig of arch llama / qwen3 / qwen3moe / qwen35 / qwen35moe,
written as llama.cpp's converter would lay it out, with random but numerically sane weights.

`write_model(path, cfg, recipe, seed)` writes the real file's tensor names (jaxvt.gguf.names),
shapes (jaxvt.model.declare), metadata keys (all that jaxvt.model.config.from_gguf_metadata reads,
plus a small valid gpt2-BPE tokenizer and a ChatML chat template) and the converter conventions:

- qwen35/qwen35moe norms hold HF's zero-centred weight + 1 (every `*norm` but `ssm_norm`); we draw
  the stored value directly (1 + N(0, 0.1)), so a reader must use plain `x * w`;
- `ssm_a` = -exp(A_log) (drawn negative), `ssm_conv1d` squeezed to [conv_dim, kernel],
  `ssm_dt.bias` for dt_bias, value heads in the tiled order (irrelevant for random weights, but a
  reference built from the file must un-tile them, see tests/reference/record_transformers.py);
- `cfg.n_nextn` > 0 (qwen35/qwen35moe) appends that many MTP blocks (block_count includes them)
  with their `nextn.*` tensors; a loader must ignore them.

Matrices take the ggml format of their role from `recipe` ({role or canonical name: format};
"default" for the rest); vectors are F32. A format whose block does not divide a matrix's row
length falls back as llama.cpp's quantizer does (K formats -> Q8_0 -> F16). Writing streams tensor
by tensor (GGUFWriter.add_tensor_info + write_tensor_data) and generates big tensors in parallel
chunks with `jaxvt.gguf.quantize.random_blocks`, so RAM stays at a few tensors and a
Qwen3.6-35B-A3B-shaped file (~20 GiB of Q4_K experts) takes minutes on 16 cores. The bytes depend
only on (cfg, recipe, seed), never on the thread count.

Routing. By default the routers are random like every other matrix, so a decode's expert choices
are uniform and memoryless (next-token reuse about k/E): no expert cache can be judged on such a
file. `write_model(..., routing=RoutingStats(...))` writes a MoE file whose routing in a real
decode (temperature 1) is temporally correlated, skewed and predictable across layers, with the
statistics given as targets: next_token_reuse (default 0.45) and reuse_within_8 (0.80), the
figures of real Qwen3-30B-A3B routing traces, and optionally skew (the share of selections of
the top 10% of experts) and next_layer_predictability. The embedding, the output head and the
trunk's routers are then built around a few "topic" directions (jaxvt.synth_routing): the
embedding dominates the residual, each token belongs to a topic, the head keeps a decode in its
topic for a while, and each layer's router prefers some experts per topic, so the experts a
layer chooses follow the slowly changing topic. The construction's parameters are calibrated by
simulating that process for the model's experts, experts used and vocabulary;
`python -m benchmarks.routing --model FILE` measures the real decode (docs/BENCHMARKS.md,
"routing"). With `RoutingStats.lru_curve` the topics lie on a ring that a decode walks along, so
the working set drifts and an LRU expert cache hits as on real routing traces
(jaxvt.synth_routing.PRESETS["realistic"]; PRESETS["high-locality"] is RoutingStats(): few
topics, a static working set). Every other tensor, and every file written without `routing`, is
as before.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import os
import re
from typing import Callable, Mapping

import gguf
import numpy as np

from jaxvt.gguf import names as gguf_names
from jaxvt.gguf.quantize import quantize, random_blocks
from jaxvt.gguf.quants import FORMATS, get_format
from jaxvt.gguf.tokenizer import bytes_to_unicode
from jaxvt.model import declare as declare_mod
from jaxvt.model.config import ModelConfig
from jaxvt.model.declare import Role
from jaxvt.synth_routing import Construction, RoutingStats, calibrate

ARCHS = ("llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe")
_T = gguf.GGMLQuantizationType
_CHUNK_BYTES = 32 << 20  # generation unit of big tensors (fixed: the bytes must not depend on threads)

# Per-role formats. Routers stay F32 like llama.cpp's quantizer leaves them.
RECIPES: dict[str, dict[str, str]] = {
    "f32": {"default": "F32"},
    "f16": {"default": "F16", "router": "F32"},
    "bf16": {"default": "BF16", "router": "F32"},
    "q8_0": {"default": "Q8_0", "router": "F32"},
    "q4_0": {"default": "Q4_0", "router": "F32", "output": "Q8_0"},
    "q4_1": {"default": "Q4_1", "router": "F32", "output": "Q8_0"},
    "q4_k_m": {"default": "Q4_K", "router": "F32", "output": "Q6_K", "attention": "Q6_K",
               "deltanet": "Q6_K", "shared_expert": "Q6_K", "embedding": "Q4_K"},
    "q5_k_m": {"default": "Q5_K", "router": "F32", "output": "Q6_K"},
    "q6_k": {"default": "Q6_K", "router": "F32"},
    # One role per format: exercises every reader path in one small file.
    "mixed": {"default": "Q8_0", "router": "F32", "embedding": "F16", "output": "Q6_K",
              "attention": "Q4_K", "deltanet": "Q5_K", "routed_experts": "Q4_K",
              "shared_expert": "Q4_1", "dense_ffn": "Q4_0", "gdn.w_beta": "BF16",
              "gdn.w_alpha": "F32"},
}

# Per arch, a tiny configuration: d_model 64, 4 trunk layers, vocab 320.
_TINY: dict[str, dict] = {
    "llama": dict(n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, rope_dim=16,
                  rope_interleaved=True),
    "qwen3": dict(n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128, rope_dim=32,
                  rope_interleaved=False, qk_norm=True),
    "qwen3moe": dict(n_heads=4, n_kv_heads=2, head_dim=16, rope_dim=16, rope_interleaved=False,
                     qk_norm=True, n_experts=8, n_experts_used=2, expert_ffn_dim=32),
    "qwen35": dict(n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128, rope_dim=8,
                   rope_interleaved=False, qk_norm=True, attn_output_gate=True,
                   ssm_conv_kernel=4, ssm_k_heads=2, ssm_v_heads=4, ssm_k_dim=16, ssm_v_dim=16),
    "qwen35moe": dict(n_heads=4, n_kv_heads=2, head_dim=32, rope_dim=8, rope_interleaved=False,
                      qk_norm=True, attn_output_gate=True, n_experts=8, n_experts_used=2,
                      expert_ffn_dim=32, shared_ffn_dim=32, ssm_conv_kernel=4, ssm_k_heads=2,
                      ssm_v_heads=4, ssm_k_dim=16, ssm_v_dim=16),
}


def tiny_config(arch: str, **overrides) -> ModelConfig:
  """A small ModelConfig of `arch` for fixtures (overrides replace any field)."""
  if arch not in _TINY:
    raise ValueError(f"no tiny configuration for arch {arch!r}; one of {ARCHS}")
  kw = dict(arch=arch, n_layers=4, d_model=64, vocab_size=320, rms_eps=1e-6,
            rope_theta=10000.0, context_length=256, tied_embeddings=False, ffn_dim=0)
  kw.update(_TINY[arch])
  kw.update(overrides)
  kw.setdefault("v_head_dim", kw["head_dim"])
  if arch in ("qwen35", "qwen35moe") and "layer_types" not in overrides:
    kw["layer_types"] = tuple("attention" if (i + 1) % 4 == 0 else "deltanet"
                              for i in range(kw["n_layers"]))
  return ModelConfig(**kw)


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE (gpt2 style) trained on a fixed text.

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TRAIN_TEXT = (
    "The capital of France is Paris. The capital of Italy is Rome. The quick brown fox jumps "
    "over the lazy dog. Hello, world! This is a small model that writes tokens, one at a time, "
    "and the tokens are the pieces of the words in the text. In the beginning there is a state, "
    "then the state is updated with the keys and the values of the sequence. 0123456789 "
    "user assistant system question answer model layer expert router attention.")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# ChatML with tools in the Hermes/Qwen2.5 format: the tools listed in the system turn, an
# assistant's calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
TOOLS_CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% elif message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message['content'] }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@dataclasses.dataclass(frozen=True)
class Vocab:
  tokens: list[str]
  types: list[int]  # gguf.TokenType
  merges: list[str]
  bos_id: int
  eos_id: int
  pad_id: int


def build_vocab(n_vocab: int) -> Vocab:
  """256 byte tokens, BPE merges learnt from a fixed text, 3 ChatML specials, [PAD{i}] filler."""
  n_merges = n_vocab - 256 - len(_SPECIALS)
  if n_merges < 0:
    raise ValueError(f"vocab_size {n_vocab} is too small: a byte-level vocab needs "
                     f">= {256 + len(_SPECIALS)} tokens")
  b2u = bytes_to_unicode()
  tokens = [b2u[b] for b in range(256)]
  words = collections.Counter(
      tuple(b2u[c] for c in w.encode()) for w in re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+",
                                                            _TRAIN_TEXT))
  merges: list[str] = []
  known = set(tokens)
  while len(merges) < n_merges:
    pairs = collections.Counter()
    for w, c in words.items():
      for a, b in zip(w, w[1:]):
        pairs[a, b] += c
    pairs = {p: c for p, c in pairs.items() if p[0] + p[1] not in known}
    if not pairs:
      break
    a, b = min(pairs, key=lambda p: (-pairs[p], p))
    merges.append(f"{a} {b}")
    tokens.append(a + b)
    known.add(a + b)
    new_words = collections.Counter()
    for w, c in words.items():
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
          out.append(a + b)
          i += 2
        else:
          out.append(w[i])
          i += 1
      new_words[tuple(out)] += c
    words = new_words
  types = [int(gguf.TokenType.NORMAL)] * len(tokens)
  first_special = len(tokens)
  tokens += list(_SPECIALS)
  types += [int(gguf.TokenType.CONTROL)] * len(_SPECIALS)
  while len(tokens) < n_vocab:
    tokens.append(f"[PAD{len(tokens)}]")
    types.append(int(gguf.TokenType.UNUSED))
  return Vocab(tokens, types, merges, bos_id=first_special, eos_id=first_special + 2,
               pad_id=first_special)


# ---------------------------------------------------------------------------------------------
# The tensor plan.

@dataclasses.dataclass(frozen=True)
class TensorSpec:
  name: str  # GGUF name
  shape: tuple[int, ...]  # numpy order (cols last)
  type_id: int
  kind: str  # "matrix" | "norm" | "ssm_a" | "dt_bias" | "conv" | "gate_vec"
  std: float = 0.0  # matrices: element standard deviation


def _type_id(v) -> int:
  if isinstance(v, str):
    return int(_T[v.upper()])
  return int(v)


def _fit_format(type_id: int, cols: int) -> int:
  """llama.cpp-style fallback when the block does not divide the row length."""
  for t in (type_id, int(_T.Q8_0), int(_T.F16)):
    if cols % get_format(t).block_elems == 0:
      return t
  return int(_T.F32)


def _vector_kind(name: str) -> str:
  if name == "gdn.a":
    return "ssm_a"
  if name == "gdn.dt_bias":
    return "dt_bias"
  if name == "gdn.conv":
    return "conv"
  if name == "shexp.gate":
    return "gate_vec"
  return "norm"


def _matrix_std(role: Role, cols: int) -> float:
  return 1.0 if role == Role.EMBEDDING else 1.0 / math.sqrt(cols)


def _check(cfg: ModelConfig) -> int:
  """Validates what the file format can express; returns full_attention_interval (0 if none)."""
  if cfg.arch not in ARCHS:
    raise ValueError(f"synth writes {', '.join(ARCHS)}, not {cfg.arch!r}")
  if cfg.n_nextn and cfg.arch not in ("qwen35", "qwen35moe"):
    raise ValueError(f"an MTP block exists only for qwen35/qwen35moe, not {cfg.arch}")
  if cfg.arch not in ("qwen35", "qwen35moe"):
    if set(cfg.layer_types) != {"attention"}:
      raise ValueError(f"{cfg.arch} has attention layers only")
    return 0
  interval = cfg.layer_types.index("attention") + 1 if "attention" in cfg.layer_types else 0
  want = tuple("attention" if interval and (i + 1) % interval == 0 else "deltanet"
               for i in range(cfg.n_layers))
  if not interval or cfg.layer_types != want:
    raise ValueError("qwen35 layer_types must be (interval-1) deltanet layers then one attention "
                     "layer, repeated")
  return interval


def plan(cfg: ModelConfig, recipe: Mapping[str, object] | str) -> list[TensorSpec]:
  """Every tensor of the file, in file order: embedding, blocks (then MTP blocks), norm, head."""
  _check(cfg)
  recipe = RECIPES[recipe] if isinstance(recipe, str) else dict(recipe)
  default = recipe.get("default", "F32")

  def fmt(name: str, role: Role, cols: int) -> int:
    return _fit_format(_type_id(recipe.get(name, recipe.get(role.value, default))), cols)

  decls = declare_mod.declare(cfg)
  glob, per_layer = [], collections.defaultdict(list)
  for d in decls:
    if d.name == "lm_head" and cfg.tied_embeddings:
      continue
    for layer in (d.layers if d.layers is not None else (None,)):
      name = gguf_names.gguf_name(cfg.arch, d.name, layer)
      if d.matrix:
        spec = TensorSpec(name, d.shape, fmt(d.name, d.role, d.shape[-1]), "matrix",
                          _matrix_std(d.role, d.shape[-1]))
      else:
        spec = TensorSpec(name, d.shape, int(_T.F32), _vector_kind(d.name))
      (glob if layer is None else per_layer[layer]).append(spec)
  out = [s for s in glob if s.name == "token_embd.weight"]
  for layer in sorted(per_layer):
    out += per_layer[layer]
  for m in range(cfg.n_nextn):
    out += _mtp_specs(cfg, cfg.n_layers + m, fmt)
  out += [s for s in glob if s.name != "token_embd.weight"]
  return out


def _mtp_specs(cfg: ModelConfig, i: int, fmt) -> list[TensorSpec]:
  """The MTP block appended after the trunk: a full-attention block plus its nextn tensors."""
  d = cfg.d_model
  full = dataclasses.replace(cfg, n_layers=1, layer_types=("attention",), n_nextn=0)
  specs = []
  for decl in declare_mod.declare(full):
    if decl.layers is None:
      continue
    name = gguf_names.gguf_name(cfg.arch, decl.name, 0).replace("blk.0.", f"blk.{i}.", 1)
    if decl.matrix:
      specs.append(TensorSpec(name, decl.shape, fmt(decl.name, decl.role, decl.shape[-1]),
                              "matrix", _matrix_std(decl.role, decl.shape[-1])))
    else:
      specs.append(TensorSpec(name, decl.shape, int(_T.F32), _vector_kind(decl.name)))
  specs.append(TensorSpec(f"blk.{i}.nextn.eh_proj.weight", (d, 2 * d),
                          fmt("nextn.eh_proj", Role.ATTENTION, 2 * d), "matrix",
                          1.0 / math.sqrt(2 * d)))
  for n in ("enorm", "hnorm", "shared_head_norm"):
    specs.append(TensorSpec(f"blk.{i}.nextn.{n}.weight", (d,), int(_T.F32), "norm"))
  return specs


# ---------------------------------------------------------------------------------------------
# Metadata.

_FILE_TYPE = {int(_T.F32): 0, int(_T.F16): 1, int(_T.Q4_0): 2, int(_T.Q4_1): 3, int(_T.Q8_0): 7,
              int(_T.Q4_K): 15, int(_T.Q5_K): 17, int(_T.Q6_K): 18, int(_T.BF16): 32}


def _rope_sections(rope_dim: int) -> list[int]:
  """Qwen3.5 IMRoPE sections (t, h, w, e) over the rope_dim/2 rotary pairs: [11, 11, 10, 0] for 64.

  llama.cpp's IMRoPE gives pair i the t, h or w position by i % 3 while i < 3 * section; any other
  pair takes the 4th ("e") position, which is 0 for text tokens. So every pair must be covered:
  t = ceil(s/3), h = ceil((s-t)/2), w = the rest (an empty w section would leave pairs unrotated).
  """
  s = rope_dim // 2
  t = -(-s // 3)
  h = -(-(s - t) // 2)
  return [t, h, s - t - h, 0]


def _write_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, specs: list[TensorSpec], vocab: Vocab,
                    pre: str, name: str, chat_template: str = CHAT_TEMPLATE) -> None:
  arch = cfg.arch
  w.add_name(name)
  w.add_type("model")
  by_bytes = collections.Counter()
  for s in specs:
    if s.kind == "matrix":
      by_bytes[s.type_id] += math.prod(s.shape)
  w.add_file_type(_FILE_TYPE.get(by_bytes.most_common(1)[0][0], 0))
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  w.add_block_count(cfg.n_layers + cfg.n_nextn)
  w.add_context_length(cfg.context_length)
  w.add_embedding_length(cfg.d_model)
  if cfg.ffn_dim:
    w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.v_head_dim)
  w.add_layer_norm_rms_eps(cfg.rms_eps)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_rope_dimension_count(cfg.rope_dim)
  if cfg.is_moe:
    w.add_expert_count(cfg.n_experts)
    w.add_expert_used_count(cfg.n_experts_used)
    w.add_expert_feed_forward_length(cfg.expert_ffn_dim)
    if cfg.shared_ffn_dim:
      w.add_expert_shared_feed_forward_length(cfg.shared_ffn_dim)
  if arch in ("qwen35", "qwen35moe"):
    w.add_ssm_conv_kernel(cfg.ssm_conv_kernel)
    w.add_ssm_state_size(cfg.ssm_k_dim)
    w.add_ssm_group_count(cfg.ssm_k_heads)
    w.add_ssm_time_step_rank(cfg.ssm_v_heads)
    w.add_ssm_inner_size(cfg.ssm_v_heads * cfg.ssm_v_dim)
    w.add_full_attention_interval(_check(cfg))
    # As convert_hf_to_gguf writes it from HF's layer_types (llama.cpp prefers it to the interval).
    w.add_array(f"{arch}.attention.recurrent_layers",
                [t == "deltanet" for t in cfg.layer_types] + [False] * cfg.n_nextn)
    w.add_rope_dimension_sections(_rope_sections(cfg.rope_dim))
    if cfg.n_nextn:
      w.add_nextn_predict_layers(cfg.n_nextn)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(vocab.tokens)
  w.add_token_types(vocab.types)
  w.add_token_merges(vocab.merges)
  w.add_bos_token_id(vocab.bos_id)
  w.add_eos_token_id(vocab.eos_id)
  w.add_pad_token_id(vocab.pad_id)
  w.add_add_bos_token(False)
  w.add_chat_template(chat_template)


# ---------------------------------------------------------------------------------------------
# Tensor values.

def _row_bytes(spec: TensorSpec) -> int:
  fmt = get_format(spec.type_id)
  return spec.shape[-1] // fmt.block_elems * fmt.block_bytes


def _chunks(spec: TensorSpec) -> list[tuple[int, int]]:
  """Row ranges (over the flattened leading dims), each generated as one unit with its own rng."""
  rows = math.prod(spec.shape[:-1])
  step = max(1, _CHUNK_BYTES // _row_bytes(spec))
  return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _vector(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
  n = spec.shape
  if spec.kind == "norm":  # stored form: 1 + w (qwen35 converter) or a plain weight near 1
    x = 1.0 + 0.1 * rng.standard_normal(n)
  elif spec.kind == "ssm_a":  # -exp(A_log); decays exp(g) mostly in (0.5, 1)
    x = -rng.uniform(0.05, 1.0, n)
  elif spec.kind == "dt_bias":
    x = 0.5 * rng.standard_normal(n)
  elif spec.kind == "conv":
    x = rng.uniform(-0.5, 0.5, n)
  elif spec.kind == "gate_vec":
    x = rng.standard_normal(n) / math.sqrt(n[-1])
  else:
    raise ValueError(spec.kind)
  return x.astype(np.float32)


def _fill(spec: TensorSpec, seed: int, index: int, out: np.ndarray, lo: int, hi: int) -> None:
  rng = np.random.default_rng([seed, index, lo])
  out[lo:hi] = random_blocks(rng, spec.type_id, (hi - lo, spec.shape[-1]), scale=spec.std)


def _routed_values(cfg: ModelConfig, routing: RoutingStats,
                   seed: int) -> dict[str, Callable[[int, int], np.ndarray]]:
  """{GGUF name: rows(lo, hi) -> float32} of the tensors a routing-realistic file constructs:
  the embedding, the output head and the trunk's routers (jaxvt.synth_routing)."""
  if not cfg.is_moe:
    raise ValueError(f"routing statistics need a MoE model, not {cfg.arch}")
  if cfg.tied_embeddings:
    raise ValueError("a routing-realistic model needs its own output head (tied_embeddings=False)")
  knobs, sim = calibrate(routing, cfg.n_experts, cfg.n_experts_used, cfg.vocab_size,
                         cfg.d_model)
  off = {n: round(sim[n], 3) for n, t in routing.targets().items()
         if abs(sim[n] - t) > routing.tolerance}
  if routing.max_skew is not None and sim["skew"] > routing.max_skew + routing.tolerance:
    off["skew"] = round(sim["skew"], 3)
  if off:
    raise ValueError(f"{routing} is out of reach for top-{cfg.n_experts_used} of "
                     f"{cfg.n_experts} experts: the closest construction gives {off}; relax "
                     "those targets")
  build = Construction(cfg.d_model, cfg.vocab_size, cfg.n_layers, cfg.n_experts, knobs, seed)
  out = {gguf_names.gguf_name(cfg.arch, "embed", None): build.embedding_rows,
         gguf_names.gguf_name(cfg.arch, "lm_head", None): build.output_rows}
  for l in range(cfg.n_layers):
    out[gguf_names.gguf_name(cfg.arch, "moe.router", l)] = (
        lambda lo, hi, r=build.routers[l]: r[lo:hi])
  return out


def _fill_values(spec: TensorSpec, rows: Callable[[int, int], np.ndarray], out: np.ndarray, lo: int,
                 hi: int) -> None:
  out[lo:hi] = quantize(rows(lo, hi), spec.type_id)


def write_model(path: str | os.PathLike, cfg: ModelConfig, recipe: Mapping[str, object] | str = "f32",
                seed: int = 0, *, threads: int | None = None, pre: str | None = None,
                name: str | None = None, chat_template: str = CHAT_TEMPLATE,
                progress: Callable[[str, int], None] | None = None,
                routing: RoutingStats | None = None) -> dict[str, str]:
  """Writes a synthetic GGUF model for `cfg` to `path`.

  Args:
    cfg: the model (arch llama/qwen3/qwen3moe/qwen35/qwen35moe; cfg.n_nextn MTP blocks for the
      qwen35 archs; cfg.tied_embeddings omits output.weight). cfg.bos_id/eos_id are not used: the
      file's special ids come from its own vocabulary (see build_vocab).
    recipe: a RECIPES key or {role value | canonical name | "default": format name or type id}.
    seed: everything written is a function of (cfg, recipe, seed).
    threads: generator threads (default: all cores).
    pre: tokenizer.ggml.pre (default "smollm" for llama, else "qwen2").
    chat_template: tokenizer.chat_template (CHAT_TEMPLATE: plain ChatML; TOOLS_CHAT_TEMPLATE:
      ChatML with tools in the Hermes format).
    progress: called as progress(tensor name, bytes) after each tensor is written.
    routing: None (default): random routers, uniform and memoryless routing. RoutingStats: a
      MoE model whose embedding, output head and routers are built so that a decode's expert
      choices have those statistics (jaxvt.synth_routing; benchmarks.routing measures them).
  Returns:
    {GGUF tensor name: format name} as written.
  """
  specs = plan(cfg, recipe)
  built = _routed_values(cfg, routing, seed) if routing is not None else {}
  vocab = build_vocab(cfg.vocab_size)
  pre = pre or ("smollm" if cfg.arch == "llama" else "qwen2")
  w = gguf.GGUFWriter(os.fspath(path), cfg.arch)
  _write_metadata(w, cfg, specs, vocab, pre, name or f"jaxvt synthetic {cfg.arch}", chat_template)
  for s in specs:
    if s.kind == "matrix":
      byte_shape = (*s.shape[:-1], _row_bytes(s))
      w.add_tensor_info(s.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                        raw_dtype=_T(s.type_id))
    else:
      w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), 4 * math.prod(s.shape))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()

  pool = concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1)

  def start(i: int):
    s = specs[i]
    if s.kind != "matrix":
      return _vector(s, np.random.default_rng([seed, i])), []
    buf = np.empty((math.prod(s.shape[:-1]), _row_bytes(s)), np.uint8)
    if s.name in built:
      return buf, [pool.submit(_fill_values, s, built[s.name], buf, lo, hi)
                   for lo, hi in _chunks(s)]
    return buf, [pool.submit(_fill, s, seed, i, buf, lo, hi) for lo, hi in _chunks(s)]

  try:
    pending = start(0) if specs else None
    for i, s in enumerate(specs):
      buf, futures = pending
      pending = start(i + 1) if i + 1 < len(specs) else None  # overlap generation and writing
      for f in futures:
        f.result()
      w.write_tensor_data(buf)
      if progress:
        progress(s.name, buf.nbytes)
      del buf
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
    w.close()
  return {s.name: FORMATS[s.type_id].name for s in specs}
