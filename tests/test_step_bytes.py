"""benchmarks.step_bytes: the bytes a decode step's kernels read (from the compiled HLO) and the
bytes a token must read (the roofline's numerator), against independent counts."""

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
