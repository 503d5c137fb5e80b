#!/usr/bin/env bash
# The device calls of one session on the lent H200 (carry .whl, .llama and the prebuilt
# extension), back to back on one warm machine:
#   bash tools/h200_session.sh checks   # llama-bench built in the background (setsid: it outlives
#                                       # the call), the tile kernels' GPU tests and diagnosis,
#                                       # determinism's cost, the 35B first token cold and
#                                       # cached, auto on the emulated 16 GiB card at the default
#                                       # context, an 8k-token prompt there
#   bash tools/h200_session.sh verify   # the GPU kernel tests, the decode products alone
#                                       # (tools/kernel_probe.py) and the determinism test
#   bash tools/h200_session.sh profile  # device-time profiles of the goals still missed, and
#                                       # tools/prefill_rules.py in HBM and from the host tier
#   bash tools/h200_session.sh ab       # this build against .dev/prev's, side by side
#   bash tools/h200_session.sh abn      # builds side by side (.dev/ab/NAME.so): the matvec GPU
#                                       # tests, each decode product alone, a decode step
#   bash tools/h200_session.sh verify2  # the matvec and grouped GPU tests, the tier bench
#   bash tools/h200_session.sh waves    # the decode products by grid size; command buffers
#   bash tools/h200_session.sh final    # (or step) the fused ops' tests, the attention probe, a decode
#                                       # step, determinism (llama-bench built for the sweep)
#   bash tools/h200_session.sh probe    # a host layer's read on a second stream, the file's
#                                       # read rate, generate's decode rate, the first token
#   bash tools/h200_session.sh last     # the staged load's GPU tests, the first token, determinism
#                                       # (llama-bench built for the sweep's call)
#   bash tools/h200_session.sh loadtime # a load's timeline (tools/load_timeline.py), first token
#   bash tools/h200_session.sh flags    # the loader's GPU tests; a decode step under XLA flags
#   bash tools/h200_session.sh first    # the 35B first token, cold and cached
#   bash tools/h200_session.sh prefetch # the prefetch ops' GPU tests; prefill with host-tier
#                                       # expert layers copied ahead and read in place
#                                       # (tools/prefill_rate.py) in HBM, at auto and with every
#                                       # routed expert in the host tier on the 16 GiB card
#   bash tools/h200_session.sh ws       # prefill's workspace at auto (XLA's buffer assignment)
#   bash tools/h200_session.sh closing  # llama-bench built for the sweep's call; the prefetch and
#                                       # loader GPU tests, determinism, prefill at auto
#   bash tools/h200_session.sh split    # auto's prefill on the whole pool; prefill profiles
#   bash tools/h200_session.sh slop     # prefill at auto with XLA's memory limit lifted
#   bash tools/h200_session.sh store    # llama-bench built in the background; test_exports on the
#                                       # GPU; the first token with and without the export store;
#                                       # then the sweep, all in one call
#   bash tools/h200_session.sh slop2    # prefill at the sweep's auto (3.5008 GiB and auto, context
#                                       # 648), XLA's default memory limit and slop 100; a decode
#                                       # profile all in HBM
#   bash tools/h200_session.sh even     # llama-bench built for the sweep's call; the prefetch and
#                                       # loader GPU tests; prefill at auto on the 16 GiB card, and
#                                       # auto's budget with 2 GiB more card and on the whole pool
#   bash tools/h200_session.sh where    # prefill at the sweep's auto budget (B=3.5008): its rate,
#                                       # profiles there and all in HBM
#   bash tools/h200_session.sh take     # llama-bench built for the sweep's call; the prefetch and
#                                       # loader GPU tests; prefill all in HBM and at auto on the
#                                       # 16 GiB card with this build and with .dev/prev's (carry
#                                       # both); a build that fails its tests gives way to prev's
#   bash tools/h200_session.sh onecall  # llama-bench built in the background; the prefetch GPU
#                                       # tests (a build that fails them gives way to .dev/prev's);
#                                       # an 8192-token prompt at auto on the 16 GiB card; then the
#                                       # sweep, all in one call
#   bash tools/h200_session.sh check    # the prefetch GPU tests; prefill all in HBM and at auto on
#                                       # the 16 GiB card with this build and .dev/prev's (carry
#                                       # both); an 8192-token prompt at auto on the 16 GiB card
#   bash tools/h200_session.sh det      # the determinism GPU test (llama-bench built beside it;
#                                       # TESTS: GPU test files run before it)
#   bash tools/h200_session.sh scale    # llama-bench built beside it; the expert-ring and prefetch
#                                       # GPU tests; decode at SCALE_GB (7) with the predicted
#                                       # count as given and scaled per layer (SCALE_V); the
#                                       # determinism GPU test
#   bash tools/h200_session.sh close    # #14's last records: the tier bench, then the decode
#                                       # step's profile all in HBM, at auto and at 17 GiB
#   bash tools/h200_session.sh small    # the expert-ring GPU tests; the first token of a model of
#                                       # the default model's size (tools/small_model.py), cold
#                                       # and cached
#   bash tools/h200_session.sh rings    # the prefetch GPU tests; prefill with one ring a stack
#                                       # and two taking adjacent host-tier layers in turns
#                                       # (tools/prefill_rate.py --rings 2): every routed expert in
#                                       # the host tier, 12 GiB, auto's bytes as down stacks only
#   bash tools/h200_session.sh predict  # llama-bench built in the background; the expert-ring
#                                       # and prefetch GPU tests; decode with the next host-tier
#                                       # layer's likeliest experts copied ahead, by how many
#                                       # (tools/predict_rate.py), every routed expert in the host
#                                       # tier and at auto, on the 16 GiB card
#   bash tools/h200_session.sh predict2 # decode profiles with every routed expert in the host tier,
#                                       # predicting off / on (one and two ring sets); the decode
#                                       # rates by variant there and at auto (RATES=0: not these;
#                                       # TESTS, RING_V, HITS_V: GPU tests and probes first;
#                                       # HBM_V: variants with everything in HBM last)
#   bash tools/h200_session.sh sweep    # the offload sweep with the llama.cpp arm (same run;
#                                       # OFFLOAD_S: its --time-limit, which must cover the
#                                       # model's creation on a fresh machine and llama.cpp's
#                                       # 160 s besides the jaxvt arms: 380 or more)
# Logs come back under $OUT.
set -uo pipefail
what=${1:-checks}
source tools/h200_build.sh
M=/tmp/jaxvt-qwen36-35b-a3b-shape.gguf
FRAC=0.1167  # XLA's pool at 16 GiB of the H200 (jaxvt.bench.offload.pool_fraction)
t0=$(date +%s)
model() { python3 -c "from jaxvt.bench.offload import ensure_model; ensure_model('$M', print)" > /dev/null; }  # the 35B-shaped file, made once per machine
start_llama() {  # llama-bench built in the background; setsid: the build outlives this call
  if [ ! -x /tmp/llama-build/bin/llama-bench ] && [ ! -e /tmp/llama-build/.building ] &&
     [ -d .llama/llama.cpp ]; then
    mkdir -p /tmp/llama-build && touch /tmp/llama-build/.building
    # from a copy: the next call's carry replaces .llama under a running build (2026-12-03, 17:20:
    # ggml-common.h vanished mid-build and llama-bench never built)
    rm -rf /tmp/llama-src && cp -a .llama/llama.cpp /tmp/llama-src
    setsid nohup bash -c "LLAMA_SRC=/tmp/llama-src LLAMA_JOBS=10 nice -n 10 bash tools/build_llamacpp.sh > /tmp/llama_build.log 2>&1;
      rm -f /tmp/llama-build/.building" > /dev/null 2>&1 < /dev/null &
    echo "llama-bench: building in the background"
  fi
}
if [ "$what" = checks ]; then
  start_llama
  timeout 100 python3 tools/grouped_diag.py > "$OUT/grouped_diag.txt" 2>&1
  echo "diag exit $?"; grep -v ": ok (" "$OUT/grouped_diag.txt" | head -40
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_grouped_gpu.py \
    > "$OUT/grouped_tests.txt" 2>&1
  tail -3 "$OUT/grouped_tests.txt"
  model
  timeout 130 python3 -m jaxvt.bench determinism --model $M --cost-only --prompt 512 --tokens 128 \
    --repeats 3 > "$OUT/determinism_cost.txt" 2>&1; tail -12 "$OUT/determinism_cost.txt"
  timeout 150 python3 tools/first_token.py --runs 2 -- --model $M --max-tokens 32 \
    > "$OUT/first_token.txt" 2>&1; tail -12 "$OUT/first_token.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 80 python3 -m jaxvt.run --model $M --offload-gb auto \
    --device-gb 16 --max-tokens 16 > "$OUT/auto16.txt" 2>&1; echo "auto16 exit $?"; tail -8 "$OUT/auto16.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 100 python3 tools/long_prompt.py --model $M \
    --tokens 8192 --device-gb 16 > "$OUT/long_prompt.txt" 2>&1; echo "long exit $?"; tail -8 "$OUT/long_prompt.txt"
  echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
