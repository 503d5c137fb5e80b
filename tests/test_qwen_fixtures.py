"""Synthetic GGUF fixtures (jaxvt.synth) and helpers shared by the Qwen block tests.

Tests here: the synthetic files round-trip through the reader, config and loader; they are
deterministic; their metadata and tensor list look like llama.cpp-converted files.

Helpers (imported by test_deltanet.py, test_moe.py, test_qwen_transformers.py, and the
in-model checks of test_attn_step.py, test_gdn_step.py, test_prefetch.py):
- `synth_file(dir, arch, recipe, seed, **cfg_overrides)` -> (cfg as read back, path)
- `MOE8`: the overrides of an 8-layer qwen35moe with 256-wide rows (K-quant blocks fit; two
  periods of the layer pattern, so a program's layer scan stays a loop)
- `np_tensors(path)` -> {GGUF name: float64 array} dequantized by gguf-py (independent of jaxvt)
- `device_weights(path, cfg)` -> the loader's {canonical name: QWeight | array}
- `kernel_modes()` -> pytest params of Exec: jnp references, and FFI kernels when built
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import gguf
import numpy as np
import pytest

from jaxvt import synth
from jaxvt.gguf.names import gguf_name
from jaxvt.gguf.reader import open_gguf
from jaxvt.model.config import from_gguf_metadata
from jaxvt.model.declare import declare

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))
import record_transformers  # noqa: E402  (its gguf-py dequantizer: the recordings' truth too)


# ---------------------------------------------------------------------------------------------
# Helpers

MOE8 = dict(d_model=256, expert_ffn_dim=256, shared_ffn_dim=256, n_layers=8)


def synth_file(directory, arch: str, recipe="f32", seed: int = 0, **overrides):
  cfg = synth.tiny_config(arch, **overrides)
  path = str(directory / f"{arch}-{recipe if isinstance(recipe, str) else 'custom'}-{seed}.gguf")
  synth.write_model(path, cfg, recipe, seed)
  read = from_gguf_metadata(open_gguf(path).metadata)
  return dataclasses.replace(read, tied_embeddings=cfg.tied_embeddings), path


def np_tensors(path: str) -> dict[str, np.ndarray]:
  return record_transformers.gguf_tensors(path, np.float64)


def kernel_modes() -> list:
  """Exec variants to run blocks under: the jnp references, plus the FFI kernels where built.
  Float64 references are the model in exact arithmetic, so blocks run in "f32" numerics (the
  default "ggml" numerics quantize activations as llama.cpp does: ~1e-2 relative)."""
  from jaxvt import ffi
  from jaxvt.model.layers import Exec
  modes = [pytest.param(Exec(kernels=False, numerics="f32"), id="ref")]
  if ffi.available("cpu"):
    modes.append(pytest.param(Exec(kernels=True, numerics="f32"), id="kernels"))
  return modes


def device_weights(path: str, cfg) -> dict:
  from jaxvt import loader
  m = loader.open_model(path)
  assert m.cfg == cfg
  return loader.place(m)


# ---------------------------------------------------------------------------------------------
# Tests of the synthetic files

@pytest.mark.parametrize("arch", synth.ARCHS)
def test_roundtrip_config_and_tensors(tmp_path, arch):
  nextn = 1 if arch.startswith("qwen35") else 0
  cfg = synth.tiny_config(arch, n_nextn=nextn)
  path = tmp_path / "m.gguf"
  written = synth.write_model(path, cfg, "mixed", seed=3)
  gf = open_gguf(str(path))
  back = from_gguf_metadata(gf.metadata)
  assert back.rms_eps == pytest.approx(cfg.rms_eps, rel=1e-6)  # stored as float32
  assert dataclasses.replace(back, rms_eps=cfg.rms_eps, bos_id=-1, eos_id=-1) == cfg
  # Every declared weight is there with its declared shape; the rest is the MTP block.
  expected = set()
  for d in declare(cfg):
    for layer in (d.layers if d.layers is not None else (None,)):
      name = gguf_name(arch, d.name, layer)
      expected.add(name)
      t = gf.tensors[name]
      assert math.prod(t.shape) == math.prod(d.shape), name
      if d.matrix:
        assert t.shape == d.shape, name
  extra = set(gf.tensors) - expected
  assert all(n.startswith(f"blk.{cfg.n_layers}.") for n in extra)
  assert bool(extra) == bool(nextn)
  assert set(written) == set(gf.tensors)
  for name, fmt in written.items():
    assert gguf.GGMLQuantizationType(gf.tensors[name].type_id).name == fmt


def test_qwen35moe_file_layout(tmp_path):
  """The names, shapes and keys llama.cpp's qwen35moe loader asks for (src/models/qwen35moe.cpp)."""
  cfg = synth.tiny_config("qwen35moe", n_nextn=1)
  path = tmp_path / "m.gguf"
  synth.write_model(path, cfg, "f32", seed=0)
  gf = open_gguf(str(path))
  md, T = gf.metadata, gf.tensors
  assert md["general.architecture"] == "qwen35moe"
  assert md["qwen35moe.block_count"] == 5 and md["qwen35moe.nextn_predict_layers"] == 1
  assert list(md["qwen35moe.rope.dimension_sections"]) == [2, 1, 1, 0]
  assert synth._rope_sections(64) == [11, 11, 10, 0]  # Qwen3.5/3.6 files
  assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
  assert len(md["tokenizer.ggml.tokens"]) == cfg.vocab_size
  d, nv, dv, nk, dk = 64, 4, 16, 2, 16
  conv_dim = 2 * nk * dk + nv * dv
  assert T["blk.0.attn_qkv.weight"].shape == (conv_dim, d)
  assert T["blk.0.ssm_conv1d.weight"].shape == (conv_dim, 4)
  assert T["blk.0.ssm_a"].shape == (nv,) and T["blk.0.ssm_dt.bias"].shape == (nv,)
  assert np.all(np.asarray(T["blk.0.ssm_a"].data) < 0)
  assert T["blk.3.attn_q.weight"].shape == (2 * 4 * 32, d)  # per head [q | gate]
  assert T["blk.3.post_attention_norm.weight"].shape == (d,)
  assert T["blk.0.ffn_gate_exps.weight"].shape == (8, 32, d)
  assert T["blk.0.ffn_down_exps.weight"].shape == (8, d, 32)
  assert T["blk.0.ffn_gate_inp_shexp.weight"].shape == (d,)
  assert T["blk.4.nextn.eh_proj.weight"].shape == (d, 2 * d)
  for n in ("enorm", "hnorm", "shared_head_norm"):
    assert f"blk.4.nextn.{n}.weight" in T
  assert "blk.4.attn_q.weight" in T and "blk.4.ssm_a" not in T


