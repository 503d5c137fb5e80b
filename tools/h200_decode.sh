#!/usr/bin/env bash
# One device call on the lent H200 for decode work: build (or take the carried prebuilt
# extension), the GPU kernel tests, the device time of each decode product of the 35B shapes
# (tools/kernel_probe.py, with an ncu pass over the matvec kernels when ncu is there), then
# generate's prefill / decode rates on the Qwen3.6-35B-A3B-shaped model (all in HBM).
#   device run (carry .whl and the prebuilt extension): bash tools/h200_decode.sh [profile]
set -uo pipefail
source tools/h200_build.sh
M=/tmp/jaxvt-qwen36-35b-a3b-shape.gguf
python3 -c "from jaxvt import synth; from jaxvt.model.presets import qwen36_35b_a3b_config as q; synth.write_model('$M', q(n_nextn=1), 'q4_k_m', seed=0)" &
synth_pid=$!
timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ffi_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 120 python3 tools/kernel_probe.py 2>&1 | tail -14 | tee "$OUT/kernel_probe.txt"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  timeout 150 $NCU --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section LaunchStats --section Occupancy -k regex:qmatmul --launch-skip 2 --launch-count 4 \
    python3 tools/kernel_probe.py --layers 2 > "$OUT/ncu.txt" 2>&1
  grep -E "qmatmul|Duration|Throughput|Stall|Achieved Occupancy|Registers|Waves|Block Limit" "$OUT/ncu.txt" | head -80
fi
wait $synth_pid
timeout 150 python3 tools/gen_rates.py $M 2>&1 | tail -8 | tee "$OUT/generate.txt"
if [ "${1:-}" = profile ]; then
  timeout 150 python3 -m jaxvt.bench profile --model $M --prompt 64 --steps 16 --top 30 2>&1 | tail -34 | tee "$OUT/profile_decode.txt"
fi