fi
if [ "$what" = verify ]; then  # the GPU kernel tests, each decode product alone, then
  # determinism (processes x budgets)
  start_llama
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_ffi_gpu.py \
    tests/test_grouped_gpu.py > "$OUT/gpu_tests.txt" 2>&1; tail -8 "$OUT/gpu_tests.txt"
  timeout 90 python3 tools/kernel_probe.py --modes q8 > "$OUT/kernel_probe.txt" 2>&1
  cat "$OUT/kernel_probe.txt"
  timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_determinism_gpu.py > "$OUT/determinism.txt" 2>&1; tail -8 "$OUT/determinism.txt"
fi
if [ "$what" = profile ]; then  # where the missed goals' time goes: a warm 16-token prefill
  # (#15: 0.33x llama-bench -p 16), 512 tokens at auto's budget on the 16 GiB card (#15: 0.55x of
  # all in HBM), and a decode step all in HBM (#14: 0.68x)
  model
  timeout 150 python3 -m jaxvt.bench profile --model $M --prefill --prompt 16 > "$OUT/profile_prefill16.txt" 2>&1
  tail -30 "$OUT/profile_prefill16.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 -m jaxvt.bench profile --model $M --prefill \
    --prompt 512 --offload-gb 3.5 --device-gb 16 > "$OUT/profile_prefill512_auto.txt" 2>&1
  tail -30 "$OUT/profile_prefill512_auto.txt"
  timeout 150 python3 -m jaxvt.bench profile --model $M --steps 8 > "$OUT/profile_decode.txt" 2>&1
  tail -30 "$OUT/profile_decode.txt"
  timeout 200 python3 tools/prefill_rules.py $M > "$OUT/prefill_rules.txt" 2>&1
  cat "$OUT/prefill_rules.txt"
  # the same rules with every routed expert in the host tier (GROUPED_SLOTS' other side)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 240 python3 tools/prefill_rules.py $M \
    --offload-gb 16.88 --device-gb 16 > "$OUT/prefill_rules_host.txt" 2>&1
  cat "$OUT/prefill_rules_host.txt"