def test_deterministic_and_thread_independent(tmp_path):
  cfg = synth.tiny_config("qwen35moe", d_model=256, expert_ffn_dim=256, shared_ffn_dim=256)
  a, b, c = (tmp_path / f"{n}.gguf" for n in "abc")
  synth.write_model(a, cfg, "q4_k_m", seed=7, threads=1)
  synth.write_model(b, cfg, "q4_k_m", seed=7, threads=2)
  synth.write_model(c, cfg, "q4_k_m", seed=8, threads=2)
  assert a.read_bytes() == b.read_bytes()
  assert a.read_bytes() != c.read_bytes()
  types_ = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(a)).tensors}
  assert types_["blk.0.ffn_gate_exps.weight"] == "Q4_K"
  assert types_["blk.0.attn_qkv.weight"] == "Q6_K"
  assert types_["blk.0.ffn_gate_inp.weight"] == "F32"


def test_weights_are_sane(tmp_path):
  """Matrices have std ~ 1/sqrt(cols) in every format; norms ~1; decays in (0, 1)."""
  cfg = synth.tiny_config("qwen35moe", d_model=256, expert_ffn_dim=256, shared_ffn_dim=256)
  path = tmp_path / "m.gguf"
  synth.write_model(path, cfg, "mixed", seed=1)
  W = np_tensors(str(path))
  for name, x in W.items():
    assert np.all(np.isfinite(x)), name
    if name.endswith("_exps.weight") or name.endswith("attn_qkv.weight"):
      assert x.std() == pytest.approx(1 / math.sqrt(x.shape[-1]), rel=0.3), name
  assert abs(W["output_norm.weight"].mean() - 1) < 0.05
  a = W["blk.0.ssm_a"]
  assert np.all((a < 0) & (a > -1.01))


def test_vocab_is_valid_bpe():
  v = synth.build_vocab(320)
  assert len(v.tokens) == 320 == len(v.types)
  assert len(set(v.tokens)) == 320
  known = set(v.tokens)
  for m in v.merges:
    a, b = m.split(" ")
    assert a in known and b in known and a + b in known
  assert v.tokens[v.eos_id] == "<|im_end|>" and v.tokens[v.bos_id] == "<|endoftext|>"
  with pytest.raises(ValueError):
    synth.build_vocab(200)


def test_plan_of_real_size_model():
  """The Qwen3.6-35B-A3B plan: 41 blocks (40 + MTP) of Q4_K routed experts, 17.3 GiB; file ~19 GiB."""
  from jaxvt.gguf.quants import FORMATS
  from jaxvt.model.presets import qwen36_35b_a3b_config
  cfg = qwen36_35b_a3b_config()
  specs = synth.plan(cfg, "q4_k_m")
  size = lambda s: math.prod(s.shape) // FORMATS[s.type_id].block_elems * FORMATS[
      s.type_id].block_bytes
  experts = sum(size(s) for s in specs if "_exps" in s.name)
  total = sum(size(s) for s in specs)
  assert experts == 41 * 3 * 256 * 512 * 2048 // 256 * 144
  assert 18.5 < total / 2**30 < 20
  assert sum(1 for s in specs if s.name.startswith("blk.40.")) > 10  # the MTP block


def test_config_prefers_recurrent_layers_array():
  """Newer converters write `{arch}.attention.recurrent_layers` (MTP blocks included, False);
  llama.cpp prefers it to full_attention_interval, and so does from_gguf_metadata."""
  md = {"general.architecture": "qwen35moe", "qwen35moe.block_count": 5,
        "qwen35moe.nextn_predict_layers": 1, "qwen35moe.embedding_length": 64,
        "qwen35moe.attention.head_count": 4, "qwen35moe.vocab_size": 320,
        "qwen35moe.full_attention_interval": 4, "qwen35moe.ssm.conv_kernel": 4,
        "qwen35moe.ssm.state_size": 16, "qwen35moe.ssm.group_count": 2,
        "qwen35moe.ssm.time_step_rank": 4, "qwen35moe.ssm.inner_size": 64,
        "qwen35moe.attention.recurrent_layers": [True, False, True, False, False]}
  assert from_gguf_metadata(md).layer_types == ("deltanet", "attention") * 2
  del md["qwen35moe.attention.recurrent_layers"]
  assert from_gguf_metadata(md).layer_types == ("deltanet",) * 3 + ("attention",)
