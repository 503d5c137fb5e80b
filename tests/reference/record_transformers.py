"""Records transformers' behaviour on synthetic GGUF fixtures, for tests that run without torch.

Run by hand (not collected by pytest), from the repository root, with torch (CPU) and
transformers>=5.17 installed:

    python tests/reference/record_transformers.py

For each case of CASES it regenerates a tiny synthetic GGUF (jaxvt.synth.write_model with
the case's arch, recipe, seed and config overrides), builds the matching transformers model
(Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM) from the SAME weights: every
tensor dequantized with gguf-py and the converter's transforms undone (llama.cpp
conversion/qwen.py):

- qwen35moe norms hold HF's zero-centred weight + 1 (all `*norm` but `ssm_norm`): subtract 1;
- `ssm_a` = -exp(A_log): A_log = log(-ssm_a); `ssm_dt.bias` is `dt_bias`;
- qwen35 value heads are stored tiled (head j at r * n_k + g for HF's grouped head g * R + r):
  un-tile the V rows of attn_qkv, the rows of attn_gate / ssm_beta / ssm_alpha, the entries of
  ssm_a / ssm_dt, the V channels of ssm_conv1d and the columns of ssm_out;
- `ssm_conv1d` [conv_dim, K] is HF's conv1d.weight [conv_dim, 1, K];
- routed experts: HF's fused gate_up_proj [E, 2f, d] = concat(ffn_gate_exps, ffn_up_exps);
- attn_q of qwen35 is per head [q | gate], the same layout as HF's q_proj (no transform);
- the appended MTP block is not loaded (HF's causal LM has none).

It then runs the model in float32 (eager attention; the GDN layers use transformers' torch
fallbacks: torch_chunk_gated_delta_rule for the prompt, torch_recurrent_gated_delta_rule per
decode step) and writes `tests/reference/transformers_<case>.npz`:

  case (json: arch, recipe, seed, overrides, n_decode), file_sha256 (of the regenerated GGUF: a
  test that regenerates a different file must not compare), prompt int32 [n], prefill_logits
  float32 [n, vocab], tokens int32 [n_decode + 1] (greedy: tokens[0] from the prompt's last
  logits, tokens[i+1] from decode_logits[i]), decode_logits float32 [n_decode, vocab] (after
  feeding tokens[i]), margins float32 [n_decode + 1] (best minus second-best logit per choice),
  versions (json).

and `tests/reference/gdn_rules.npz`: random inputs and the outputs/final states of
torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (q/k already expanded to the
value heads, l2-normalised and q scaled, as jaxvt's rule takes them).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
N_DECODE = 16
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 300, 17]

CASES = {
    "qwen3": dict(arch="qwen3", recipe="mixed", seed=11, overrides={}),
    "qwen3moe": dict(arch="qwen3moe", recipe="mixed", seed=12, overrides={}),
    "qwen35moe": dict(arch="qwen35moe", recipe="mixed", seed=13, overrides={"n_nextn": 1}),
    # K-quant experts and 256-wide rows; two full periods (8 layers).
    "qwen35moe_k": dict(arch="qwen35moe", recipe="q4_k_m", seed=14,
                        overrides={"d_model": 256, "expert_ffn_dim": 256, "shared_ffn_dim": 256,
                                   "n_layers": 8}),
}


def case_config(case: dict):
  """The ModelConfig of a case (jaxvt.synth.tiny_config with the case's overrides)."""
  from jaxvt import synth
  over = dict(case["overrides"])
  if "n_layers" in over and case["arch"] in ("qwen35", "qwen35moe"):
    over["layer_types"] = tuple("attention" if (i + 1) % 4 == 0 else "deltanet"
                                for i in range(over["n_layers"]))
  return synth.tiny_config(case["arch"], **over)


def write_case_file(case: dict, path: str) -> str:
  """Regenerates a case's GGUF at `path`; returns its sha256."""
  from jaxvt import synth
  synth.write_model(path, case_config(case), case["recipe"], case["seed"])
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# GGUF -> HF state dict

def gguf_tensors(path: str, dtype=np.float32) -> dict[str, np.ndarray]:
  """{GGUF name: array of `dtype`}: every tensor of the file dequantized by gguf-py, in its
  row-major shape (also the float64 truth of tests/test_qwen_fixtures.np_tensors)."""
  import gguf
  out = {}
  for t in gguf.GGUFReader(path).tensors:
    x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    out[t.name] = np.asarray(x, dtype).reshape([int(n) for n in reversed(t.shape)])
  return out


def untile_index(n_k: int, n_v: int) -> np.ndarray:
  """perm with grouped[j] = tiled[perm[j]]: HF head j = g * R + r sits at tiled r * n_k + g."""
  R = n_v // n_k
  j = np.arange(n_v)
  return (j % R) * n_k + j // R


def hf_state_dict(cfg, T: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """HF parameter name -> array, from the file's tensors T (converter transforms undone)."""
  qwen35 = cfg.arch in ("qwen35", "qwen35moe")
  norm = (lambda x: x - 1.0) if qwen35 else (lambda x: x)
  sd = {"model.embed_tokens.weight": T["token_embd.weight"],
        "model.norm.weight": norm(T["output_norm.weight"])}
  if "output.weight" in T:
    sd["lm_head.weight"] = T["output.weight"]
  nk, nv, dk, dv = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_k_dim, cfg.ssm_v_dim
  perm = untile_index(nk, nv) if nv else None
  heads = lambda x, d: x.reshape(nv, d, *x.shape[1:])[perm].reshape(x.shape)  # rows by v head
  for i in range(cfg.n_layers):
    b, p = f"blk.{i}.", f"model.layers.{i}."
    sd[p + "input_layernorm.weight"] = norm(T[b + "attn_norm.weight"])
    post = "post_attention_norm" if qwen35 else "ffn_norm"
    sd[p + "post_attention_layernorm.weight"] = norm(T[b + post + ".weight"])
    if cfg.layer_types[i] == "attention":
      a = p + "self_attn."
      for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                   ("attn_output", "o_proj")):
        sd[a + h + ".weight"] = T[b + g + ".weight"]
      if cfg.qk_norm:
        sd[a + "q_norm.weight"] = norm(T[b + "attn_q_norm.weight"])
        sd[a + "k_norm.weight"] = norm(T[b + "attn_k_norm.weight"])
    else:
      a = p + "linear_attn."
      qkv = T[b + "attn_qkv.weight"]
      qk = 2 * nk * dk
      sd[a + "in_proj_qkv.weight"] = np.concatenate([qkv[:qk], heads(qkv[qk:], dv)])
      sd[a + "in_proj_z.weight"] = heads(T[b + "attn_gate.weight"], dv)
      sd[a + "in_proj_b.weight"] = T[b + "ssm_beta.weight"][perm]
      sd[a + "in_proj_a.weight"] = T[b + "ssm_alpha.weight"][perm]
      sd[a + "A_log"] = np.log(-T[b + "ssm_a"][perm])
      sd[a + "dt_bias"] = T[b + "ssm_dt.bias"][perm]
      conv = T[b + "ssm_conv1d.weight"]
      sd[a + "conv1d.weight"] = np.concatenate([conv[:qk], heads(conv[qk:], dv)])[:, None, :]
      out = T[b + "ssm_out.weight"]  # [d, nv * dv]: columns by v head
      sd[a + "out_proj.weight"] = heads(out.T, dv).T
      sd[a + "norm.weight"] = T[b + "ssm_norm.weight"]  # stored without the +1
    if cfg.is_moe:
      m = p + "mlp."
      sd[m + "gate.weight"] = T[b + "ffn_gate_inp.weight"]
      sd[m + "experts.gate_up_proj"] = np.concatenate(
          [T[b + "ffn_gate_exps.weight"], T[b + "ffn_up_exps.weight"]], axis=1)
      sd[m + "experts.down_proj"] = T[b + "ffn_down_exps.weight"]
      if cfg.shared_ffn_dim:
        for n in ("gate", "up", "down"):
          sd[m + f"shared_expert.{n}_proj.weight"] = T[b + f"ffn_{n}_shexp.weight"]
        sd[m + "shared_expert_gate.weight"] = T[b + "ffn_gate_inp_shexp.weight"][None, :]
    else:
      for n in ("gate", "up", "down"):
        sd[p + f"mlp.{n}_proj.weight"] = T[b + f"ffn_{n}.weight"]
  return sd


# ---------------------------------------------------------------------------------------------
# HF models

def hf_model(cfg):
  import torch
  import transformers as tf
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                rms_norm_eps=cfg.rms_eps, max_position_embeddings=cfg.context_length,
                tie_word_embeddings=cfg.tied_embeddings, hidden_act="silu",
                attention_bias=False)
  if cfg.arch == "qwen3":
    conf = tf.Qwen3Config(intermediate_size=cfg.ffn_dim, rope_parameters=rope, **common)
    cls = tf.Qwen3ForCausalLM
  elif cfg.arch == "qwen3moe":
    conf = tf.Qwen3MoeConfig(num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_used,
                             moe_intermediate_size=cfg.expert_ffn_dim, intermediate_size=64,
                             norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                             mlp_only_layers=[], rope_parameters=rope, **common)
    cls = tf.Qwen3MoeForCausalLM
  elif cfg.arch == "qwen35moe":
    from jaxvt.synth import _rope_sections
    rope = dict(rope, partial_rotary_factor=cfg.rope_dim / cfg.head_dim,
                mrope_section=_rope_sections(cfg.rope_dim)[:3], mrope_interleaved=True)
    conf = tf.Qwen3_5MoeTextConfig(
        num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_used,
        moe_intermediate_size=cfg.expert_ffn_dim,
        shared_expert_intermediate_size=cfg.shared_ffn_dim,
        linear_conv_kernel_dim=cfg.ssm_conv_kernel, linear_key_head_dim=cfg.ssm_k_dim,
        linear_value_head_dim=cfg.ssm_v_dim, linear_num_key_heads=cfg.ssm_k_heads,
        linear_num_value_heads=cfg.ssm_v_heads,
        layer_types=["full_attention" if t == "attention" else "linear_attention"
                     for t in cfg.layer_types],
        rope_parameters=rope, **common)
    cls = tf.Qwen3_5MoeForCausalLM
  else:
    raise ValueError(cfg.arch)
  conf._attn_implementation = "eager"
  torch.manual_seed(0)
  return cls(conf).to(torch.float32).eval()


