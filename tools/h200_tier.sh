#!/usr/bin/env bash
# The GPU tests, `python -m jaxvt.bench tier` (writes its docs/BENCHMARKS.md section) and a decode
# profile of the Qwen3.6-35B-A3B-shaped model, in one device call on the lent H200.
#   device run (carry .whl and the prebuilt extension): bash tools/h200_tier.sh
set -uo pipefail
source tools/h200_build.sh
# llama.cpp's llama-bench for the offload sweep's fourth arm, built in its own session so that it
# outlives this call on a machine kept warm for the next one (tools/h200_run.sh offload uses it).
if [ -d .llama/llama.cpp ] && [ ! -x /tmp/llama-build/bin/llama-bench ]; then
  mkdir -p /tmp/llama-build && touch /tmp/llama-build/.building
  setsid bash -c "LLAMA_JOBS=12 nice -n 19 bash tools/build_llamacpp.sh > /tmp/llama_build.log 2>&1; rm -f /tmp/llama-build/.building" < /dev/null > /dev/null 2>&1 &
fi
M=/tmp/jaxvt-qwen36-35b-a3b-shape.gguf
python3 -c "from jaxvt import synth; from jaxvt.model.presets import qwen36_35b_a3b_config as q; synth.write_model('$M', q(n_nextn=1), 'q4_k_m', seed=0)" &
synth_pid=$!
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ffi_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
wait $synth_pid
timeout 240 python3 -m jaxvt.bench tier --total-mib 128 > "$OUT/tier.txt" 2>&1; tail -30 "$OUT/tier.txt"
P="python3 -m jaxvt.bench profile --model $M --prompt 64 --steps 16 --top 12"
timeout 150 $P 2>&1 | tail -16 | tee "$OUT/profile_device.txt"
python3 -c "
import jaxvt, time, numpy as np
from jaxvt.bench import arms
e = arms.no_stops(jaxvt.load('$M', max_context=1024))
ids = np.random.default_rng(0).integers(10, 240000, 512).tolist()
e.generate(ids, max_tokens=3)
g = e.generate(ids, max_tokens=64)
print(f'all-device: prefill {g.stats.prefill_tok_s:.1f} tok/s (512 tokens), decode {g.stats.decode_tok_s:.1f} tok/s')
" 2>&1 | tail -2 | tee "$OUT/generate.txt"
cp docs/BENCHMARKS.md "$OUT/"
tail -3 /tmp/llama_build.log 2>/dev/null