fi
if [ "$what" = final ] || [ "$what" = step ]; then  # the fused ops' GPU tests, the attention
  # step alone, a decode step's profile, determinism; llama-bench built for the sweep's call
  start_llama
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short ${TESTS:-tests/test_attn_step_gpu.py \
    tests/test_gdn_step_gpu.py tests/test_moe_route_gpu.py} > "$OUT/gpu_tests.txt" 2>&1; tail -8 "$OUT/gpu_tests.txt"
  timeout 90 python3 tools/attn_probe.py --positions 100,600,2000,8000 > "$OUT/attn_probe.txt" 2>&1
  tail -12 "$OUT/attn_probe.txt"
  model
  timeout 100 python3 -m jaxvt.bench profile --model $M --steps 8 --top 60 > "$OUT/profile_decode.txt" 2>&1
  head -40 "$OUT/profile_decode.txt"
  timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_determinism_gpu.py > "$OUT/determinism.txt" 2>&1; tail -8 "$OUT/determinism.txt"
  echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
fi
if [ "$what" = kernels ]; then  # every GPU kernel test, then the decode products and a step
  start_llama
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_ffi_gpu.py \
    tests/test_grouped_gpu.py tests/test_moe_route_gpu.py tests/test_gdn_step_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -15 "$OUT/gpu_tests.txt"
  what=diagnose
