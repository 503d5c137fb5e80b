"""benchmarks.step_bytes: the bytes a decode step's kernels read (from the compiled HLO) and the
bytes a token must read (the roofline's numerator), against independent counts."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import step_bytes as sb


def test_shape_bytes_arrays_and_tuples():
  assert sb.shape_bytes("f32[2,3]{1,0}") == 24
  assert sb.shape_bytes("(f32[2,3]{1,0}, bf16[4]{0}, s32[])") == 24 + 8 + 4
  assert sb.shape_bytes("u8[40,1152]{1,0}") == 40 * 1152


def test_fusion_counts_the_slice_of_a_stack_not_the_stack():
  L, d = 40, 2048
  rng = np.random.default_rng(0)
  stack = jnp.asarray(rng.standard_normal((L, d), np.float32))
  x = jnp.asarray(rng.standard_normal(d, np.float32))

  def f(stack, i, x):
    return x * jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)

  reads = sb.hlo_read_bytes(jax.jit(f).lower(stack, 3, x).compile().as_text())
  total = sum(reads.values())
  assert total >= x.nbytes + stack.nbytes // L  # x and one row are read ...
  assert total < stack.nbytes  # ... the other 39 rows are not


def test_jaxvt_custom_call_counts_one_layer_and_the_routed_experts():
  E, stride = 256, 256 * 147456
  line = ("%cc = f32[1,8,512]{2,1,0} custom-call(f32[1,2048]{1,0} %x, u8[40," + str(stride) +
          "]{1,0} %d, u32[40,2]{1,0} %t, s32[40]{0} %f, s32[] %l, s32[1,8]{1,0} %ids), "
          'custom_call_target="jaxvt_qmatmul_experts", '
          "backend_config={cols = 2048 : i64, experts = 256 : i64, rows = 512 : i64}")
  reads = sb.hlo_read_bytes("ENTRY %main () -> f32[] {\n  " + line + "\n}\n")
  small = 2048 * 4 + 40 * 2 * 4 + 40 * 4 + 4 + 8 * 4
  assert reads == {"cc": small + stride // E * 8}
  dense = line.replace("jaxvt_qmatmul_experts", "jaxvt_qmatmul").replace("experts = 256", "")
  assert sb.hlo_read_bytes("ENTRY %main () -> f32[] {\n  " + dense + "\n}\n") == {
      "cc": small + stride}


def test_distinct_experts_matches_sampling():
  rng = np.random.default_rng(1)
  E, k = 256, 8
  assert sb.distinct_experts(E, k, 1) == k
  for rows in (2, 8):
    seen = [len({int(e) for _ in range(rows) for e in rng.choice(E, k, replace=False)})
            for _ in range(4000)]
    assert sb.distinct_experts(E, k, rows) == pytest.approx(np.mean(seen), rel=0.01)


def test_token_bytes_of_the_default_model_are_its_file_tensors():
  import gguf

  import jaxvt
  eng = jaxvt.load(max_context=64)
  tensors = gguf.GGUFReader(eng.path).tensors
  file_bytes = sum(int(t.n_bytes) for t in tensors)
  cache = eng.new_cache(1)
  tb = sb.token_bytes(eng.weights, cache, eng.cfg, rows=1, position=9)
  # tied embeddings: the head reads the whole table, so a token reads every tensor of the file
  assert eng.cfg.tied_embeddings
  assert tb["weights"] == pytest.approx(file_bytes, rel=0.02)
  kv = sum(a.nbytes for k, a in cache.items() if k in ("k", "v")) * 10 // 64
  assert tb["state"] == kv and tb["host"] == 0
  eng.close()


def test_fusions_inside_a_command_buffer_call_are_counted():
  """XLA:GPU moves runs of kernels into computations `call`ed as command buffers: their fusions
  are kernels too (a fused body is not), and a dynamic slice of a [40, 2048] stack reads a row."""
  hlo = """
%fused_computation (param_0: f32[40,2048], param_1: s32[]) -> f32[2048] {
  %param_0 = f32[40,2048]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = f32[1,2048]{1,0} dynamic-slice(%param_0, %param_1, %c), dynamic_slice_sizes={1,2048}
  ROOT %b = f32[2048]{0} bitcast(%ds)
}

%command_buffer (p0: f32[40,2048], p1: s32[]) -> f32[2048] {
  %p0 = f32[40,2048]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %slice_fusion = f32[2048]{0} fusion(%p0, %p1), kind=kLoop, calls=%fused_computation
}

