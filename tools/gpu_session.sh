#!/usr/bin/env bash
# The GPU machine's runner: one mode a call, from the repository root, on a machine without
# network access. Logs (and docs/BENCHMARKS.md with the sections a mode wrote) come back under
# $OUT (default /tmp/out).
#
#   bash tools/gpu_session.sh build        # the CUDA extension (or the carried one) and llama-bench
#                                          # built in the background for a later `sweep`
#   bash tools/gpu_session.sh tests        # every GPU test file (pytest -m gpu); TESTS=... picks
#   bash tools/gpu_session.sh determinism  # the determinism GPU test: two processes, every budget
#   bash tools/gpu_session.sh sweep        # python -m benchmarks.offload with every llama.cpp arm
#   bash tools/gpu_session.sh tier         # python -m benchmarks.tier (host-tier read rates)
#   bash tools/gpu_session.sh profile      # decode-step profiles all in HBM, at auto and with every
#                                          # routed expert in the host tier; the first token; an
#                                          # 8192-token prompt at auto on the 16 GiB card
#   bash tools/gpu_session.sh step         # the decode step against its roofline, all in HBM, 1 and
#                                          # 8 rows (step_profile.txt), and again without command
#                                          # buffers: every kernel's bytes and GB/s (step_profile_ops.txt)
#   bash tools/gpu_session.sh ab           # a kernel change against the build before it: the
#                                          # matvec's bits (tools/same_bits.py), then the decode
#                                          # step all in HBM, 1 and 8 rows, the two builds taking
#                                          # turns (ab_profile_*.txt); AB_BASE: the earlier build
#   bash tools/gpu_session.sh turns        # python -m benchmarks.turns --write (a short next turn and
#                                          # 1 vs 8 rows through the expert cache, at 7 GiB)
#   bash tools/gpu_session.sh mesh         # python -m benchmarks.mesh (a machine with 2 GPUs)
#   bash tools/gpu_session.sh serve        # python -m benchmarks.serve against llama-server
#   bash tools/gpu_session.sh cache        # python -m benchmarks.cache (the expert cache) --write
#   bash tools/gpu_session.sh invariance   # python -m benchmarks.invariance --gpu --write: the
#                                          # default tuning row against --batch-invariant's
#
# What to carry to the machine (ignored by git):
#   .whl/          the gguf, starlette and uvicorn wheels (the machine has no PyPI): installed
#                  into /tmp/site
#   jaxvt/ffi/_jaxvt_ffi.cpython-312-x86_64-linux-gnu.so   the CUDA extension built elsewhere by
#                  tools/build_cuda_here.sh; used when it imports, sees the GPU and registers every
#                  GPU op of this checkout (else CMake builds one here: about 5 minutes;
#                  JAXVT_REBUILD=1 forces that)
#   .ab/           for `ab`: the earlier build's _jaxvt_ffi and _jaxvt_debug .so files (each may
#                  be xz-compressed, NAME.xz, to fit the carry)
#   .llama/        llama.cpp's source from the llama-cpp-python sdist, pruned (see
#                  tools/build_llamacpp.sh): llama-bench and llama-server for the llama.cpp arms
#
# Environment: OFFLOAD_S (the sweep's --time-limit, default 540: it must cover writing the
# 19 GiB model on a fresh machine and llama.cpp's 160 s besides the jaxvt arms), MESH_S (480),
# TESTS (test files for `tests`), AUTO_GB (auto's budget on the 16 GiB card for `profile`,
# which takes GiB, not "auto"; default 3.78). `cache`: CACHE_S (its --time-limit, default 540,
# which covers writing the files it uses on a fresh machine), CACHE_ARMS, CACHE_BUDGETS,
# CACHE_MODELS, CACHE_ROWS (its --arms, --budgets, --models, --rows), CACHE_MERGE=1 (--merge:
# this call's rows and an earlier call's). Everything takes two calls: CACHE_MODELS=realistic
# CACHE_ARMS=cache,predict, then CACHE_MODELS=high-locality,uniform CACHE_ARMS=cache,llama
# CACHE_MERGE=1. (realistic: routing calibrated to real LRU curves; high-locality: the earlier
# few-topic file, an upper bound for a cache; jaxvt.synth_routing.PRESETS.) `invariance`:
# INVARIANCE_S (its time limit, default 540).
set -uo pipefail
what=${1:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=/tmp/jaxvt-qwen36-35b-a3b-shape.gguf  # benchmarks.offload.MODEL, written once per machine
FRAC=0.1167  # XLA's pool at 16 GiB of an H200 (benchmarks.offload.pool_fraction): the 16 GiB card
LLAMA=/tmp/llama-build
GPU_TESTS="tests/test_ffi_gpu.py tests/test_grouped_gpu.py tests/test_attn_step_gpu.py
  tests/test_gdn_step_gpu.py tests/test_moe_route_gpu.py tests/test_prefetch_gpu.py
  tests/test_prefetch_experts_gpu.py tests/test_serve_gpu.py tests/test_expert_cache_gpu.py
  tests/test_batch_invariance_gpu.py tests/test_add_norm_gpu.py tests/test_swiglu_product_gpu.py"
t0=$(date +%s)

setup() {  # the carried gguf wheel on PYTHONPATH, then the extension (carried, else built)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
  # a carried build must register every GPU op of this checkout's op table and come with its
  # debug module
  if [ -z "${JAXVT_REBUILD:-}" ] && python3 -c "import re; from jaxvt.ffi import _jaxvt_ffi as e, _jaxvt_debug
assert e.gpu_device_count() > 0
ops = re.findall(r'(?m)^JAXVT_OP\((\w+), *\w+, *\w+, *(\w+),', open('jaxvt/ffi/csrc/handlers/ops.inc').read())
assert {t for t, gpu in ops if gpu != '0'} <= set(e.registrations().get(e.gpu_platform(), {}))" 2>/dev/null; then
    echo "prebuilt extension: $(ls jaxvt/ffi/_jaxvt_ffi*.so)"
  else
    local t=$(date +%s)
    cmake -S . -B /tmp/build -G Ninja -DJAXVT_GPU=CUDA -DJAXVT_CUDA_ARCHS=90 \
      -DPython_EXECUTABLE="$(which python3)" > "$OUT/build.log" 2>&1 &&
      cmake --build /tmp/build -j 16 >> "$OUT/build.log" 2>&1 &&
      cp /tmp/build/_jaxvt_ffi*.so /tmp/build/_jaxvt_debug*.so jaxvt/ffi/ || { tail -30 "$OUT/build.log"; exit 1; }
    echo "extension built in $(( $(date +%s) - t )) s"
  fi
}

start_llama() {  # llama.cpp built in the background; setsid: the build outlives this call
  if [ ! -x $LLAMA/bin/llama-server ] && [ ! -e $LLAMA/.building ] && [ -d .llama/llama.cpp ]; then
    mkdir -p $LLAMA && touch $LLAMA/.building  # benchmarks.offload_llama waits while it exists
    # from a copy: the next call's carry replaces .llama under a running build
    rm -rf /tmp/llama-src && cp -a .llama/llama.cpp /tmp/llama-src
    setsid nohup bash -c "LLAMA_SRC=/tmp/llama-src LLAMA_JOBS=10 nice -n 10 \
      bash tools/build_llamacpp.sh > /tmp/llama_build.log 2>&1; rm -f $LLAMA/.building" \
      > /dev/null 2>&1 < /dev/null &
    echo "llama.cpp: building in the background (/tmp/llama_build.log)"
  fi
}

model() {  # the 35B-shaped file, made once per machine
  python3 -c "from benchmarks.offload import ensure_model; ensure_model('$M', print)" > /dev/null
}

gpu_pytest() {  # gpu_pytest SECONDS LOG FILES...
  local s=$1 log=$2; shift 2
  timeout "$s" python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short "$@" \
    > "$OUT/$log" 2>&1; local rc=$?
  tail -8 "$OUT/$log"; return $rc
}

case "$what" in
  build|tests|determinism|sweep|tier|profile|step|ab|turns|mesh|serve|cache|invariance) setup ;;
  *) sed -n '2,51p' "$0"; exit 2 ;;