fi
if [ "$what" = diagnose ]; then  # where the decode step's time goes: each product alone, and
  # every kernel of a step (all names) with the decode program's optimized HLO to name them
  model
  timeout 120 python3 tools/kernel_probe.py --modes q8 > "$OUT/kernel_probe.txt" 2>&1
  cat "$OUT/kernel_probe.txt"
  XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=.*decode.*" timeout 150 \
    python3 -m jaxvt.bench profile --model $M --steps 8 --top 400 > "$OUT/profile_decode.txt" 2>&1
  head -60 "$OUT/profile_decode.txt"
  mkdir -p "$OUT/hlo"; cp /tmp/hlo/*after_optimizations.txt "$OUT/hlo/" 2>/dev/null
  ls -la "$OUT/hlo" | head
fi
if [ "$what" = ab ]; then  # this build against the one in .dev/prev (carry both), side by side:
  # the GPU kernel tests, each decode product alone, a decode step all in HBM and with every
  # routed expert in the host tier
  SO=jaxvt/ffi/_jaxvt_ffi.cpython-312-x86_64-linux-gnu.so
  cp $SO /tmp/new.so
  timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    ${TESTS:-tests/test_ffi_gpu.py tests/test_grouped_gpu.py} > "$OUT/gpu_tests.txt" 2>&1
  tail -12 "$OUT/gpu_tests.txt"
  model
  for v in new old; do
    if [ $v = new ]; then cp /tmp/new.so $SO; else cp .dev/prev/$(basename $SO) $SO; fi
    timeout 90 python3 tools/kernel_probe.py --modes q8 > "$OUT/kernel_probe_$v.txt" 2>&1
    timeout 100 python3 -m jaxvt.bench profile --model $M --steps 8 --top 40 > "$OUT/profile_decode_$v.txt" 2>&1
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 -m jaxvt.bench profile --model $M --steps 8 \
      --top 40 --offload-gb 16.88 --device-gb 16 > "$OUT/profile_decode_host_$v.txt" 2>&1
    echo "== $v"; grep -v "^ *$" "$OUT/kernel_probe_$v.txt" | tail -14
    grep -i "ms/step\|per step\|tok/s" "$OUT/profile_decode_$v.txt" "$OUT/profile_decode_host_$v.txt" | head -8
  done
  cp /tmp/new.so $SO
fi
if [ "$what" = abn ]; then  # #14: builds side by side (carry AB=.dev/ab: NAME.so each): the
  # matvec GPU tests with this build (TESTS_S=0: none), then per build each decode product alone and a decode step all in
  # HBM (HOSTS: the builds also profiled with every routed expert in the host tier)
  SO=jaxvt/ffi/_jaxvt_ffi.cpython-312-x86_64-linux-gnu.so
  cp $SO /tmp/new.so
  if [ "${TESTS_S:-200}" != 0 ]; then
    timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
      ${TESTS:-tests/test_ffi_gpu.py} > "$OUT/gpu_tests.txt" 2>&1
    tail -12 "$OUT/gpu_tests.txt"
  fi
  model
  for f in ${AB:-.dev/ab}/*.so; do
    v=$(basename $f .so); cp $f $SO
    timeout 90 python3 tools/kernel_probe.py --modes q8 > "$OUT/kernel_probe_$v.txt" 2>&1
    timeout 100 python3 -m jaxvt.bench profile --model $M --steps 8 --top 40 > "$OUT/profile_decode_$v.txt" 2>&1
    echo "== $v"; grep -v "^ *$" "$OUT/kernel_probe_$v.txt" | tail -14
    grep -i "ms/step\|per step\|tok/s" "$OUT/profile_decode_$v.txt" | head -4
    if [[ " ${HOSTS:-} " == *" $v "* ]]; then
      XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 -m jaxvt.bench profile --model $M --steps 8 \
        --top 40 --offload-gb 16.88 --device-gb 16 > "$OUT/profile_decode_host_$v.txt" 2>&1
      grep -i "ms/step\|per step\|tok/s" "$OUT/profile_decode_host_$v.txt" | head -4
    fi
  done
  cp /tmp/new.so $SO
fi
if [ "$what" = verify2 ]; then  # #14: this build's matvec and grouped GPU tests, then the tier
  # bench (host-read rates; its docs/BENCHMARKS.md section comes back in $OUT)
  timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_ffi_gpu.py tests/test_grouped_gpu.py > "$OUT/gpu_tests.txt" 2>&1
  tail -12 "$OUT/gpu_tests.txt"
  timeout 240 python3 -m jaxvt.bench tier --total-mib 128 > "$OUT/tier.txt" 2>&1; tail -32 "$OUT/tier.txt"
  cp docs/BENCHMARKS.md "$OUT/"
fi
if [ "$what" = waves ]; then  # each decode product alone with grids of 1, 2, 4, 8 waves of
  # resident blocks; a decode step with XLA's defaults and with command buffers over loops
  model
  for w in ${WAVES:-1 2 4 8}; do
    timeout 90 python3 tools/kernel_probe.py --modes q8 --waves $w > "$OUT/kernel_probe_w$w.txt" 2>&1
    grep -v "^ *$" "$OUT/kernel_probe_w$w.txt" | tail -12
  done
  timeout 100 python3 -m jaxvt.bench profile --model $M --steps 8 --top 30 > "$OUT/profile_decode.txt" 2>&1
  head -3 "$OUT/profile_decode.txt"
  XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL \
    timeout 100 python3 -m jaxvt.bench profile --model $M --steps 8 --top 30 > "$OUT/profile_decode_cmdbuf.txt" 2>&1
  head -3 "$OUT/profile_decode_cmdbuf.txt"
fi
if [ "$what" = probe ]; then  # a host layer's read on XLA's second stream beside compute; the
  # file's read rate; generate's decode rate against one call at a time; the first token, cold
  # and cached, with each program's compile log (JAX_LOG_COMPILES, in $OUT/ft.tgz)
  start_llama
  timeout 60 python3 tools/stream_probe.py > "$OUT/stream_probe.txt" 2>&1; cat "$OUT/stream_probe.txt"
  XLA_FLAGS=--xla_gpu_experimental_stream_annotation=true timeout 60 python3 tools/stream_probe.py \
    > "$OUT/stream_probe_annot.txt" 2>&1; tail -4 "$OUT/stream_probe_annot.txt"
  model
  timeout 100 python3 tools/read_probe.py $M --gib 8 --threads 1,4,8,16 > "$OUT/read_probe.txt" 2>&1
  cat "$OUT/read_probe.txt"
  timeout 120 python3 tools/decode_rate.py --model $M > "$OUT/decode_rate.txt" 2>&1; tail -2 "$OUT/decode_rate.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 120 python3 tools/decode_rate.py --model $M --offload-gb auto \
    --device-gb 16 > "$OUT/decode_rate_auto.txt" 2>&1; tail -2 "$OUT/decode_rate_auto.txt"
  JAX_LOG_COMPILES=1 timeout 150 python3 tools/first_token.py --runs 2 --stderr-dir /tmp/ft -- \
    --model $M --max-tokens 32 > "$OUT/first_token.txt" 2>&1; tail -8 "$OUT/first_token.txt"
  tar czf "$OUT/ft.tgz" -C /tmp ft
fi
if [ "$what" = last ]; then  # the staged load's GPU tests, the first token cold and cached, the
  # determinism test (generate's decode calls pipelined); llama-bench built for the sweep's call
  start_llama
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_load_pipeline.py \
    > "$OUT/load_tests_gpu.txt" 2>&1; tail -3 "$OUT/load_tests_gpu.txt"
  model
  timeout 150 python3 tools/first_token.py --runs 3 -- --model $M --max-tokens 32 \
    > "$OUT/first_token.txt" 2>&1; tail -8 "$OUT/first_token.txt"
  timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_determinism_gpu.py > "$OUT/determinism.txt" 2>&1; tail -8 "$OUT/determinism.txt"
  echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
fi
if [ "$what" = loadtime ]; then  # where a load's time goes (cold, then from the compilation
  # cache), and the first token, cold and cached
  model
  for r in 1 2; do
    timeout 90 python3 tools/load_timeline.py --model $M --warm --cache /tmp/lt-cache \
      > "$OUT/load_timeline_$r.txt" 2>&1; cat "$OUT/load_timeline_$r.txt" | head -20
  done
  timeout 150 python3 tools/first_token.py --runs 3 -- --model $M --max-tokens 32 \
    > "$OUT/first_token.txt" 2>&1; tail -8 "$OUT/first_token.txt"
fi
if [ "$what" = flags ]; then  # the loader's GPU tests; a decode step under XLA fusion flags
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_load_pipeline.py \
    > "$OUT/load_tests_gpu.txt" 2>&1; tail -3 "$OUT/load_tests_gpu.txt"
  model
  for f in "" ${FLAGS:---xla_gpu_experimental_enable_triton_softmax_priority_fusion=true \
      --xla_gpu_experimental_enable_triton_heroless_priority_fusion=true \
      --xla_gpu_experimental_enable_fusion_block_level_rewriter=true \
      --xla_gpu_experimental_all_fusions_with_triton=true}; do
    XLA_FLAGS="$f" timeout 60 python3 -m jaxvt.bench profile --model $M --steps 16 --top 12 \
      > /tmp/prof.txt 2>&1; echo "== ${f:-defaults}"; head -2 /tmp/prof.txt | cut -c1-220
    grep -i "error" /tmp/prof.txt | head -2 | cut -c1-200
  done
fi
if [ "$what" = first ]; then  # the 35B file's first token, cold and from the compilation cache
  # (the pipelined load), auto on the emulated 16 GiB card, the loader's tests on the GPU
  model
  timeout 150 python3 tools/first_token.py --runs ${FT_RUNS:-3} -- --model $M --max-tokens 32 \
    > "$OUT/first_token.txt" 2>&1; tail -8 "$OUT/first_token.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 70 python3 -m jaxvt.run --model $M --offload-gb auto \
    --device-gb 16 --max-tokens 16 > "$OUT/auto16.txt" 2>&1; echo "auto16 exit $?"; tail -6 "$OUT/auto16.txt"
  timeout 60 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_load_pipeline.py \
    > "$OUT/load_tests.txt" 2>&1; tail -4 "$OUT/load_tests.txt"
fi
if [ "$what" = prefetch ]; then  # #15: prefill at auto against all in HBM
  [ -n "${LLAMA:-}" ] && start_llama
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_prefetch_gpu.py \
    > "$OUT/prefetch_tests.txt" 2>&1; tail -4 "$OUT/prefetch_tests.txt"
  model
  timeout 120 python3 tools/prefill_rate.py --model $M > "$OUT/prefill_rate.txt" 2>&1
  tail -2 "$OUT/prefill_rate.txt"
  for b in auto ${BUDGETS:-16.88}; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 tools/prefill_rate.py --model $M \
      --offload-gb $b --device-gb 16 >> "$OUT/prefill_rate.txt" 2>&1; tail -2 "$OUT/prefill_rate.txt"
  done
fi
if [ "$what" = ws ]; then  # the prefetch tests; what prefill's workspace at auto is made of (XLA's
  # buffer assignment); a prefill profile at auto's budget
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_prefetch_gpu.py \
    > "$OUT/prefetch_tests.txt" 2>&1; tail -4 "$OUT/prefetch_tests.txt"
  model
  XLA_FLAGS="--xla_dump_to=/tmp/xd --xla_dump_hlo_module_re=.*prefill.*" XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC \
    timeout 200 python3 tools/prefill_rate.py --model $M --offload-gb auto --device-gb 16 \
    > "$OUT/prefill_rate_ws.txt" 2>&1; tail -1 "$OUT/prefill_rate_ws.txt"
  python3 tools/buffers_probe.py /tmp/xd --top 16 > "$OUT/buffers.txt" 2>&1; head -60 "$OUT/buffers.txt"
  b=$(sed -n 's/.*= budget \([0-9.]*\) GiB.*/\1/p' "$OUT/prefill_rate_ws.txt" | tail -1)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 -m jaxvt.bench profile --model $M --prefill \
    --prompt 512 --offload-gb ${b:-3.9} --device-gb 16 --top 25 > "$OUT/profile_prefill_auto.txt" 2>&1
  head -32 "$OUT/profile_prefill_auto.txt" | cut -c1-160
