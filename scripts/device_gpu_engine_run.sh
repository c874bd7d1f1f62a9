#!/usr/bin/env bash
# The device run of the GPU forward pass and the GPU engine (issue 18): one call does it all.
#
# Here, after building with CUDA ON (build/: cuda_model_test, model_test, kvbridge):
#   scripts/device_gpu_engine_run.sh carry build     # binaries + scripts + the shared libraries
#                                                    # the device image lacks -> .device/gpu
# Through the device tool (repo root of the checkout that travels), carry [".device/gpu"]:
#   bash .device/gpu/device_gpu_engine_run.sh
#
# Stages (env STAGES, default "env tests sanitizer golden serve"):
#   env        GPU, driver, nvcc, torch/transformers versions
#   tests      cuda_model_test (invariance bf16/fp8/fp32 on tiny and small, GPU vs CPU, callback,
#              errors, OOM, no memory growth) and model_test's CPU-side CudaPlan cases
#   sanitizer  compute-sanitizer memcheck over the GPU tests (tiny cases), racecheck and
#              synccheck over the kernel step (RacecheckSmallStep)
#   golden     per model shape in GOLDEN (default "small-llama small-qwen3 qwen2.5-0.5b qwen3-0.6b"): write
#              the model, export kvbridge GPU/CPU logits, compare with transformers fp32/bf16
#   serve      `kvbridge serve MODEL --device cuda` + the OpenAI API: n=8, streaming, greedy
#              equal to `generate --device cuda`, device memory after 10 vs 1000 requests
# Results: $OUT/summary.md (tables), $OUT/golden.md, $OUT/env.txt, $OUT/logs.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [[ "${1:-}" == "carry" ]]; then
  B=${2:-build}
  C=.device/gpu
  rm -rf "$C" && mkdir -p "$C/bin" "$C/lib"
  for f in tests/cuda_model_test tests/model_test bin/kvbridge; do
    if [[ -x "$B/$f" ]]; then objcopy --strip-debug "$B/$f" "$C/bin/$(basename "$f")"; else
      echo "note: $B/$f not built, not carried"; fi
  done
  cp scripts/device_gpu_engine_run.sh scripts/gpu_golden.py scripts/gpu_serve_check.py "$C/" 2>/dev/null
  ldd "$C"/bin/* | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcudart)\.so' |
    while read -r l; do cp -L "$l" "$C/lib/"; done
  ls "$C/lib"
  tar czf "$C/lib.tgz" -C "$C" lib && rm -rf "$C/lib"  # (ICU's data is 31 MB unpacked)
  du -sh "$C"
  exit 0
fi

OUT=${OUT:-$PWD/out-device}
L=$OUT/logs
mkdir -p "$L"
C=$HERE
if [[ -f "$C/lib.tgz" ]]; then  # the carried libraries, unpacked outside the checkout
  mkdir -p /tmp/kvb_gpu && tar xzf "$C/lib.tgz" -C /tmp/kvb_gpu
  export LD_LIBRARY_PATH=/tmp/kvb_gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
STAGES=${STAGES:-"env tests sanitizer golden serve"}
GOLDEN=${GOLDEN:-"small-llama small-qwen3 qwen2.5-0.5b qwen3-0.6b"}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$C/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONUNBUFFERED=1
S=$OUT/summary.md
rc=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
finish() {
  tar czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null && rm -rf "$L"
  echo "=== device run rc=$rc"
  exit $rc
}
run_test() {  # name log timeout cmd...
  local name=$1 log=$2 to=$3
  shift 3
  local t0=$SECONDS
  timeout "$to" "$@" >"$L/$log" 2>&1
  local c=$?
  local line
  line="| $name | rc=$c | $((SECONDS - t0)) s | $(grep -E '^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]+ test' "$L/$log" | tr '\n' ' ' | cut -c1-160) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$L/$log" | tail -1) |"
  echo "$line" | tee -a "$S"
  grep -E "Failure|FAILED  \]|rror:|Expected|Which is|actual" "$L/$log" | head -12
  ((c == 0)) || rc=1
}

if has env; then
  {
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    nvcc --version | tail -2
    uname -r
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  } 2>&1 | tee "$OUT/env.txt"
fi
echo "| check | result | time | tests |" >>"$S"
echo "|---|---|---|---|" >>"$S"

if has tests; then
  run_test "cuda_model_test (all)" cuda_model_test.log 400 "$C/bin/cuda_model_test"
  grep -hE '^(GPU_VS_CPU|MEMORY|UTILIZATION)' "$L/cuda_model_test.log" | sed 's/^/    /' | tee -a "$S"
  run_test "model_test CudaPlan (CPU side)" model_test.log 60 "$C/bin/model_test" --gtest_filter='CudaPlan*'
fi

if has sanitizer; then
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  run_test "memcheck: invariance tiny + callback + errors" memcheck.log 300 "$CS" --tool memcheck \
    --error-exitcode 3 "$C/bin/cuda_model_test" \
    --gtest_filter='*tiny*:*Callback*:*BadBatches*:*Racecheck*:*LogitsCloseToTheCpu*'
  run_test "racecheck: one step (every kernel)" racecheck.log 300 "$CS" --tool racecheck \
    --error-exitcode 3 "$C/bin/cuda_model_test" --gtest_filter='*RacecheckSmallStep*'
  run_test "synccheck: one step" synccheck.log 300 "$CS" --tool synccheck \
    --error-exitcode 3 "$C/bin/cuda_model_test" --gtest_filter='*RacecheckSmallStep*'
fi

if has golden; then
  M=/tmp/kvb_golden
  for shape in $GOLDEN; do
    mkdir -p "$M/$shape" "$M/$shape.out"
    KVB_MAKE_MODEL_SHAPE=$shape KVB_MAKE_MODEL_OUT=$M/$shape run_test "make model $shape" \
      "make_$shape.log" 300 "$C/bin/cuda_model_test" --gtest_filter='*MakeModel'
    KVB_GOLDEN_MODEL=$M/$shape KVB_GOLDEN_OUT=$M/$shape.out run_test "export logits $shape" \
      "export_$shape.log" 300 "$C/bin/cuda_model_test" --gtest_filter='*GoldenExport'
    timeout 300 python3 "$C/gpu_golden.py" --model "$M/$shape" --logits "$M/$shape.out" \
      --label "$shape" --md "$OUT/golden.md" >"$L/golden_$shape.log" 2>&1 || rc=1
    tail -12 "$L/golden_$shape.log"
  done
fi

if has serve; then
  if [[ -x "$C/bin/kvbridge" && -f "$C/gpu_serve_check.py" ]]; then
    timeout 400 python3 "$C/gpu_serve_check.py" --kvbridge "$C/bin/kvbridge" --work /tmp/kvb_serve \
      --md "$S" >"$L/serve.log" 2>&1 || rc=1
    tail -30 "$L/serve.log"
  else
    echo "| serve | not carried | | |" | tee -a "$S"
  fi
fi
cat "$S"
finish