esac
case "$what" in
  build)
    start_llama ;;
  tests)
    gpu_pytest 540 gpu_tests.txt ${TESTS:-$GPU_TESTS} ;;
  determinism)
    gpu_pytest 540 determinism.txt tests/test_determinism_gpu.py ;;
  sweep)
    start_llama  # the sweep runs llama-bench last and waits for a build in progress
    python3 -m benchmarks.offload --time-limit ${OFFLOAD_S:-540} 2>&1 | tee "$OUT/offload.txt" |
      tail -40
    cp docs/offload_sweep.png /tmp/llama_build.log "$OUT/" 2>/dev/null ;;
  tier)
    timeout 300 python3 -m benchmarks.tier --total-mib 128 > "$OUT/tier.txt" 2>&1
    tail -32 "$OUT/tier.txt" ;;
  profile)
    model
    for b in 0 ${AUTO_GB:-3.78} 17; do  # all in HBM (the whole pool), auto, every routed expert
      f=$([ $b = 0 ] && echo 0.75 || echo $FRAC)
      XLA_PYTHON_CLIENT_MEM_FRACTION=$f timeout 150 python3 -m benchmarks.profile --model $M \
        --offload-gb $b $([ $b = 0 ] || echo --device-gb 16) --steps 16 --top 40 \
        > "$OUT/profile_$b.txt" 2>&1; head -3 "$OUT/profile_$b.txt"
    done
    timeout 150 python3 -m benchmarks.first_token --runs 3 --write -- --model $M --max-tokens 32 \
      > "$OUT/first_token.txt" 2>&1; tail -4 "$OUT/first_token.txt"
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 -m benchmarks.long_prompt --model $M \
      --tokens 8192 --device-gb 16 --write > "$OUT/long_prompt.txt" 2>&1
    tail -4 "$OUT/long_prompt.txt" ;;
  step)
    model
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 timeout 300 python3 -m benchmarks.profile --model $M \
      --offload-gb 0 --rows 1,8 --steps 16 --top ${STEP_TOP:-40} > "$OUT/step_profile.txt" 2>&1
    grep -E "^(model|rows|device|roofline)" "$OUT/step_profile.txt"
    # Kernels inside XLA's command buffers carry no hlo_op in the trace, so their bytes are
    # unknown there: the same profile without command buffers names every kernel's op.
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 \
      timeout 300 python3 -m benchmarks.profile --model $M --offload-gb 0 --rows 1,8 --steps 16 \
      --top ${STEP_TOP:-40} > "$OUT/step_profile_ops.txt" 2>&1
    grep -E "^(rows|device|roofline)" "$OUT/step_profile_ops.txt" ;;
  ab)
    base=${AB_BASE:-.ab}; mkdir -p /tmp/ab/base /tmp/ab/new
    for f in _jaxvt_ffi _jaxvt_debug; do
      n=$(basename jaxvt/ffi/$f.*.so)
      cp "jaxvt/ffi/$n" /tmp/ab/new/
      if [ -f "$base/$n.xz" ]; then xz -dc "$base/$n.xz" > "/tmp/ab/base/$n"
      elif [ -f "$base/$n" ]; then cp "$base/$n" /tmp/ab/base/
      else echo "ab: no earlier build in $base ($n or $n.xz): carry it"; exit 2; fi
    done
    use() { cp /tmp/ab/$1/*.so jaxvt/ffi/; }
    use base && python3 tools/same_bits.py write /tmp/ab/bits.npz
    use new && python3 tools/same_bits.py check /tmp/ab/bits.npz | tee "$OUT/ab_bits.txt"
    model
    for i in 1 2; do
      for v in base new; do
        use $v && XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 timeout 150 python3 -m benchmarks.profile \
          --model $M --offload-gb 0 --rows 1,8 --steps 16 > "$OUT/ab_profile_${v}_$i.txt" 2>&1
        echo "$v: $(grep -E '^rows' "$OUT/ab_profile_${v}_$i.txt" | cut -c1-60 | tr '\n' ' ')"
      done
    done
    use new ;;
  turns)
    python3 -m benchmarks.turns --budget ${TURNS_BUDGET:-7} --write 2>&1 | tee "$OUT/turns.txt" |
      tail -30 ;;
  serve)
    start_llama
    while [ -e $LLAMA/.building ]; do sleep 5; done  # a build in progress from an earlier call
    tail -2 /tmp/llama_build.log
    python3 -m benchmarks.serve --budgets ${SERVE_BUDGETS:-auto,7,hbm} --memory --write \
      --tokens ${SERVE_TOKENS:-128} \
      --time-limit ${SERVE_S:-500} 2>&1 | tee "$OUT/serve.txt" | tail -40 ;;
  cache)
    start_llama  # the llama.cpp arms run last and wait for a build in progress
    python3 -m benchmarks.cache --time-limit ${CACHE_S:-540} \
      --arms ${CACHE_ARMS:-cache,predict,llama} --budgets ${CACHE_BUDGETS:-auto,7,12,experts} \
      --models ${CACHE_MODELS:-realistic,high-locality,uniform} \
      --rows ${CACHE_ROWS:-/tmp/jaxvt-bench-cache-rows.json} \
      $([ -n "${CACHE_MERGE:-}" ] && echo --merge) --write 2>&1 | tee "$OUT/cache.txt" | tail -40
    cp /tmp/llama_build.log "$OUT/" 2>/dev/null ;;
  invariance)
    model
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 timeout ${INVARIANCE_S:-540} python3 -m benchmarks.invariance \
      --gpu --model $M --write 2>&1 | tee "$OUT/invariance.txt" | tail -14 ;;
  mesh)
    python3 -m benchmarks.mesh --time-limit ${MESH_S:-480} 2>&1 | tee "$OUT/mesh.txt" | tail -40 ;;
esac
cp docs/BENCHMARKS.md "$OUT/" 2>/dev/null
echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
echo "total $(( $(date +%s) - t0 )) s"