fi
if [ "$what" = closing ]; then
  start_llama
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_prefetch_gpu.py \
    tests/test_load_pipeline.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  model
  timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_determinism_gpu.py > "$OUT/determinism.txt" 2>&1; tail -8 "$OUT/determinism.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 tools/prefill_rate.py --model $M \
    --offload-gb auto --device-gb 16 > "$OUT/prefill_rate.txt" 2>&1; tail -1 "$OUT/prefill_rate.txt"
  echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
fi
if [ "$what" = split ]; then  # #15: what auto's prefill pays beyond all in HBM: auto's budget on
  # the whole pool (no 16 GiB card), and the prefill profiles all in HBM and at auto
  model
  timeout 150 python3 tools/prefill_rate.py --model $M --offload-gb 4.063 > "$OUT/prefill_rate.txt" 2>&1
  tail -1 "$OUT/prefill_rate.txt"
  timeout 150 python3 -m jaxvt.bench profile --model $M --prefill --prompt 512 --top 30 \
    > "$OUT/profile_prefill_hbm.txt" 2>&1; head -34 "$OUT/profile_prefill_hbm.txt" | cut -c1-150
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 -m jaxvt.bench profile --model $M --prefill \
    --prompt 512 --offload-gb 4.063 --device-gb 16 --top 30 > "$OUT/profile_prefill_auto.txt" 2>&1
  head -34 "$OUT/profile_prefill_auto.txt" | cut -c1-150
fi
if [ "$what" = store ]; then  # #16's export store on the GPU, the first token with and without it;
  # then the sweep (its auto chosen by XLA's analysis, the forced budgets last in their own process)
  start_llama
  model
  timeout 60 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_exports.py \
    > "$OUT/exports_tests.txt" 2>&1; tail -2 "$OUT/exports_tests.txt"
  timeout 80 python3 tools/first_token.py --runs 2 --no-store -- --model $M --max-tokens 32 \
    > "$OUT/first_token_nostore.txt" 2>&1; tail -3 "$OUT/first_token_nostore.txt"
  timeout 100 python3 tools/first_token.py --runs 3 -- --model $M --max-tokens 32 \
    > "$OUT/first_token.txt" 2>&1; tail -4 "$OUT/first_token.txt"
  python3 -m jaxvt.bench offload --time-limit ${OFFLOAD_S:-280} 2>&1 | tee "$OUT/offload.txt" | tail -40
  cp docs/BENCHMARKS.md "$OUT/"; cp docs/offload_sweep.png /tmp/llama_build.log "$OUT/" 2>/dev/null
