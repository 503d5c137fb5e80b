#!/usr/bin/env bash
# One device call on the lent H200 for decode work: build (or take the carried prebuilt
# extension), the GPU kernel tests, then on the Qwen3.6-35B-A3B-shaped model (all in HBM) the
# decode profile, generate's prefill / decode rates, and prefill profiles of a short and a long
# prompt. Logs come back under $OUT.
#   device run (carry .whl and the prebuilt extension): bash tools/h200_decode.sh
set -uo pipefail
source tools/h200_build.sh
M=/tmp/jaxvt-qwen36-35b-a3b-shape.gguf
python3 -c "from jaxvt.gguf import synth; synth.write_model('$M', synth.qwen36_35b_a3b_config(n_nextn=1), 'q4_k_m', seed=0)" &
synth_pid=$!
timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ffi_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
wait $synth_pid
timeout 150 python3 -m jaxvt.bench profile --model $M --prompt 64 --steps 16 --top 30 2>&1 | tail -34 | tee "$OUT/profile_decode.txt"
timeout 150 python3 tools/gen_rates.py $M 2>&1 | tail -8 | tee "$OUT/generate.txt"
timeout 120 python3 -m jaxvt.bench profile --model $M --prefill --prompt 16 --top 20 2>&1 | tail -24 | tee "$OUT/profile_prefill16.txt"
timeout 120 python3 -m jaxvt.bench profile --model $M --prefill --prompt 512 --top 12 2>&1 | tail -16 | tee "$OUT/profile_prefill512.txt"
