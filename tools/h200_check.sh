#!/usr/bin/env bash
# One device call on the lent H200 that checks an integration before the sweep: the GPU kernel
# tests (matvec / fused / experts in "f32" and "q8", the grouped and tile kernels), the decode
# products' device times (tools/kernel_probe.py), generate's prefill and decode rates on the
# Qwen3.6-35B-A3B-shaped model (all in HBM), a 512-token prefill profile, and a short run of the
# offload sweep (the benchmark's GPU path). Logs come back under $OUT.
#   device run (carry .whl and the prebuilt extension): bash tools/h200_check.sh
set -uo pipefail
source tools/h200_build.sh
M=/tmp/jaxvt-qwen36-35b-a3b-shape.gguf
python3 -c "from jaxvt import synth; from jaxvt.model.presets import qwen36_35b_a3b_config as q; synth.write_model('$M', q(n_nextn=1), 'q4_k_m', seed=0)" &
synth_pid=$!
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=line tests/test_ffi_gpu.py tests/test_grouped_gpu.py \
  tests/test_gdn_step_gpu.py tests/test_attn_step_gpu.py \
  > "$OUT/gpu_tests_full.txt" 2>&1
tail -15 "$OUT/gpu_tests_full.txt" | tee "$OUT/gpu_tests.txt"
timeout 150 python3 tools/kernel_probe.py 2>&1 | tail -20 | tee "$OUT/kernel_probe.txt"
wait $synth_pid
timeout 200 python3 tools/gen_rates.py $M 2>&1 | tail -6 | tee "$OUT/generate.txt"
timeout 120 python3 -m jaxvt.bench profile --model $M --prefill --prompt 512 --top 12 2>&1 | tail -16 | tee "$OUT/profile_prefill512.txt"
timeout 150 python3 -m jaxvt.bench offload --time-limit 120 2>&1 | tail -30 | tee "$OUT/offload_smoke.txt"