fi
if [ "$what" = slop2 ]; then  # #15: XLA's remat at the sweep's auto (context 648): its memory limit's slop
  model
  for f in "" "--xla_gpu_memory_limit_slop_factor=100"; do
    for b in 3.5008 auto; do
      XLA_FLAGS="$f" XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 120 python3 tools/prefill_rate.py \
        --model $M --offload-gb $b --device-gb 16 --max-context 648 --ahead-only > /tmp/pr.txt 2>&1
      echo "== ${f:-defaults} $b: $(grep -ci 'rematerial' /tmp/pr.txt) remat lines"; grep -i 'rematerial' /tmp/pr.txt | head -1 | cut -c1-300
      tail -1 /tmp/pr.txt | cut -c1-600
    done
  done 2>&1 | tee "$OUT/slop2.txt"
  timeout 90 python3 tools/prefill_rate.py --model $M --max-context 648 --ahead-only 2>&1 | tail -1 | tee -a "$OUT/slop2.txt"
  timeout 90 python3 -m jaxvt.bench profile --model $M --steps 8 --top 45 > "$OUT/decode_profile.txt" 2>&1
  tail -60 "$OUT/decode_profile.txt" | cut -c1-200
fi
if [ "$what" = slop ]; then  # #15: does XLA's memory-limited compile (remat) cost prefill at auto?
  model
  for f in "" "--xla_gpu_memory_limit_slop_factor=1000"; do
    XLA_FLAGS="$f" XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 tools/prefill_rate.py \
      --model $M --offload-gb auto --device-gb 16 > /tmp/pr.txt 2>&1
    echo "== ${f:-defaults}"; grep -i "remat" /tmp/pr.txt | head -2 | cut -c1-200; tail -1 /tmp/pr.txt
  done 2>&1 | tee "$OUT/slop.txt"
fi
if [ "$what" = even ]; then  # #15: auto's host-tier layers evenly spaced, gate/up copies early
  start_llama
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_prefetch_gpu.py \
    tests/test_load_pipeline.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  model
  timeout 120 python3 tools/prefill_rate.py --model $M > "$OUT/prefill_rate_hbm.txt" 2>&1
  tail -1 "$OUT/prefill_rate_hbm.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 tools/prefill_rate.py --model $M \
    --offload-gb auto --device-gb 16 > "$OUT/prefill_rate.txt" 2>&1; tail -2 "$OUT/prefill_rate.txt"
  b=$(sed -n 's/.*= budget \([0-9.]*\) GiB.*/\1/p' "$OUT/prefill_rate.txt" | tail -1)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.1313 timeout 120 python3 tools/prefill_rate.py --model $M \
    --offload-gb $b --device-gb 18 > "$OUT/prefill_rate18.txt" 2>&1; tail -1 "$OUT/prefill_rate18.txt"
  timeout 120 python3 tools/prefill_rate.py --model $M --offload-gb $b > "$OUT/prefill_rate_pool.txt" 2>&1
  tail -1 "$OUT/prefill_rate_pool.txt"
  echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
fi
if [ "$what" = where ]; then  # #15: what prefill at the sweep's auto budget still pays
  b=${B:-3.5008}
  model
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 120 python3 tools/prefill_rate.py --model $M \
    --offload-gb $b --device-gb 16 > "$OUT/prefill_rate.txt" 2>&1; tail -1 "$OUT/prefill_rate.txt"
  timeout 150 python3 -m jaxvt.bench profile --model $M --prefill --prompt 512 --top 40 \
    > "$OUT/profile_prefill_hbm.txt" 2>&1; head -46 "$OUT/profile_prefill_hbm.txt" | cut -c1-160
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 -m jaxvt.bench profile --model $M --prefill \
    --prompt 512 --offload-gb $b --device-gb 16 --top 40 > "$OUT/profile_prefill_auto.txt" 2>&1
  head -46 "$OUT/profile_prefill_auto.txt" | cut -c1-160
fi
if [ "$what" = where2 ]; then  # #15: every kernel of prefill, all in HBM and at 4.063 GiB on the
  # whole pool (host-tier layers copied ahead, no card limit: no rematerialization)
  model
  timeout 150 python3 -m jaxvt.bench profile --model $M --prefill --prompt 512 --top 600 \
    > "$OUT/profile_prefill_hbm.txt" 2>&1; head -3 "$OUT/profile_prefill_hbm.txt" | cut -c1-160
  timeout 150 python3 -m jaxvt.bench profile --model $M --prefill --prompt 512 --offload-gb 4.0633 \
    --top 600 > "$OUT/profile_prefill_pool.txt" 2>&1; head -3 "$OUT/profile_prefill_pool.txt" | cut -c1-160
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 -m jaxvt.bench profile --model $M --prefill \
    --prompt 512 --offload-gb 3.5008 --device-gb 16 --top 600 > "$OUT/profile_prefill_auto.txt" 2>&1
  grep -v "^W1202" "$OUT/profile_prefill_auto.txt" | head -3 | cut -c1-160
fi
if [ "$what" = take ]; then  # #15: take captured in XLA's command buffers (this build) or not
  start_llama
  SO=$(ls jaxvt/ffi/_jaxvt_ffi*.so); cp $SO /tmp/new.so
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_prefetch_gpu.py \
    tests/test_load_pipeline.py > "$OUT/gpu_tests.txt" 2>&1; rc=$?; tail -3 "$OUT/gpu_tests.txt"
  model
  timeout 120 python3 tools/prefill_rate.py --model $M > "$OUT/prefill_rate_hbm.txt" 2>&1
  tail -1 "$OUT/prefill_rate_hbm.txt"
  for v in new prev; do
    if [ $v = new ]; then cp /tmp/new.so $SO; else cp .dev/prev/$(basename $SO) $SO; fi
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 tools/prefill_rate.py --model $M \
      --offload-gb auto --device-gb 16 > "$OUT/prefill_rate_$v.txt" 2>&1; echo "$v:"; tail -1 "$OUT/prefill_rate_$v.txt"
  done
  if [ $rc = 0 ]; then cp /tmp/new.so $SO; echo "kept this build"; else echo "tests failed: prev's build stays"; fi
  cp $SO /tmp/keep.so  # the sweep's call takes this one (tools/h200_session.sh sweep)
  echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
