#!/usr/bin/env bash
# The device run of the GPU speed figures (issue 19), with the invariance tests of issue 18 in
# the same call (they must pass after every optimisation).
#
# Here, after building with CUDA ON (build/: cuda_speed_bench, cuda_model_test, model_test):
#   scripts/device_gpu_speed_run.sh carry build      # binaries, scripts, libraries -> .device/gpu
# Through the device tool (repo root of the checkout that travels), carry [".device/gpu"]:
#   bash .device/gpu/device_gpu_speed_run.sh
#
# Stages (env STAGES, default "env tests sanitizer bench variants torch hf hfc"):
#   env        GPU, driver, torch/transformers versions
#   tests      cuda_model_test (every invariance case, CreateRandom == the written model, GPU vs
#              CPU, memory) and model_test's CPU-side CudaPlan cases
#   sanitizer  compute-sanitizer memcheck (tiny cases, partitioned attention) and racecheck (one
#              step: every kernel; the attention partitions test on tiny bf16: both schedules)
#   bench      cuda_speed_bench: ceilings, our matmul / attention on qwen2.5-7b's shapes, the
#              qwen2.5-7b decode step at BATCHES for bf16 and fp8 KV, per-stage breakdown, prefill
#   variants   the matmul tile-shape variants (KVB_MATMUL_SMALL=1..3, KVB_MATMUL_MEDIUM=1): the
#              whole cuda_model_test under each, then our matmul table and the decode step
#   torch      gpu_speed_torch.py: torch.matmul and SDPA on the same shapes
#   hf         transformers generate(), eager, dynamic cache (HF_BATCHES)
#   hfc        transformers generate(), static cache + torch.compile, batch 1
# Results: $OUT/speed.md (our tables), $OUT/variants.md, $OUT/torch.md, $OUT/summary.md (tests),
# $OUT/logs.tgz (logs, the json figures).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [[ "${1:-}" == "carry" ]]; then
  B=${2:-build}
  bash scripts/device_gpu_engine_run.sh carry "$B" || exit 1
  objcopy --strip-debug "$B/tests/cuda_speed_bench" .device/gpu/bin/cuda_speed_bench || exit 1
  cp scripts/device_gpu_speed_run.sh scripts/gpu_speed_torch.py .device/gpu/
  du -sh .device/gpu
  exit 0
fi

OUT=${OUT:-$PWD/out-device}
L=$OUT/logs
mkdir -p "$L"
C=$HERE
if [[ -f "$C/lib.tgz" ]]; then
  mkdir -p /tmp/kvb_gpu && tar xzf "$C/lib.tgz" -C /tmp/kvb_gpu
  export LD_LIBRARY_PATH=/tmp/kvb_gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
STAGES=${STAGES:-"env tests sanitizer bench variants torch hf hfc"}
BATCHES=${BATCHES:-1,8,32,128}
HF_BATCHES=${HF_BATCHES:-1,8,32}
CTX=${CTX:-2048}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
  echo "| $name | rc=$c | $((SECONDS - t0)) s | $(grep -E '^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]+ test' "$L/$log" | tr '\n' ' ' | cut -c1-160) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$L/$log" | tail -1) |" | tee -a "$S"
  grep -E "Failure|FAILED  \]|rror:|Expected|Which is|actual" "$L/$log" | head -12
  ((c == 0)) || rc=1
}

if has env; then
  {
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  } 2>&1 | tee "$OUT/env.txt"
fi
echo "| check | result | time | tests |" >>"$S"
echo "|---|---|---|---|" >>"$S"
if has tests; then
  run_test "cuda_model_test (all)" cuda_model_test.log 400 "$C/bin/cuda_model_test"
  run_test "model_test CudaPlan (CPU side)" model_test.log 60 "$C/bin/model_test" --gtest_filter='CudaPlan*'
fi
if has sanitizer; then
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  run_test "memcheck: invariance tiny + CreateRandom + errors" memcheck.log 300 "$CS" --tool memcheck \
    --error-exitcode 3 "$C/bin/cuda_model_test" \
    --gtest_filter='*tiny*:*Callback*:*BadBatches*:*Racecheck*:*CreateRandom*:*AttentionPartitions*'
  KVB_TEST_LITE=1 run_test "racecheck: one step (every kernel) + attention partitions (tiny bf16, both schedules)" racecheck.log 300 "$CS" --tool racecheck \
    --error-exitcode 3 "$C/bin/cuda_model_test" --gtest_filter='*RacecheckSmallStep*:*AttentionPartitions*'
fi
cat "$S"
if has bench; then
  t0=$SECONDS
  timeout 420 "$C/bin/cuda_speed_bench" --out "$L" --batches "$BATCHES" --ctx "$CTX" \
    ${BENCH_ARGS:-} >"$L/bench.log" 2>&1 || { rc=1; tail -20 "$L/bench.log"; }
  cp "$L/speed.md" "$OUT/speed.md" 2>/dev/null
  echo "=== bench $((SECONDS - t0)) s"
fi
if has variants; then  # matmul tile-shape variants: invariance tests + matmul/decode under each
  V=$OUT/variants.md
  for spec in SMALL=1 SMALL=2 SMALL=3 MEDIUM=1; do
    var=KVB_MATMUL_${spec%%=*} val=${spec##*=}
    bs=1,8; [[ $var == *MEDIUM ]] && bs=32,128
    env "$var=$val" "$C/bin/cuda_model_test" >"$L/test_$spec.log" 2>&1
    c=$?
    ((c == 0)) || rc=1
    echo "| cuda_model_test with $var=$val | rc=$c | | $(grep -E '^\[  (PASSED|FAILED) +\] [0-9]+ test' "$L/test_$spec.log" | tr '\n' ' ') |" | tee -a "$S"
    { echo; echo "## $var=$val"; } >>"$V"
    env "$var=$val" timeout 120 "$C/bin/cuda_speed_bench" --sections matmul,decode --kv bf16 \
      --batches "$bs" --steps 10 --ctx "$CTX" 2>&1 | grep -E '^\|' >>"$V" || rc=1
  done
fi
if has torch; then
  timeout 300 python3 "$C/gpu_speed_torch.py" --sections matmul,sdpa --ctx "$CTX" --batches "$BATCHES" \
    --md "$OUT/torch.md" --json "$L/torch.json" >"$L/torch.log" 2>&1 || { rc=1; tail -20 "$L/torch.log"; }
fi
if has hf; then
  timeout 400 python3 "$C/gpu_speed_torch.py" --sections hf --ctx "$CTX" --batches "$HF_BATCHES" \
    --md "$OUT/torch.md" --json "$L/hf.json" >"$L/hf.log" 2>&1 || { rc=1; tail -20 "$L/hf.log"; }
fi
if has hfc; then
  timeout "${HFC_TIMEOUT:-500}" python3 "$C/gpu_speed_torch.py" --sections hf --compile --ctx "$CTX" \
    --md "$OUT/torch.md" --json "$L/hfc.json" >"$L/hfc.log" 2>&1 || { rc=1; tail -30 "$L/hfc.log"; }
fi
[[ -f "$OUT/speed.md" ]] && cat "$OUT/speed.md"
[[ -f "$OUT/variants.md" ]] && cat "$OUT/variants.md"
[[ -f "$OUT/torch.md" ]] && cat "$OUT/torch.md"
finish
