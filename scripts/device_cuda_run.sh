#!/usr/bin/env bash
# The whole device run of the cuda_ipc backend (issue 10): build the CUDA-only project
# tests/gpu/standalone, run the GPU conformance test, the benchmark (writes the table), and the
# conformance test once more under compute-sanitizer memcheck. Logs and the table go to $OUT.
#
# Here (once, to carry GoogleTest's sources):   scripts/device_cuda_run.sh prepare
# Through the device tool (repo root):          bash scripts/device_cuda_run.sh
#   with carry [".device/googletest"]. Optional env: BENCH_ARGS (default "--sweep"),
#   STAGES (default "build conformance bench sanitizer").
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "prepare" ]]; then
  mkdir -p .device && rm -rf .device/googletest && cp -r /usr/src/googletest .device/googletest
  echo "copied /usr/src/googletest to .device/googletest (carry it)"
  exit 0
fi
OUT=${OUT:-$PWD/out-device}
mkdir -p "$OUT"
B=${BUILD_DIR:-/tmp/kvb-cuda}
GT=${GTEST_SOURCE_DIR:-$PWD/.device/googletest}
[[ -d "$GT" ]] || GT=/usr/src/googletest
STAGES=${STAGES:-"build conformance bench sanitizer"}
BENCH_ARGS=${BENCH_ARGS:---sweep}
rc=0
has() { [[ " $STAGES " == *" $1 "* ]]; }

{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  nvcc --version | tail -2
  cmake --version | head -1
  uname -r
} 2>&1 | tee "$OUT/env.txt"

if has build; then
  t0=$SECONDS
  if ! { cmake -S tests/gpu/standalone -B "$B" -G Ninja -DGTEST_SOURCE_DIR="$GT" \
           -DCMAKE_BUILD_TYPE=Release && cmake --build "$B" -j"$(nproc)"; } >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    echo "BUILD FAILED"
    exit 1
  fi
  echo "=== build ok in $((SECONDS - t0))s"
  # 16-byte accesses in the copy kernel: count LDG/STG .128 in its SASS.
  cuobjdump -sass "$B/cuda_ipc/libkvbridge_cuda_ipc_core.a" >"$B/sass.txt" 2>&1 || true
  echo "SASS: $(grep -c 'LDG.E.*128' "$B/sass.txt") LDG.128, $(grep -c 'STG.E.*128' "$B/sass.txt") STG.128"
  grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | head -12
fi

if has conformance; then
  for t in cuda_ipc_conformance_test cuda_ipc_backend_test; do
    t0=$SECONDS
    timeout 180 "$B/bin/$t" >"$OUT/$t.log" 2>&1
    c=$?
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran|Failure" "$OUT/$t.log" | tail -12
    echo "=== $t rc=$c in $((SECONDS - t0))s"
    ((c == 0)) || rc=1
  done
fi

if has bench; then
  t0=$SECONDS
  # shellcheck disable=SC2086
  timeout 330 "$B/bin/cuda_ipc_bench" $BENCH_ARGS --out "$OUT/table.md" >"$OUT/bench.log" 2>&1
  b=$?
  echo "=== bench rc=$b in $((SECONDS - t0))s"
  ((b == 0)) || rc=1
fi

if has sanitizer; then
  if command -v compute-sanitizer >/dev/null; then
    # BadHandlesAreRefused makes deliberate invalid CUDA API calls, which memcheck reports.
    for t in "cuda_ipc_conformance_test:-*262144B*:*BadHandlesAreRefused*" "cuda_ipc_backend_test:*"; do
      t0=$SECONDS
      timeout 200 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
        "$B/bin/${t%%:*}" --gtest_filter="${t#*:}" >"$OUT/sanitizer_${t%%:*}.log" 2>&1
      s=$?
      grep -E "ERROR SUMMARY|tests ran|PASSED|FAILED" "$OUT/sanitizer_${t%%:*}.log" | tail -4
      echo "=== sanitizer ${t%%:*} rc=$s in $((SECONDS - t0))s"
      ((s == 0)) || rc=1
    done
  else
    echo "=== sanitizer: compute-sanitizer not on PATH (skipped)"
  fi
fi

if [[ -f "$OUT/bench.log" ]]; then cat "$OUT/bench.log"; fi
echo "=== device run rc=$rc"
exit $rc
