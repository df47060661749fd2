#!/usr/bin/env bash
# One call on the GPU machine: install the carried server wheels, then run the steps named
# in $STEPS (default: tests). Logs go to $OUT (or ./out). SKIP_TESTS=1: the mla, oss and gemma
# steps run their benchmarks alone (their GPU tests run in an earlier call). Example:
#   STEPS="tests kernel engine8b" bash bench/gpu_session.sh
#   STEPS="qwen35tests qwen35" bash bench/gpu_session.sh   (Qwen3.5: fla-core and einops wheels in .whl/)
# Wheels: the server's (fastapi, uvicorn, pydantic, orjson, ...) plus pybase64 and nvidia-cudnn-frontend, and fla-core
# and einops for Qwen3.5, at the versions of requirements.lock (the image's lock): fill .whl/ with
# `python3 bench/lock_wheels.py download .whl` (LOCK_STRICT=1 refuses a wheel of another version).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  # the locked version of each distribution (two versions of one make pip refuse the whole install)
  wheels=$(python3 bench/lock_wheels.py select .whl ${LOCK_STRICT:+--strict}) || exit 1
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
fi
# what only the benchmarks' baselines need, outside the server's lock (e.g. accelerate and psutil for
# transformers' FP8 path in fp8acc): .whl/bench/*.whl, installed where the machine's image lacks them
if ls .whl/bench/*.whl >/dev/null 2>&1; then
  for w in .whl/bench/*.whl; do
    mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target /tmp/site "$w"
  done
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
fi
# What a fresh machine spends minutes making, kept across sessions: Triton's autotuning choices
# (fla-core's kernels time every config on a cold machine: ~10 minutes of the Qwen3.5 tests), the
# cudnn_fe attention plans, the built CUDA kernel library and, when it fits, inductor's compiled
# stages. Each library keys its entries on source, versions and GPU, so a stale one is only unused.
# After each step they are packed into $OUT/device_cache.tgz (under 15 MiB: what comes back from a
# call); copied into .cache/device/ here and carried (carry [".whl", ".cache/device"]), the next
# session's first call unpacks them. DEVICE_CACHE=off skips both.
CACHE_ROOT=$HOME/.cache/teacher-server/compile
# the service's own compile-cache variables (compile_cache.use_compile_cache), for every process here, tests too
eval "$(PYTHONPATH=$PWD python3 -c 'import os, shlex; before = dict(os.environ)
from teacher_server.compile_cache import use_compile_cache; use_compile_cache(None)
print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in os.environ.items() if before.get(k) != v))')"
if [ "${DEVICE_CACHE:-on}" != off ] && [ -f .cache/device/device_cache.tgz ]; then
  mkdir -p "$CACHE_ROOT" /tmp/ts-ext
  tar -xzf .cache/device/device_cache.tgz -C "$HOME/.cache/teacher-server" --skip-old-files 2>/dev/null \
    && echo "device cache: $(tar -tzf .cache/device/device_cache.tgz | grep -vc /$) files unpacked"
fi
pack_cache() {
  [ "${DEVICE_CACHE:-on}" != off ] || return 0
  mkdir -p "$HOME/.cache/teacher-server/ext-carried"
  find /tmp/ts-ext -name '*.so' 2>/dev/null | while read -r so; do
    d="$HOME/.cache/teacher-server/ext-carried/$(basename "$(dirname "$so")")"; mkdir -p "$d"; cp -u "$so" "$d/"; done
  (cd "$HOME/.cache/teacher-server" && {
    find compile/triton -name '*.autotune.json' 2>/dev/null; find compile/cudnn_fe ext-carried -type f 2>/dev/null
  } > /tmp/cache_files.txt
   tar -czf /tmp/cache_small.tgz -T /tmp/cache_files.txt 2>/dev/null
   find compile/inductor compile/triton -type f 2>/dev/null | sort -u - /tmp/cache_files.txt > /tmp/cache_all.txt
   tar -czf /tmp/cache_all.tgz -T /tmp/cache_all.txt 2>/dev/null)
  for f in /tmp/cache_all.tgz /tmp/cache_small.tgz; do
    if [ -s $f ] && [ "$(stat -c %s $f)" -lt 15000000 ]; then cp $f "$OUT/device_cache.tgz"; return 0; fi
  done
}
# the carried kernel library, where the build looks for it (TEACHER_SERVER_EXT_DIR below)
[ -d "$HOME/.cache/teacher-server/ext-carried" ] && mkdir -p /tmp/ts-ext && tar -C "$HOME/.cache/teacher-server/ext-carried" -cf - . | tar -C /tmp/ts-ext -xf - --skip-old-files
# what this run has against the lock (torch, triton, numpy come from the machine's image)
python3 bench/lock_wheels.py check > "$OUT/lock_check.txt" 2>&1; tail -1 "$OUT/lock_check.txt"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TEACHER_SERVER_EXT_DIR=/tmp/ts-ext
# pybase64 is a server requirement the GPU image lacks: without it the HTTP runs decode and encode
# every .npy payload with the standard library (fetch it with EXTRA_WHEELS="pybase64 ...")
python3 -c "import pybase64" 2>/dev/null || echo "WARNING: no pybase64 in .whl/: HTTP runs use the slower standard-library base64"
# cuDNN's Python frontend: the default attention backend (cudnn_fe); without it the engine runs
# the cudnn backend (fetch it with EXTRA_WHEELS="nvidia-cudnn-frontend ...")
python3 -c "import torch, cudnn" 2>/dev/null || echo "WARNING: no nvidia-cudnn-frontend in .whl/: attention runs the cudnn backend"
# The model steps write each engine's step trace (one JSON line per step: tokens, sequences, host launch time, GPU
# time, and the host clock the HTTP runs' clock shares) as $OUT/trace_*: where an HTTP pass's wall time went
# beyond its steps' GPU time (the first request's arrival, the last answer's way back).
# GPU test runs: a line per test as it ends (a run cut short by the call's limit still says which
# passed), the tests' printed errors, the slowest tests, no captured library debug logs
PT="-v -rPfE --durations=15 -p no:logging -p no:cacheprovider"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
# On a GPU of under 100 GiB (an H100), the shapes sized for one H200 at their depth run their first
# layers only (bench_engine.py --num-layers; the results say so): prints the flag for shape $1, or nothing
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
fit_layers() {
  [ "${GPU_MIB:-200000}" -lt 100000 ] || return 0
  case $1 in
    qwen3-next-80b-a3b) echo "--num-layers 12" ;;  # 12 of the shape's 24 (~40 GB)
    glm4.5-air) echo "--num-layers 9" ;;           # 9 of the shape's 18 (~43 GB)
    qwen3.5-35b-a3b) echo "--num-layers 20" ;;     # 20 of 40 (~36 GB)
    gemma3-27b) echo "--num-layers 31" ;;          # 31 of the text model's 62 (~28 GB)
  esac
}
for step in ${STEPS:-tests}; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests)   python3 -m pytest $PT -m gpu tests/test_parity.py tests/test_gather_logprob.py tests/test_gpu_engine.py \
      tests/test_row_targets.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    # the GPU tests that compile no fla-core float32 kernels (those autotune for minutes on a fresh machine)
    quicktests) python3 -m pytest $PT -m gpu tests/test_parity.py tests/test_gpu_engine.py tests/test_moe.py \
      tests/test_qwen3_5_gpu.py -k "not qwen3_5_parity_gpu_float32" 2>&1 | tee "$OUT/gpu_quick_tests.log" | tail -25 ;;
    pytest)  python3 -m pytest $PT -m gpu ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/gpu_pytest.log" | tail -25 ;;
    alltests) python3 -m pytest -q -x tests -p no:cacheprovider --ignore=tests/test_deploy.py 2>&1 | tee "$OUT/all_tests.log" | tail -25 ;;
    attention) python3 bench/bench_attention.py --out "$OUT/attention_h200.json" 2>&1 | tee "$OUT/attention.log" | tail -20 ;;
    kernel)  python3 bench/bench_kernel.py --out "$OUT/kernel_h200.json" 2>&1 | tee "$OUT/kernel.log" | tail -30 ;;
    engine8b) python3 bench/bench_engine.py ${ENGINE_ARGS:-} --out "$OUT/engine_8b_h200.json" 2>&1 | tee "$OUT/engine8b.log" | tail -30 ;;
    # the trainers' ways to the teacher's top-K beside the candidate path (W1, K=64), and one 131,072-token request
    dropin) python3 bench/bench_dropin.py ${DROPIN_ARGS:-} --out "$OUT/dropin_h200.json" 2>&1 | tee "$OUT/dropin.log" | tail -40 ;;
    replicas) python3 bench/bench_replicas.py ${REPLICA_ARGS:-} --out "$OUT/replicas_8b_h200.json" 2>&1 | tee "$OUT/replicas.log" | tail -20 ;;
    # two teachers (8B and 30B-A3B shapes) on GPU 0 and 1 behind one service against each alone (two GPUs)
    teachers) python3 bench/bench_teachers.py ${TEACHER_ARGS:-} --out "$OUT/teachers_h200x2.json" 2>&1 | tee "$OUT/teachers.log" | tail -20 ;;
    # a soak through HTTP (Qwen3-8B shape, dummy weights): mixed W1/W2/W3 requests and disconnects, every answer
    # checked, memory and latency per minute; the JSON is rewritten each minute (a call cut short keeps it)
    soak) python3 bench/soak.py ${SOAK_ARGS:---duration-s 480} --out "$OUT/soak_8b_h200.json" 2>&1 | tee "$OUT/soak.log" | tail -40 ;;
    qwen35tests) python3 -m pytest $PT -m gpu tests/test_conv_prep.py tests/test_gated_qk.py tests/test_qwen3_5_gpu.py 2>&1 | tee "$OUT/gpu_qwen35_tests.log" | tail -25 ;;
    # the linear layers' fused input stage against the two passes it replaces, at the 9B shapes
    # what a new cuDNN attention shape costs the launching thread, at the Qwen3.5-9B and Qwen3-8B shapes
    plans) python3 bench/bench_cudnn_plans.py --out "$OUT/cudnn_plans_qwen35.json" 2>&1 | tee "$OUT/cudnn_plans.log" | tail -3
           python3 bench/bench_cudnn_plans.py --heads 32 --kv-heads 8 --head-dim 128 --out "$OUT/cudnn_plans_8b.json" 2>&1 | tail -3 ;;
    # every plan cuDNN lists for an engine step's attention against its heuristic's pick (burst and sustained)
    attnplans) python3 bench/bench_attention_plans.py ${ATTN_PLANS_ARGS:-} --out "$OUT/attention_plans.json" 2>&1 | tee "$OUT/attention_plans.log" | tail -60 ;;
    # a newer cuDNN's attention plans against the image's, runs alternated: CUDNN_LIB_DIR holds its libcudnn.so.9 and
    # graph, heuristic, runtime-compiled and tensor-IR engine libraries (nvidia-cudnn-cu13's nvidia/cudnn/lib)
    cudnnlib) : "${CUDNN_LIB_DIR:?set CUDNN_LIB_DIR to the lib folder of a newer cuDNN}"
      for r in new1 old1 old2 new2; do
        case $r in old*) P="";; *) P="env LD_PRELOAD=$CUDNN_LIB_DIR/libcudnn.so.9 LD_LIBRARY_PATH=$CUDNN_LIB_DIR:${LD_LIBRARY_PATH:-}";; esac
        $P python3 bench/bench_attention_plans.py --heads 8b,32b --steps w1_32k,w1f,w3 --rounds 1 --sustain-s 0.5 \
          --out "$OUT/attention_plans_cudnn_$r.json" 2>&1 | tee "$OUT/attention_plans_cudnn_$r.log" | grep -E "[*]|best"
      done ;;
    conv) python3 bench/bench_conv_prep.py --out "$OUT/conv_prep_h200.json" 2>&1 | tee "$OUT/conv_prep.log" | tail -5 ;;
    # W7: Qwen3.5-9B (hybrid; fla-core from .whl/), W1 in-process and through HTTP (issue 53 measures it there)
    # beside transformers (DESIGN's padded recipe, then the stronger packed one), W2's cache on vs off, and W1's
    # profile (what remains outside the multiplies)
    qwen35) python3 bench/bench_engine.py --model-size qwen3.5-9b ${QWEN35_ARGS:---workloads W1 --http W1 --baseline W1,W2 \
      --baseline-layouts padded,packed --prefix-cache-compare W2 --profile W1 --repeats 2 --max-model-len 8192} \
      --step-trace "$OUT/trace_qwen35_" --out "$OUT/engine_qwen35_h200.json" 2>&1 | tee "$OUT/engine_qwen35.log" | tail -40 ;;
    # Qwen3.5-9B W1 in-process with each of its fused stages switched off in turn (issue 53's ablation)
    qwen35ablate) python3 bench/bench_engine.py --model-size qwen3.5-9b --workloads W1 --repeats 1 --max-model-len 8192 \
      --ablate W1 --ablate-only as_configured,no_gated_qk_kernel,eager_gated_attention,no_conv_kernel,no_fused_gate_up,eager_stages \
      --ablate-repeats 1 --out "$OUT/engine_qwen35_ablation_h200.json" 2>&1 | tee "$OUT/engine_qwen35_ablation.log" | tail -12 ;;
    # Qwen3.5-35B-A3B's shape (dummy weights; issue 53): W1 in-process and through HTTP beside transformers' padded and
    # packed recipes, W2's cache off vs on, W1 in-process with each expert-layer kernel switched in turn
    # ($QWEN35MOE_ARGS replaces the arguments)
    qwen35moe) python3 bench/bench_engine.py --model-size qwen3.5-35b-a3b $(fit_layers qwen3.5-35b-a3b) ${QWEN35MOE_ARGS:---workloads W1 --http W1 \
      --baseline W1 --baseline-layouts padded,packed --prefix-cache-compare W2 --repeats 1 --max-model-len 8192 \
      --ablate W1 --ablate-only as_configured,no_combine_kernel,flip_moe_gate_up,no_router_kernel,flip_group_kernel \
      --ablate-repeats 1} \
      --step-trace "$OUT/trace_qwen35moe_" --out "$OUT/engine_qwen35_35b_a3b_h200.json" 2>&1 | tee "$OUT/engine_qwen35moe.log" | tail -40 ;;
    # W7 on the two-GPU machine: ours on GPU 0, transformers at the same time on GPU 1 (W1, W2), then the
    # Qwen3.5 GPU tests (and any test files in $QWEN35X2_MORE_TESTS) on GPU 1; the engine reads the
    # baseline's file before its check against it
    qwen35x2)
      python3 bench/bench_engine.py --model-size qwen3.5-9b --checkpoint-only
      (CUDA_VISIBLE_DEVICES=1 python3 bench/hf_baseline.py --ckpt /tmp/ts-bench/qwen3_5-qwen3.5-9b --workloads W1,W2 \
         --repeats 2 --out "$OUT/qwen35_baseline.json" > "$OUT/qwen35_baseline.log" 2>&1
       CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=4 python3 -m pytest $PT -m gpu tests/test_qwen3_5_gpu.py tests/test_gated_delta.py \
         tests/test_fused_ops.py ${QWEN35X2_MORE_TESTS:-} > "$OUT/gpu_qwen35_tests.log" 2>&1) &
      CUDA_VISIBLE_DEVICES=0 python3 bench/bench_engine.py --model-size qwen3.5-9b --workloads W1 --prefix-cache-compare W2 \
        --repeats 2 --max-model-len 8192 --profile W1 --baseline W1,W2 --baseline-from "$OUT/qwen35_baseline.json" \
        --out "$OUT/engine_qwen35_h200.json" 2>&1 | tee "$OUT/engine_qwen35.log" | tail -40
      wait ;;
    # issue 20 on the two-GPU machine, in two calls. ceiling: W1, W1f, W3 and W2's cache off vs on on
    # GPU 0, the transformers baseline at the same time on GPU 1 (then the 32B GEMM rates and one
    # layer's attention there). ceiling_ablate, alone on the machine (a quiet host for the HTTP
    # clients): W1 in-process and through HTTP, then with each optimisation off in turn.
    ceiling)
      python3 bench/bench_engine.py --checkpoint-only
      (CUDA_VISIBLE_DEVICES=1 python3 bench/hf_baseline.py --ckpt /tmp/ts-bench/qwen3-8b --workloads W1,W1f,W3 \
         --repeats 2 --out "$OUT/baseline_8b.json" > "$OUT/baseline_8b.log" 2>&1
       CUDA_VISIBLE_DEVICES=1 python3 bench/bench_gemm.py --model-size 32b --out "$OUT/gemm_32b_h200.json" > "$OUT/gemm_32b.log" 2>&1
       CUDA_VISIBLE_DEVICES=1 python3 bench/bench_attention.py --out "$OUT/attention_h200.json" > "$OUT/attention.log" 2>&1) &
      CUDA_VISIBLE_DEVICES=0 python3 bench/bench_engine.py --workloads W1,W1f,W3 --prefix-cache-compare W2 \
        --repeats 2 --baseline W1,W1f,W3 --baseline-from "$OUT/baseline_8b.json" --out "$OUT/engine_8b_h200.json" 2>&1 \
        | tee "$OUT/engine8b.log" | tail -30
      wait ;;
    # ($ABLATE_ARGS adds flags, e.g. "--ablate-repeats 1 --ablate-only as_configured,no_cuda_kernels";
    # ABLATE_PROFILE= leaves the profile out)
    ceiling_ablate) prof=${ABLATE_PROFILE-W1}; python3 bench/bench_engine.py --workloads W1 --http W1 --ablate W1 \
      --repeats 2 ${prof:+--profile $prof} ${ABLATE_ARGS:-} --out "$OUT/engine_8b_ablation_h200.json" 2>&1 | tee "$OUT/ablation.log" | tail -30 ;;
    # ceiling on a one-GPU machine: the transformers baseline first (its own process), then ours
    ceiling1) python3 bench/bench_engine.py --workloads W1,W1f,W3 --prefix-cache-compare W2 --repeats 2 \
      --baseline W1,W1f,W3 --out "$OUT/engine_8b_h200.json" 2>&1 | tee "$OUT/engine8b.log" | tail -30 ;;
    # W1 through HTTP with the server's default (on one GPU: the engine in a process of its own),
    # then with the engine on the server's thread ($HTTP_ENGINE picks others), beside W1
    # in-process; the quiet machine of a one-GPU lease
    http_modes) python3 bench/bench_engine.py --workloads W1 --http W1 --http-engine ${HTTP_ENGINE:-default,thread} --repeats 3 \
      --out "$OUT/engine_8b_http_modes_h200.json" 2>&1 | tee "$OUT/http_modes.log" | tail -12 ;;
    # tensor parallel's o/down products in parts (each part's all-reduce under the next part's GEMM) on the
    # two-GPU machine: the GPU tensor-parallel tests, then W4 (Qwen3-32B, dummy weights) at TP2 with $TP_PARTS
    # parts (default 1 and 4), one engine each, in that order and back
    tp_parts) python3 -m pytest $PT -m gpu tests/test_tensor_parallel.py 2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -8
      i=0; for parts in ${TP_PARTS:-1 4 1 4}; do i=$((i + 1)); python3 bench/bench_engine.py --model-size 32b \
        --workloads W4 --tensor-parallel-size 2 --tp-comm-parts $parts --repeats 2 \
        --out "$OUT/engine_32b_w4_tp2_run${i}_parts$parts.json" 2>&1 | tee -a "$OUT/tp_parts.log" | grep -E "^W4 |KV pool|loaded"
      done ;;
    # two-GPU machine: the pipeline-parallel tests (the CPU ones and the two-GPU ones), then W4 (Qwen3-32B,
    # dummy weights) on one GPU and at PP2 (two stages of one GPU), $PP_SIZES in that order (default 1 2 1 2):
    # PP2's tok/s over one GPU's is the pipeline's speed-up (the issue asks >= 1.85x)
    pp) python3 -m pytest $PT tests/test_pipeline_parallel.py 2>&1 | tee "$OUT/pp_tests.log" | tail -8
      i=0; for pp in ${PP_SIZES:-1 2 1 2}; do i=$((i + 1)); python3 bench/bench_engine.py --model-size 32b \
        --workloads W4 --pipeline-parallel-size $pp --repeats 2 \
        --out "$OUT/engine_32b_w4_pp${pp}_run$i.json" 2>&1 | tee -a "$OUT/pp.log" | grep -E "^W4 |KV pool|loaded"
      done ;;
    # expert parallel against tensor parallel for the expert layers on the two-GPU machine: the GPU expert-parallel
    # and grouped-GEMM tests (rows past the last row end), then W5 (W1 on the Qwen3-30B-A3B shape, dummy weights) at TP2, one engine per mode of $EP_MODES
    # (default tensor, then expert); each prints its W1 tokens/s and MFU
    ep) python3 -m pytest $PT -m gpu tests/test_expert_parallel.py tests/test_moe.py -k grouped 2>&1 \
        | tee "$OUT/gpu_ep_tests.log" | tail -8
      for mode in ${EP_MODES:-tensor expert}; do python3 bench/bench_engine.py --model-size 30b-a3b \
        --workloads W1 --tensor-parallel-size 2 --moe-parallel $mode --repeats ${EP_REPEATS:-2} \
        --out "$OUT/engine_30b_a3b_w5_tp2_$mode.json" 2>&1 | tee -a "$OUT/ep.log" | grep -E "^W1 |KV pool|loaded"
      done ;;
    # seconds to /health ready: a first start with an empty compile cache, then a restart keeping it
    # (dummy weights; $TTR_SIZES picks the shapes, default Qwen3-8B and Qwen3.5-9B)
    ttr) for size in ${TTR_SIZES:-8b qwen3.5-9b}; do
           python3 bench/time_to_ready.py --model-size "$size" --restarts ${TTR_RESTARTS:-1} \
             --out "$OUT/time_to_ready_${size}_h200.json" 2>&1 | tee "$OUT/time_to_ready_$size.log" | grep -E "ready in|wrote"
         done ;;
    # `teacher-server bench` as a user runs it: a server of the $BENCH_SHAPE shape (default qwen3-8b, dummy
    # weights) started on its own, then the command against its URL ($BENCH_ARGS: default W1,W1f,W2); the
    # table in the log, bench.json and bench.png under $OUT/bench
    benchcmd) shape_dir=/tmp/ts-benchcmd/${BENCH_SHAPE:-qwen3-8b}; mkdir -p "$shape_dir"
      python3 -c "import json, sys; from teacher_server.benchmark.command import SHAPES; \
        open(sys.argv[1] + '/config.json', 'w').write(json.dumps(SHAPES[sys.argv[2]]))" "$shape_dir" "${BENCH_SHAPE:-qwen3-8b}"
      python3 -m teacher_server serve --model "$shape_dir" --load-format dummy --port 8000 > "$OUT/benchcmd_server.log" 2>&1 &
      server=$!
      python3 -m teacher_server bench --url http://127.0.0.1:8000 --wait-ready-s 900 ${BENCH_ARGS:---workloads W1,W1f,W2} \
        --out "$OUT/bench" 2>&1 | tee "$OUT/benchcmd.log" | tail -12
      kill -TERM $server; wait $server ;;
    # issue 48 part B: the FP8 ops' GPU tests, then one layer's projections (Qwen3-8B, Qwen3-32B at 16k tokens) and
    # Qwen3-30B-A3B's experts, bf16 against FP8 tensor/row/block, sustained ($FP8_ARGS: e.g. "--sustain-s 12")
    fp8ops) python3 -m pytest $PT -m gpu tests/test_fp8_ops.py 2>&1 | tee "$OUT/gpu_fp8_tests.log" | tail -25
      python3 bench/bench_fp8.py ${FP8_ARGS:-} --out "$OUT/fp8_ops_h200.json" 2>&1 | tee "$OUT/fp8_ops.log" | tail -40 ;;
    # FP8 against bf16 end to end through HTTP (issue 48's targets): a server per variant (bf16, --quantization fp8,
    # a block-wise checkpoint's config), alternating; $FP8E2E_ARGS e.g. "--model-size 32b --workload W4 --variants bf16,row"
    # or "--model-size 30b-a3b --workload W5 --max-model-len 8192"
    fp8e2e) python3 bench/bench_fp8_e2e.py ${FP8E2E_ARGS:---model-size 8b --workload W1 --rounds 2} --out "$OUT/fp8_e2e.json" \
      2>&1 | tee "$OUT/fp8_e2e.log" | grep -E "^round|x_bf16_median" ;;
    # where an FP8 step's time goes: W1 (Qwen3-8B shape) profiled quantized at load (row-wise), then in bf16, one
    # engine each (the first 24 requests; per-kernel CUDA time in the .profile.txt files); FP8PROF="fp8 block bf16"
    # adds a block-wise checkpoint
    fp8prof) for q in ${FP8PROF:-fp8 bf16}; do
        extra=""; [ $q = fp8 ] && extra="--quantization fp8"; [ $q = block ] && extra="--fp8-block"
        python3 bench/bench_engine.py --workloads W1 --profile W1 --repeats 1 $extra \
          --out "$OUT/engine_8b_w1_profile_$q.json" 2>&1 | tee "$OUT/engine_8b_w1_profile_$q.log" | grep -E "^W1 |profile:"
      done ;;
    # FP8 checkpoints on the GPU: each layout's modes and error against transformers' FP8 path
    fp8fmt) python3 -m pytest $PT -m gpu tests/test_fp8.py 2>&1 | tee "$OUT/gpu_fp8fmt_tests.log" | tail -25 ;;
    # FP8 accuracy on a Qwen3-8B-shape W1 sample: FP8 vs its dequantized float32 forward, KL(bf16 || FP8)
    # (the checkpoints are kept under /tmp/ts-fp8-accuracy: a second call on the same machine skips writing them)
    # the FP8 expert layer (Qwen3-30B-A3B's shapes): bf16 against the two-pass FP8 path and ops.fp8_moe's fused
    # gate/up kernel, each config ($FP8MOE_ARGS e.g. "--tokens 32768")
    fp8moe) python3 bench/bench_fp8_moe.py ${FP8MOE_ARGS:-} --out "$OUT/fp8_moe.json" 2>&1 | tee "$OUT/fp8_moe.log" | tail -40 ;;
    # transformers' FP8 path takes its kernel from .whl/bench/finegrained-fp8 where that folder was carried (the
    # finegrained-fp8 folder of a huggingface/kernels-community checkout: bench/hf_fp8_kernel.py); its autotuner
    # times 8 configurations per shape here (the scores do not depend on the tiles)
    fp8acc) [ -d .whl/bench/finegrained-fp8 ] && export HF_FP8_KERNEL=${HF_FP8_KERNEL:-.whl/bench/finegrained-fp8/torch-ext/finegrained_fp8} \
        FINEGRAINED_AUTOTUNE_TRIALS=${FINEGRAINED_AUTOTUNE_TRIALS:-8}
      python3 bench/fp8_accuracy.py ${FP8ACC_ARGS:-} --out "$OUT/fp8_accuracy_8b.json" 2>&1 | tee "$OUT/fp8_accuracy.log" | tail -40 ;;
    # DeepSeek-V3-class (latent attention, DeepSeekMoE): the GPU tests (each attention backend's answer to v
    # narrower than k is printed), q/k 192 with v 128 against dense 128 per backend, Moonlight-16B-A3B on W1f in-process and through HTTP beside transformers'
    # DeepSeek-V3 forward (and in-process with each expert-layer kernel switched in turn), then DeepSeek-V3's layer
    # shape (7 layers: 3 dense, 4 expert) on W1f
    mla) [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest $PT -m gpu tests/test_deepseek_gpu.py 2>&1 | tee "$OUT/gpu_mla_tests.log" | tail -25
      python3 bench/bench_mla_attention.py --out "$OUT/mla_attention_h200.json" 2>&1 | tee "$OUT/mla_attention.log" | tail -10
      python3 bench/bench_engine.py --model-size moonlight --workloads W1f --http W1f --baseline W1f --repeats 2 \
        --ablate W1f --ablate-only as_configured,no_combine_kernel,flip_moe_gate_up,no_router_kernel,flip_group_kernel,no_router_gemm_split --ablate-repeats 1 \
        --max-model-len 8192 --step-trace "$OUT/trace_moonlight_" --out "$OUT/engine_moonlight_h200.json" 2>&1 | tee "$OUT/engine_moonlight.log" | tail -16
      python3 bench/bench_engine.py --model-size deepseek-v3-layers --workloads W1f --repeats 2 --max-model-len 8192 \
        --out "$OUT/engine_deepseek_v3_layers_h200.json" 2>&1 | tee "$OUT/engine_deepseek_v3_layers.log" | tail -8 ;;
    # DeepSeek-V3's layer shape as it ships, a block-wise FP8 checkpoint (dummy weights): 11 layers (3 dense, 8 expert,
    # ~97 GB) on an H200, 6 (3 dense, 3 expert, ~40 GB) on an 80 GB card (with 7, the start-up's activation estimate at
    # a 16,384-token step leaves no KV pool); W1f in process (issue 49's layer-shape rate)
    dsv3fp8) layers=11; [ "${GPU_MIB:-200000}" -lt 100000 ] && layers=6
      python3 bench/bench_engine.py --model-size deepseek-v3-layers --fp8-block --num-layers ${DSV3_LAYERS:-$layers} \
        --workloads W1f --repeats 2 --max-model-len 8192 --out "$OUT/engine_deepseek_v3_layers_fp8.json" 2>&1 \
        | tee "$OUT/engine_deepseek_v3_layers_fp8.log" | tail -8 ;;
    # Moonlight-16B-A3B alone: W1f in-process and through HTTP (httpx's client and a bare asyncio one alternating: how
    # much of the time before the first step is the client's) beside transformers, then in-process with the router's
    # kernels switched in turn ($MOONLIGHT_ARGS replaces the arguments)
    moonlight) python3 bench/bench_engine.py --model-size moonlight ${MOONLIGHT_ARGS:---workloads W1f --http W1f --baseline W1f \
        --http-client httpx,raw --repeats 2 --ablate W1f --ablate-only as_configured,no_router_kernel,no_router_gemm_split --ablate-repeats 1 \
        --max-model-len 8192} --step-trace "$OUT/trace_moonlight_" --out "$OUT/engine_moonlight_h200.json" 2>&1 \
        | tee "$OUT/engine_moonlight.log" | tail -16 ;;
    # the expert layers' combine kernel, their fused gather + gate/up + SiLU-mul, grouping and softmax top-k, the
    # latent attention stages, the shared experts' fused gate/up, the GELU gate/up epilogue and Qwen3.5's gated
    # attention stages: their GPU tests (the MoE families' and Qwen3.5's bf16 parity included; Qwen3.5's float32 one
    # autotunes fla-core for minutes on a fresh machine: the qwen35tests step), then the combine against
    # embedding_bag and the fused gate/up against its two passes at the model shapes
    combine) python3 -m pytest $PT -m gpu tests/test_moe_combine.py tests/test_moe_gate_up.py tests/test_moe_router.py tests/test_moe_group.py tests/test_softmax_topk.py tests/test_split_gemm.py tests/test_gated_qk.py \
        tests/test_gate_up_silu.py tests/test_deepseek_gpu.py tests/test_gpt_oss_gpu.py tests/test_moe.py tests/test_qwen3_5_gpu.py \
        -k "not qwen3_5_parity_gpu_float32" 2>&1 | tee "$OUT/gpu_combine_tests.log" | tail -25
      python3 bench/bench_moe_combine.py --out "$OUT/moe_combine.json" 2>&1 | tee "$OUT/moe_combine.log" | tail -8
      python3 bench/bench_moe_gate_up.py --out "$OUT/moe_gate_up.json" 2>&1 | tee "$OUT/moe_gate_up.log" | tail -14 ;;
    # Qwen3-Next alone (the last part of oss)
    qwen3next) python3 bench/bench_engine.py --model-size qwen3-next-80b-a3b $(fit_layers qwen3-next-80b-a3b) \
      ${OSS_NEXT_ARGS:---workloads W1 --http W1 --baseline W1 --repeats 1 --max-model-len 8192 --ablate W1 \
      --ablate-only as_configured,no_combine_kernel,flip_moe_gate_up,no_router_kernel,flip_group_kernel --ablate-repeats 1} \
      --step-trace "$OUT/trace_qwen3_next_" --out "$OUT/engine_qwen3_next_h200.json" 2>&1 | tee "$OUT/engine_qwen3_next.log" | tail -12 ;;
    # issue 50: gpt-oss and Qwen3-Next: the GPU tests (sinks on each fast backend against sdpa, float32 and bf16
    # parity), then gpt-oss-20b's shape and Qwen3-Next-80B-A3B's at 24 of its 48 layers on W1, in-process and through
    # HTTP beside transformers' own forward (gpt-oss: flex attention; one timed pass each to stay near 8 minutes:
    # $OSS_GPT_ARGS / $OSS_NEXT_ARGS replace the bench arguments, e.g. with --repeats 2)
    oss) [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest $PT -m gpu tests/test_gpt_oss_gpu.py 2>&1 | tee "$OUT/gpu_oss_tests.log" | tail -25
      python3 bench/bench_engine.py --model-size gpt-oss-20b ${OSS_GPT_ARGS:---workloads W1 --http W1 --baseline W1 \
        --repeats 1 --max-model-len 8192} --out "$OUT/engine_gpt_oss_20b_h200.json" 2>&1 | tee "$OUT/engine_gpt_oss.log" | tail -12
      python3 bench/bench_engine.py --model-size qwen3-next-80b-a3b $(fit_layers qwen3-next-80b-a3b) ${OSS_NEXT_ARGS:---workloads W1 --http W1 --baseline W1 \
        --repeats 1 --max-model-len 8192} --out "$OUT/engine_qwen3_next_h200.json" 2>&1 | tee "$OUT/engine_qwen3_next.log" | tail -12 ;;
    # Gemma 3 and GLM-4.5 (issue 50): their GPU tests (float32 parity, bf16 per attention backend beside transformers'
    # bf16), then $GEMMA_WL (default W1, the workload the issue's targets name) in-process and through HTTP beside
    # transformers' forward: Gemma-3-27B's text model (62 layers) and GLM-4.5-Air's layers (18 of 46);
    # $GEMMA_REPEATS timed passes each (default 1); $GEMMA_EXTRA adds bench flags (e.g. "--ablate W1
    # --ablate-only as_configured,no_fused_gate_up"). W1 is twice W1f's tokens: one shape a call (GEMMA_SHAPES)
    gemma) [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest $PT -m gpu tests/test_gemma_glm_gpu.py tests/test_gate_up_silu.py 2>&1 | tee "$OUT/gpu_gemma_glm_tests.log" | tail -25
      for shape in ${GEMMA_SHAPES:-gemma3-27b glm4.5-air}; do
        python3 bench/bench_engine.py --model-size $shape $(fit_layers $shape) --workloads ${GEMMA_WL:-W1} --http ${GEMMA_WL:-W1} \
          --baseline ${GEMMA_WL:-W1} --repeats ${GEMMA_REPEATS:-1} --max-model-len 8192 ${GEMMA_EXTRA:-} --step-trace "$OUT/trace_${shape}_" --out "$OUT/engine_${shape}_h200.json" 2>&1 \
          | tee "$OUT/engine_$shape.log" | tail -12
      done ;;
    # where a shape's step time goes: one profiled pass each of $PROFILE_SIZES (default moonlight) on $PROFILE_WL
    # (default W1f), in-process (per-kernel CUDA time in the .profile.txt files beside the results)
    profile) for size in ${PROFILE_SIZES:-moonlight}; do
        python3 bench/bench_engine.py --model-size $size $(fit_layers $size) --workloads ${PROFILE_WL:-W1f} \
          --profile ${PROFILE_WL:-W1f} --repeats 1 --max-model-len 8192 --out "$OUT/engine_${size}_profile.json" 2>&1 \
          | tee "$OUT/engine_${size}_profile.log" | grep -E "^W1|profile:|kernels"
      done ;;
    # cuBLASLt's candidates for the FP8 block-scaled products of a layer ($BLOCKALGOS_SIZE, default 8b) against
    # torch's F.scaled_mm pick, burst and sustained, then the layer's sequence with each side's picks ($BLOCKALGOS_ARGS: more)
    blockalgos) python3 bench/bench_gemm_algos.py --recipe block --sustain-top 6 --model-size ${BLOCKALGOS_SIZE:-8b} ${BLOCKALGOS_ARGS:-} \
        --out "$OUT/gemm_algos_block.json" 2>&1 | tee "$OUT/gemm_algos_block.log" | tail -12 ;;
    engine32b) python3 bench/bench_engine.py --model-size 32b ${ENGINE32_ARGS:---workloads W4 --baseline W4} --out "$OUT/engine_32b_h200.json" 2>&1 | tee "$OUT/engine32b.log" | tail -30 ;;
    *) echo "unknown step $step" ;;
  esac
  pack_cache
done