fi
if [ "$what" = onecall ]; then  # the take call and the sweep's, for want of device time
  start_llama
  SO=$(ls jaxvt/ffi/_jaxvt_ffi*.so)
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_prefetch_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1 || { cp .dev/prev/$(basename $SO) $SO; echo "tests failed: prev's build"; }
  tail -3 "$OUT/gpu_tests.txt"
  model
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 100 python3 tools/long_prompt.py --model $M \
    --tokens 8192 --device-gb 16 > "$OUT/long_prompt.txt" 2>&1; echo "long exit $?"; tail -3 "$OUT/long_prompt.txt"
  python3 -m jaxvt.bench offload --time-limit ${OFFLOAD_S:-300} 2>&1 | tee "$OUT/offload.txt" | tail -40
  cp docs/BENCHMARKS.md "$OUT/"; cp docs/offload_sweep.png /tmp/llama_build.log "$OUT/" 2>/dev/null
fi
if [ "$what" = check ]; then  # take in XLA's command buffers (this build) or not (prev's)
  SO=$(ls jaxvt/ffi/_jaxvt_ffi*.so); cp $SO /tmp/new.so
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_prefetch_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  model
  timeout 90 python3 tools/prefill_rate.py --model $M > "$OUT/prefill_rate_hbm.txt" 2>&1
  tail -1 "$OUT/prefill_rate_hbm.txt" | cut -c1-400
  for v in new prev new2; do
    if [ $v = prev ]; then cp .dev/prev/$(basename $SO) $SO; else cp /tmp/new.so $SO; fi
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 90 python3 tools/prefill_rate.py --model $M \
      --offload-gb auto --device-gb 16 > "$OUT/prefill_rate_$v.txt" 2>&1; echo "$v:"; tail -1 "$OUT/prefill_rate_$v.txt" | cut -c1-400
  done
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 100 python3 tools/long_prompt.py --model $M \
    --tokens 8192 --device-gb 16 > "$OUT/long_prompt.txt" 2>&1; echo "long exit $?"; tail -4 "$OUT/long_prompt.txt"
fi
if [ "$what" = det ]; then  # #16: two processes, every budget (auto's layers evenly spaced now)
  start_llama
  [ -n "${TESTS:-}" ] && { timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    --tb=short $TESTS > "$OUT/gpu_tests.txt" 2>&1; tail -4 "$OUT/gpu_tests.txt"; }
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_determinism_gpu.py > "$OUT/determinism.txt" 2>&1; tail -8 "$OUT/determinism.txt"
  echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
fi
if [ "$what" = scale ]; then  # the predicted count scaled per layer (Products.predict_scale)
  start_llama
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_prefetch_experts_gpu.py tests/test_prefetch_gpu.py > "$OUT/gpu_tests.txt" 2>&1
  tail -4 "$OUT/gpu_tests.txt"; model; echo "model $(( $(date +%s) - t0 )) s"
  for b in ${SCALE_GB:-7}; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 150 python3 tools/predict_rate.py --model $M \
      --offload-gb $b --device-gb 16 --rounds 2 --variants ${SCALE_V:-2:2@8+c,2:2@8/3+c} \
      > "$OUT/predict_$b.txt" 2>&1
    grep "predict \|budget\|Error" "$OUT/predict_$b.txt" | tail -6
  done
  timeout ${DET_S:-250} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_determinism_gpu.py > "$OUT/determinism.txt" 2>&1; tail -8 "$OUT/determinism.txt"
  echo "llama build: $(tail -1 /tmp/llama_build.log 2>/dev/null)"
fi
if [ "$what" = close ]; then  # #14: host-read rates and the decode step's profile after the work
  timeout ${TIER_S:-200} python3 -m jaxvt.bench tier --total-mib 128 > "$OUT/tier.txt" 2>&1
  tail -32 "$OUT/tier.txt"; cp docs/BENCHMARKS.md "$OUT/"; model
  for b in 0 ${AUTO_GB:-3.7821} 17; do  # profile takes GiB, not "auto": auto's 3.78
    XLA_PYTHON_CLIENT_MEM_FRACTION=$([ $b = 0 ] && echo 0.75 || echo $FRAC) timeout 100 \
      python3 -m jaxvt.bench profile --model $M --offload-gb $b $([ $b = 0 ] || echo --device-gb 16) \
      --steps 16 --top 40 > "$OUT/profile_$b.txt" 2>&1; head -3 "$OUT/profile_$b.txt"
  done