def load_state(model, sd: dict[str, np.ndarray]) -> None:
  import torch
  params = dict(model.named_parameters())
  missing = [n for n in params if n not in sd and not (n == "lm_head.weight"
                                                       and model.config.tie_word_embeddings)]
  extra = [n for n in sd if n not in params]
  if missing or extra:
    raise SystemExit(f"state dict mismatch: missing {missing[:8]} extra {extra[:8]}")
  with torch.no_grad():
    for n, x in sd.items():
      if tuple(params[n].shape) != x.shape:
        raise SystemExit(f"{n}: HF shape {tuple(params[n].shape)} != {x.shape}")
      params[n].copy_(torch.from_numpy(np.array(x, np.float32)))


def run_greedy(model, prompt: list[int], n_decode: int):
  """Prefill logits [n, V], greedy tokens [n_decode + 1], decode logits [n_decode, V]."""
  import torch
  import inspect
  key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
  with torch.no_grad():
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    prefill = out.logits[0].float().numpy()
    cache = out.past_key_values
    tokens = [int(np.argmax(prefill[-1]))]
    margins = [_margin(prefill[-1])]
    decode = []
    for _ in range(n_decode):
      out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{key: cache})
      cache = out.past_key_values
      logits = out.logits[0, -1].float().numpy()
      decode.append(logits)
      tokens.append(int(np.argmax(logits)))
      margins.append(_margin(logits))
  return prefill, np.array(tokens, np.int32), np.stack(decode), np.array(margins, np.float32)