ENTRY %main (a: f32[40,2048], i: s32[]) -> f32[2048] {
  %a = f32[40,2048]{1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %call = f32[2048]{0} call(%a, %i), to_apply=%command_buffer
}
"""
  reads = sb.hlo_read_bytes(hlo)
  assert reads["slice_fusion"] == 2048 * 4 + 4
  assert "ds" not in reads and "b" not in reads


def _entry(line: str) -> str:
  return "ENTRY %main () -> f32[] {\n  " + line + "\n}\n"


def test_operands_after_xlas_index_comments_keep_their_shapes():
  """XLA prints /*index=5*/ before every fifth operand; the operand is still the named one."""
  hlo = """
ENTRY %main (a: f32[8], b: f32[8], c: f32[8], d: f32[8], e: f32[8], f: f32[1000]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %c = f32[8]{0} parameter(2)
  %d = f32[8]{0} parameter(3)
  %e = f32[8]{0} parameter(4)
  %f = f32[1000]{0} parameter(5)
  ROOT %cc = f32[8]{0} custom-call(%a, %b, %c, %d, %e, /*index=5*/%f), custom_call_target="x"
}
"""
  assert sb.hlo_read_bytes(hlo) == {"cc": 5 * 8 * 4 + 1000 * 4}


def test_an_expert_ring_counts_nothing_and_slots_bound_the_experts():
  E, per = 4, 1000
  line = ("%cc = f32[3,2,16]{2,1,0} custom-call(f32[3,64]{1,0} %x, u8[2," + str(E * per) +
          "]{1,0} %d, u32[2,2]{1,0} %t, s32[2]{0} %f, s32[] %l, s32[3,2]{1,0} %ids, u8[" +
          str(E * per + 256) + "]{0} %ring), custom_call_target=\"jaxvt_qmatmul_experts\", "
          "backend_config={cols = 64 : i64, experts = 4 : i64, rows = 16 : i64}")
  small = 3 * 64 * 4 + 2 * 2 * 4 + 2 * 4 + 4 + 3 * 2 * 4
  distinct = E * (1 - (1 - 2 / E) ** 3)  # 3 rows of 2 slots over 4 experts, uniformly
  assert sb.hlo_read_bytes(_entry(line)) == {"cc": round(small + distinct * per)}
  # one id a row and more rows than experts: at most every expert once
  line = line.replace("s32[3,2]{1,0} %ids", "s32[9]{0} %ids")
  small += 9 * 4 - 3 * 2 * 4
  assert sb.hlo_read_bytes(_entry(line)) == {"cc": small + E * per}


def _qweight(fmts: list[int], rows: int, cols: int, experts: int):
  """A device-tier QWeight of zeros whose layers have the formats `fmts` (ggml type ids)."""
  import gguf

  from jaxvt.qweight import QMeta, QWeight
  size = [max(experts, 1) * rows * cols // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(f)][0]
          * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(f)][1] for f in fmts]
  L = len(fmts)
  meta = QMeta(rows=rows, cols=cols, experts=experts, formats=tuple(sorted(set(fmts))), n_layers=L)
  return QWeight(jnp.zeros((L, max(size)), jnp.uint8),
                 jnp.stack([jnp.arange(L, dtype=jnp.uint32), jnp.zeros(L, jnp.uint32)], 1),
                 jnp.asarray(fmts, jnp.int32), meta), size


def test_with_the_weights_each_layer_counts_in_its_own_format():
  """A down stack whose layers are Q4_K and Q6_K (llama.cpp's Q4_K_M does that): its stride is
  a Q6_K layer's; with the weights, a call counts the mean over the layers of k experts each in
  its layer's format, so a step's calls (one per layer) add up to the stack's routed bytes."""
  E, k, rows, cols = 16, 4, 256, 512
  w, size = _qweight([12, 14, 12, 12], rows, cols, E)  # Q4_K, Q6_K, Q4_K, Q4_K
  stride = w.data.shape[1]
  line = ("%cc = f32[1,4,256]{2,1,0} custom-call(f32[1,4,512]{2,1,0} %x, u8[4," + str(stride) +
          "]{1,0} %d, u32[4,2]{1,0} %t, s32[4]{0} %f, s32[] %l, s32[1,4]{1,0} %ids), "
          'custom_call_target="jaxvt_qmatmul_experts", '
          "backend_config={cols = 512 : i64, experts = 16 : i64, rows = 256 : i64}")
  small = 4 * 512 * 4 + 4 * 2 * 4 + 4 * 4 + 4 + 4 * 4
  assert sb.hlo_read_bytes(_entry(line)) == {"cc": small + k * stride // E}  # the widest layer
  mean = sum(size) / len(size)
  assert sb.hlo_read_bytes(_entry(line), {"moe.w_down": w}) == {"cc": round(small + k * mean / E)}


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
  from jaxvt import synth
  cfg = synth.tiny_config("qwen35moe", d_model=256, expert_ffn_dim=512, shared_ffn_dim=256)
  path = str(tmp_path_factory.mktemp("step_bytes") / "qwen35moe.gguf")
  synth.write_model(path, cfg, "q4_k_m", seed=2)
  return path


@pytest.mark.parametrize("rows", [1, 3])
def test_a_moe_decode_step_counts_routed_experts_and_embedding_rows(moe_file, rows):
  """The compiled decode step of a synthetic MoE file: each routed-experts call reads its
  operands and, of its stack, the distinct experts its rows route to (k for one row) at one
  expert's bytes; the embedding call the rows' ids' rows. Both against the file's tensors as
  gguf's reader sizes them."""
  import re

  import gguf

  import jaxvt
  from jaxvt import engine as eng_mod
  eng = jaxvt.load(moe_file, max_context=64)
  cfg = eng.cfg
  E, k, L, d, f = cfg.n_experts, cfg.n_experts_used, cfg.n_layers, cfg.d_model, cfg.expert_ffn_dim
  tensors = {t.name: t for t in gguf.GGUFReader(moe_file).tensors}
  expert = {stage: {int(t.n_bytes) // E for n, t in tensors.items() if f"ffn_{stage}_exps" in n}
            for stage in ("gate", "up", "down")}
  assert all(len(v) == 1 for v in expert.values())  # one format per stack in this file
  expert = {s: v.pop() for s, v in expert.items()}
  embed = tensors["token_embd.weight"]
  row = int(embed.n_bytes) // cfg.vocab_size

  cache = eng.new_cache(rows)
  toks = jnp.full((rows, 1), 7, jnp.int32)
  fn = eng_mod.decode_sample_fn.lower(
      eng.weights, cache, toks, jnp.full((rows, 1), 5, jnp.int32), jax.random.key(0),
      kv_len=eng.kv_len(16), cfg=cfg, ex=eng.ex, params=jaxvt.SamplingParams()).compile()
  hlo = fn.as_text()
  distinct = k if rows == 1 else E * (1 - (1 - k / E) ** rows)
  stack_small = L * 2 * 4 + L * 4 + 4  # table, fmts, layer
  for with_weights in (False, True):  # the stride's count, then each layer's format's
    reads = sb.hlo_read_bytes(hlo, eng.weights) if with_weights else sb.hlo_read_bytes(hlo)
    calls = collections.Counter()
    for line in hlo.splitlines():
      target = re.search(r'custom_call_target="(jaxvt_qmatmul_experts\w*|jaxvt_qembed)"', line)
      if not target:
        continue
      name = sb.parse_instruction(line)[0]
      if target.group(1) == "jaxvt_qembed":
        calls["embed"] += 1
        assert reads[name] == rows * 4 + rows * row + 2 * 4 + 4 + 4
        continue
      down = f"rows = {d} : i64" in line and f"cols = {f} : i64" in line
      x = rows * k * f * 4 if down else rows * d * 4
      stage = "down" if down else "gate"  # gate and up: one shape, one format here
      calls[stage] += 1
      want = x + stack_small + rows * k * 4 + distinct * expert[stage]
      assert reads[name] == round(want), (name, target.group(1))
    assert calls == {"embed": 1, "gate": 2 * L, "down": L}
  eng.close()


def test_token_bytes_of_a_moe_file_read_k_experts_and_one_embedding_row(moe_file):
  """A decode step's weights: every matrix of the file once, of a routed stack k of its experts
  (for one row), of the (untied) embedding the token's row; the F32 vectors as loaded."""
  import gguf

  import jaxvt
  from jaxvt import synth
  from jaxvt.qweight import QWeight
  eng = jaxvt.load(moe_file, max_context=64)
  cfg = eng.cfg
  assert not cfg.tied_embeddings
  tensors = {t.name: t for t in gguf.GGUFReader(moe_file).tensors}
  want = 0.0
  for spec in synth.plan(cfg, "q4_k_m"):
    if spec.kind != "matrix":
      continue
    share = 1.0
    if "_exps" in spec.name:
      share = cfg.n_experts_used / cfg.n_experts
    elif spec.name == "token_embd.weight":
      share = 1 / cfg.vocab_size
    want += int(tensors[spec.name].n_bytes) * share
  vectors = sum(a.nbytes for a in jax.tree_util.tree_leaves(
      {n: w for n, w in eng.weights.items() if not isinstance(w, QWeight)}))
  tb = sb.token_bytes(eng.weights, eng.new_cache(1), cfg, rows=1, position=9)
  assert tb["weights"] - vectors == pytest.approx(want, rel=1e-9)
  eng.close()