fi
if [ "$what" = small ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_prefetch_experts_gpu.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  python3 tools/small_model.py /tmp/small.gguf > /dev/null
  timeout 200 python3 tools/first_token.py --runs ${RUNS:-4} -- --model /tmp/small.gguf \
    --max-tokens 32 > "$OUT/first_token_small.txt" 2>&1; tail -16 "$OUT/first_token_small.txt"
fi
if [ "$what" = rings ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_prefetch_gpu.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  model
  PAT=$(python3 tools/down_pattern.py $M 4.0633 2> /dev/null)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 120 python3 tools/prefill_rate.py --model $M \
    --offload-gb 17 --pattern exps --device-gb 16 --ahead-only --rings 2 2>&1 | grep "prefill\|rror"
  [ "${AT12:-1}" = 1 ] && XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 120 python3 tools/prefill_rate.py \
    --model $M --offload-gb 12 --device-gb 16 --ahead-only --rings 2 2>&1 | grep "prefill\|rror"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 120 python3 tools/prefill_rate.py --model $M \
    --offload-gb 4.0633 --pattern "$PAT" --device-gb 16 --ahead-only --rings 2 2>&1 |
    grep "prefill\|rror"
  if [ -n "${DOWN_V:-}" ]; then  # decode variants with auto's bytes as down stacks only
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout ${DOWN_S:-200} python3 tools/predict_rate.py \
      --model $M --offload-gb 4.0633 --pattern "$PAT" --device-gb 16 --rounds 2 \
      --variants $DOWN_V > "$OUT/predict_down.txt" 2>&1
    grep "predict \|budget\|Error" "$OUT/predict_down.txt" | tail -12
  fi
fi
if [ "$what" = predict ]; then
  start_llama
  timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
    tests/test_prefetch_experts_gpu.py tests/test_prefetch_gpu.py > "$OUT/gpu_tests.txt" 2>&1
  tail -6 "$OUT/gpu_tests.txt"
  model; echo "model $(( $(date +%s) - t0 )) s"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout ${HOSTALL_S:-200} python3 tools/predict_rate.py \
    --model $M --offload-gb 0 --pattern exps --device-gb 16 --rounds 2 \
    --variants ${HOSTALL_V:-off,1:1,2:2,3:3} > "$OUT/predict_hostall.txt" 2>&1
  tail -6 "$OUT/predict_hostall.txt"; echo "host-all $(( $(date +%s) - t0 )) s"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout ${AUTO_S:-200} python3 tools/predict_rate.py \
    --model $M --offload-gb auto --device-gb 16 --rounds 2 \
    --variants ${AUTO_V:-off,2:2,2:4,2:6} > "$OUT/predict_auto.txt" 2>&1
  tail -6 "$OUT/predict_auto.txt"
fi
if [ "$what" = predict2 ]; then
  [ -n "${TESTS:-}" ] && { timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    --tb=short $TESTS > "$OUT/gpu_tests.txt" 2>&1; tail -4 "$OUT/gpu_tests.txt"; }
  model
  for v in ${RING_V:-}; do  # copies XLA makes of a ring in the compiled decode step
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 100 python3 tools/ring_copies.py --model $M \
      --offload-gb 17 --device-gb 16 --predict $v > "$OUT/ring_copies_${v//:/-}.txt" 2>&1
    grep -v "^W1203\|remat" "$OUT/ring_copies_${v//:/-}.txt" | tail -8
  done
  for v in ${HITS_V:-}; do  # v = BUDGET/H:D[:S]: the predicted experts' hit rates
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 120 python3 tools/predict_hits.py --model $M \
      --offload-gb ${v%%/*} --device-gb 16 --predict ${v#*/} --tokens 24 \
      > "$OUT/hits_${v//[:\/]/-}.txt" 2>&1
    grep -v "^W1203\|remat" "$OUT/hits_${v//[:\/]/-}.txt" | tail -3
  done
  for v in ${PROFILE_V:-off 2:2 2:2:1}; do
    f="$OUT/profile_${v//:/-}.txt"
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout 100 python3 -m jaxvt.bench profile --model $M \
      --offload-gb 17 --device-gb 16 --steps 8 --top 40 --predict $v > "$f" 2>&1
    head -${PROFILE_LINES:-2} "$f"
  done
  if [ "${RATES:-1}" = 1 ]; then  # RATES=0: the probes above only
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout ${HOSTALL_S:-200} python3 tools/predict_rate.py \
      --model $M --offload-gb 17 --pattern exps --device-gb 16 --rounds 2 \
      --variants ${HOSTALL_V:-off,2:2:1,4:4,4:4:1} > "$OUT/predict_hostall.txt" 2>&1
    grep "predict \|budget\|Error" "$OUT/predict_hostall.txt" | tail -12; echo "host-all $(( $(date +%s) - t0 )) s"
    XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout ${AUTO_S:-200} python3 tools/predict_rate.py \
      --model $M --offload-gb auto --device-gb 16 --rounds 2 \
      --variants ${AUTO_V:-off,2:2:1,3:3} > "$OUT/predict_auto.txt" 2>&1
    grep "predict \|budget\|Error" "$OUT/predict_auto.txt" | tail -12
  fi
  if [ -n "${HBM_V:-}" ]; then  # everything in HBM (no card limit): e.g. HBM_V=off,off+c
    timeout ${HBM_S:-150} python3 tools/predict_rate.py --model $M --rounds 2 --variants $HBM_V \
      > "$OUT/predict_hbm.txt" 2>&1
    grep "predict \|budget\|Error" "$OUT/predict_hbm.txt" | tail -8
  fi
fi
if [ "$what" = sweep ]; then
  [ -f /tmp/keep.so ] && cp /tmp/keep.so $(ls jaxvt/ffi/_jaxvt_ffi*.so) && echo "extension: the take call's"
  start_llama  # the sweep runs llama-bench last and waits for a build in progress
  python3 -m jaxvt.bench offload --time-limit ${OFFLOAD_S:-500} 2>&1 | tee "$OUT/offload.txt" | tail -40
  cp docs/BENCHMARKS.md "$OUT/"; cp docs/offload_sweep.png /tmp/llama_build.log "$OUT/" 2>/dev/null
fi
echo "total $(( $(date +%s) - t0 )) s"
