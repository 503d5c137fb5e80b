#!/usr/bin/env bash
# Prefill on the lent H200 (issue #15): the grouped kernel's GPU tests, the products probe that
# sets layers.Products' crossovers, and the prefill profiles / timings of the 35B-shaped model.
# One part per device call (each fits the 10-minute limit; the machine stays warm between them):
#   bash tools/h200_prefill.sh tests      # GPU kernel tests (grouped + the existing ones)
#   bash tools/h200_prefill.sh dense      # python -m jaxvt.bench tier --products dense
#   bash tools/h200_prefill.sh experts    # python -m jaxvt.bench tier --products experts
#   bash tools/h200_prefill.sh prefill    # profiles of a 512- and a 12-token prefill; timings
#   bash tools/h200_prefill.sh long       # an 8k-token prompt at --offload-gb auto, 16 GiB card
# carry: .whl (the gguf wheel); the extension is rebuilt unless the carried one has every GPU op.
set -uo pipefail
what=${1:-tests}
source tools/h200_build.sh
M=/tmp/jaxvt-qwen36-35b-a3b-shape.gguf
t0=$(date +%s)
if [ "$what" = tests ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_gpu.py tests/test_ffi_gpu.py \
    2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
fi
if [ "$what" = dense ] || [ "$what" = experts ]; then
  timeout 570 python3 -m jaxvt.bench tier --products "$what" 2>&1 | tee "$OUT/products_$what.txt" | tail -40
fi
if [ "$what" = prefill ]; then
  [ -f "$M" ] || python3 -c "from jaxvt import synth; from jaxvt.model.presets import qwen36_35b_a3b_config as q; synth.write_model('$M', q(n_nextn=1), 'q4_k_m', seed=0)"
  for n in 512 12; do
    timeout 150 python3 -m jaxvt.bench profile --model "$M" --prefill --prompt $n --top 15 2>&1 \
      | tail -20 | tee "$OUT/profile_prefill_$n.txt"
  done
  timeout 200 python3 - "$M" <<'EOF' 2>&1 | tail -8 | tee "$OUT/prefill_timings.txt"
import sys, time
import numpy as np
import jaxvt
m = sys.argv[1]
ids = np.random.default_rng(0).integers(10, 240000, 8192).tolist()
with jaxvt.load(m, max_context=1024) as e:
  for n in (512, 16, 12):
    e.prefill(ids[:n])[0].block_until_ready()  # compile
    t = time.perf_counter()
    e.prefill(ids[:n])[0].block_until_ready()
    dt = time.perf_counter() - t
    print(f"all in HBM: warm prefill of {n} tokens {dt * 1e3:.1f} ms ({n / dt:.0f} tok/s)")
EOF
fi
if [ "$what" = long ]; then
  [ -f "$M" ] || python3 -c "from jaxvt import synth; from jaxvt.model.presets import qwen36_35b_a3b_config as q; synth.write_model('$M', q(n_nextn=1), 'q4_k_m', seed=0)"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.1167 timeout 500 python3 - "$M" <<'EOF' 2>&1 | tail -8 | tee "$OUT/prefill_8k.txt"
import sys
import numpy as np
import jaxvt
ids = np.random.default_rng(0).integers(10, 240000, 8192).tolist()
from jaxvt.bench.arms import no_stops
with no_stops(jaxvt.load(sys.argv[1], max_context=8448, offload_gb="auto", device_gb=16)) as e:
  print(e.plan.report())
  print(f"prefill chunk {e.prefill_chunk} tokens; XLA workspace {e.memory.workspace / 2**30:.2f} GiB")
  g = e.generate(ids, max_tokens=4)
  print(f"8192-token prompt: prefill {g.stats.prefill_seconds:.1f} s "
        f"({g.stats.prefill_tok_s:.0f} tok/s, compile included), tokens {g.tokens}")
EOF
fi
cp docs/BENCHMARKS.md "$OUT/" 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