def _margin(logits: np.ndarray) -> float:
  top2 = np.sort(np.partition(logits, -2)[-2:])
  return float(top2[1] - top2[0])


def record_case(name: str, case: dict) -> None:
  import torch
  import transformers
  cfg = case_config(case)
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "m.gguf")
    sha = write_case_file(case, path)
    sd = hf_state_dict(cfg, gguf_tensors(path))
  model = hf_model(cfg)
  load_state(model, sd)
  prefill, tokens, decode, margins = run_greedy(model, PROMPT, N_DECODE)
  out = os.path.join(HERE, f"transformers_{name}.npz")
  np.savez_compressed(
      out, case=json.dumps(dict(case, n_decode=N_DECODE)), file_sha256=sha,
      prompt=np.array(PROMPT, np.int32), prefill_logits=prefill.astype(np.float32),
      tokens=tokens, decode_logits=decode.astype(np.float32), margins=margins,
      versions=json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}))
  print(f"{name}: tokens {tokens.tolist()} min margin {margins.min():.3g} -> {out} "
        f"({os.path.getsize(out)} B)")


def record_rules() -> None:
  import torch
  from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
  rng = np.random.default_rng(2024)
  b, t, h, dk, dv = 2, 80, 4, 16, 8
  l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = (l2(rng.standard_normal((b, t, h, dk))) / np.sqrt(dk)).astype(np.float32)
  k = l2(rng.standard_normal((b, t, h, dk))).astype(np.float32)
  v = rng.standard_normal((b, t, h, dv)).astype(np.float32)
  g = rng.uniform(-0.6, 0, (b, t, h)).astype(np.float32)
  beta = rng.uniform(0, 1, (b, t, h)).astype(np.float32)
  S0 = (0.1 * rng.standard_normal((b, h, dk, dv))).astype(np.float32)
  T = torch.from_numpy
  # Our q is already scaled by dk^-0.5; the torch rules scale again, so undo it for them.
  args = (T(q * np.sqrt(dk)), T(k), T(v))
  oc, sc = m.torch_chunk_gated_delta_rule(*args, g=T(g), beta=T(beta), chunk_size=32,
                                          initial_state=T(S0), output_final_state=True)
  orr, sr = m.torch_recurrent_gated_delta_rule(*args, g=T(g), beta=T(beta), initial_state=T(S0),
                                               output_final_state=True)
  out = os.path.join(HERE, "gdn_rules.npz")
  np.savez_compressed(out, q=q, k=k, v=v, g=g, beta=beta, state=S0, o_chunk=oc.numpy(),
                      state_chunk=sc.numpy(), o_recurrent=orr.numpy(), state_recurrent=sr.numpy())
  print(f"rules -> {out} ({os.path.getsize(out)} B)")


def main(names: list[str]) -> None:
  sys.path.insert(0, ROOT)
  record_rules()
  for name in names or list(CASES):
    record_case(name, CASES[name])


if __name__ == "__main__":
  main(sys.argv[1:])
